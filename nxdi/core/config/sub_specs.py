"""Sub-specs of NeuronSpec: on-device sampling, LoRA serving, MoE, chunked prefill, KV quantization. Pure.

Each is a frozen value whose field names are the documented NxDI attribute names. `parse_sub`
builds any of them from a raw mapping (user kwargs or JSON), reporting every unknown name and
every badly typed value at once.

(Over 400 lines: one small frozen value per documented sub-config, all built by the one `parse_sub`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.fields import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_DEGREE,
    MAX_SIZE,
    MAX_TOKENS,
    MAX_VOCAB,
    JsonMap,
    OnCpu,
    coerce,
    did_you_mean,
    field_types,
    setting,
    sub_spec_fields,
)
from nxdi.core.errors import ConfigError, Problem

S = TypeVar("S")


@attrs.frozen(kw_only=True)
class OnDeviceSamplingSpec:
    """Sampling inside the compiled program (NxDI `OnDeviceSamplingConfig`)."""

    do_sample: bool = setting(False, "Multinomial sampling when True, greedy argmax when False.")
    top_k: int = setting(
        1,
        "Default top-k; -1 or 0 means the whole vocabulary; must not exceed global_topk.",
        bounds=(-1, MAX_VOCAB),
    )
    top_p: float = setting(
        1.0,
        "Default nucleus (top-p) threshold, in (0, 1].",
        validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)],
    )
    temperature: float = setting(
        1.0, "Default sampling temperature, >= 0 (0 means greedy).", validator=attrs.validators.ge(0.0)
    )
    dynamic: bool = setting(
        False, "Take per-row top_k, top_p and temperature from the [batch, 3] sampling_params at run time."
    )
    deterministic: bool = setting(
        False, "Use 0.5 instead of a random draw when picking from the cumulative distribution."
    )
    global_topk: int = setting(
        256, "Candidates kept before per-row top-k; 0 sorts the whole vocabulary.", bounds=(0, MAX_VOCAB)
    )
    on_device_sampling_config: bool = setting(True, "Literal flag kept for serialization compatibility; always True.")
    top_k_kernel_enabled: bool = setting(
        False,
        "Use the Neuron top-k kernel; default True on platforms other than trn1, False on trn1.",
        cpu="Neuron kernel",
    )
    sampling_dp_degree: int = setting(
        1,
        "Data-parallel degree for batch-sharded sampling, >= 1.",
        bounds=(1, MAX_DEGREE),
        cpu="one host samples every row",
    )


@attrs.frozen(kw_only=True)
class LoraSpec:
    """Multi-LoRA serving (NxDI `LoraServingConfig`), with checkpoint paths already resolved to a map."""

    max_loras: int = setting(
        1,
        "Adapters resident in device memory at once; raised to the number of lora_ckpt_paths.",
        bounds=(1, MAX_COUNT),
    )
    max_lora_rank: int = setting(
        16, "Largest adapter rank; smaller adapters are zero-padded to it.", bounds=(1, MAX_SIZE)
    )
    max_cpu_loras: int = setting(
        100,
        "Adapters kept in host memory with dynamic_multi_lora (configured and added at run time); lora_ckpt_paths_cpu may not hold more.",
        bounds=(1, MAX_COUNT),
        graph=False,
    )
    batch_size: int = setting(
        1,
        "Batch size, in sequences, the LoRA serving layers are built for.",
        bounds=(1, MAX_BATCH),
        cpu="the LoRA programs take the model's own batch sizes",
    )
    target_modules: tuple[str, ...] | None = setting(
        None, "Modules that carry adapters (union of the adapters' target_modules when read from disk)."
    )
    lora_bias: Literal["none", "all", "lora_only"] = setting(
        "none",
        'Which biases the adapters train: "none", "all" or "lora_only".',
        cpu=OnCpu.REFUSED,
        cpu_note="adapter biases are not applied; only lora_bias='none' is served",
    )
    lora_ckpt_paths: JsonMap | None = setting(
        None, 'Adapter id to checkpoint path for device-resident adapters (also "id : path" strings).', graph=False
    )
    lora_ckpt_paths_cpu: JsonMap | None = setting(
        None,
        "Adapter id to checkpoint path for adapters kept in host memory.",
        graph=False,
    )
    lora_ckpt_json: str | None = setting(
        None,
        "JSON file listing adapter checkpoints (lora-ckpt-dir, lora-ckpt-paths, lora-ckpt-paths-cpu).",
        graph=False,
    )
    lora_memory_transpose: bool = setting(
        True,
        "Store every adapter matrix as [in, out] (the layout the batched products read directly); False stores [out, in].",
    )
    lora_shard_linear_layer: bool = setting(
        True,
        "Shard the adapter's linear layer across the TP group (1/tp_degree per core, adds all-gather).",
        cpu=OnCpu.WITH_TP,
    )
    is_context_encoding: bool = setting(
        False, "Marks LoRA layers of the context-encoding model.", cpu="every program carries the same adapters"
    )
    dynamic_multi_lora: bool = setting(
        False,
        'Swap adapters between host and device at run time; adds ".*lora.*" to layout-optimization skips.',
    )
    eviction_policy: Literal["lru", "lfu"] = setting(
        "lru",
        'Which device adapter dynamic_multi_lora evicts for a missing one: "lru" (least recently used) or "lfu" (least used).',
        graph=False,
    )
    lfu_decay_period: int = setting(
        128,
        "Forwards after which every LFU use count is halved (eviction_policy='lfu').",
        bounds=(1, MAX_TOKENS),
        graph=False,
    )
    base_model_quantized: bool = setting(
        False,
        "The base model's weights are quantized.",
        cpu="quantized=True decides the base weights; adapters add to either kind",
    )
    enable_base_model_only: bool = setting(False, "Reserve one extra adapter slot for requests that use no adapter.")

    @property
    def effective_max_loras(self) -> int:
        return self.max_loras + (1 if self.enable_base_model_only else 0)


@attrs.frozen(kw_only=True)
class ChunkedPrefillSpec:
    """Chunked prefill (NxDI `ChunkedPrefillConfig`)."""

    max_num_seqs: int = setting(
        0,
        "Sequences concatenated into one chunked-prefill request (the effective batch size).",
        bounds=(0, MAX_BATCH),
    )
    tkg_model_enabled: bool = setting(
        True, "Also compile a separate token-generation model for decode-only steps; when False batch_size must be 1."
    )
    kernel_q_tile_size: int = setting(
        128, "Query tile length, in tokens, used by the chunked-prefill kernel.", bounds=(1, MAX_TOKENS)
    )
    kernel_kv_tile_size: int = setting(
        1024, "KV-cache tile length, in tokens, used by the chunked-prefill kernel.", bounds=(1, MAX_TOKENS)
    )


QuantGranularity = Literal["per_tensor_symmetric", "per_channel_symmetric", "per_key_symmetric"]


_SCALED_ONLY = "scaled KV quantization (direct_cast=False) needs per-layer K/V scales, which nxdi does not load"


@attrs.frozen(kw_only=True)
class KVQuantSpec:
    """KV-cache quantization (NxD `KVQuantizationConfig`, whose attribute names these are)."""

    quant_dtype: Literal["float8_e4m3fn", "float8_e5m2"] = setting(
        "float8_e4m3fn", "dtype of the quantized KV cache: float8_e4m3fn or float8_e5m2 (a torch dtype is accepted)."
    )
    direct_cast: bool = setting(
        True,
        "Plain dtype casts in both directions, with no scales (values past the dtype's range saturate).",
        cpu=OnCpu.REFUSED,
        cpu_note=_SCALED_ONLY,
    )
    k_quant_method: QuantGranularity = setting(
        "per_tensor_symmetric",
        "Scale granularity for K with direct_cast=False: per_tensor_symmetric, per_channel_symmetric or per_key_symmetric.",
        cpu=OnCpu.REFUSED,
        cpu_note=_SCALED_ONLY,
    )
    v_quant_method: QuantGranularity = setting(
        "per_tensor_symmetric",
        "Scale granularity for V with direct_cast=False: per_tensor_symmetric, per_channel_symmetric or per_key_symmetric.",
        cpu=OnCpu.REFUSED,
        cpu_note=_SCALED_ONLY,
    )


@attrs.frozen(kw_only=True)
class RouterSpec:
    """MoE router: activation and dtype."""

    act_fn: Literal["softmax", "sigmoid"] = setting(
        "softmax", 'Activation over the router\'s expert logits: "softmax" or "sigmoid".'
    )
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = setting(
        "float32", "Data type the router computes in (a torch dtype or its name)."
    )


@attrs.frozen(kw_only=True)
class HybridShardingSpec:
    """Separate MoE TP/EP degrees for context encoding and token generation."""

    moe_cte_tp_degree: int = setting(
        1, "Tensor-parallel degree of MoE layers in context encoding.", bounds=(1, MAX_DEGREE)
    )
    moe_cte_ep_degree: int = setting(
        1, "Expert-parallel degree of MoE layers in context encoding.", bounds=(1, MAX_DEGREE)
    )
    moe_tkg_tp_degree: int = setting(
        1, "Tensor-parallel degree of MoE layers in token generation.", bounds=(1, MAX_DEGREE)
    )
    moe_tkg_ep_degree: int = setting(
        1, "Expert-parallel degree of MoE layers in token generation.", bounds=(1, MAX_DEGREE)
    )


@attrs.frozen(kw_only=True)
class MoESpec:
    """Mixture-of-experts options (NxDI `MoENeuronConfig` attributes)."""

    capacity_factor: float | None = setting(
        None, "Tokens per expert as a multiple of the fair share; None never drops tokens."
    )
    glu_mlp: bool = setting(
        True,
        "Experts use a gated (GLU) MLP.",
        cpu=OnCpu.REFUSED,
        cpu_note="every family nxdi runs has gated experts (gate and up projections): False would not fit the checkpoint",
    )
    glu_type: Literal["glu", "swiglu"] = setting("glu", 'Gated activation form: "glu" or "swiglu".')
    hidden_act_scaling_factor: float = setting(1.0, "Scaling factor applied inside the expert activation.")
    hidden_act_bias: float = setting(0.0, "Bias added inside the expert activation.")
    gate_clamp_upper_limit: float | None = setting(
        None, "Upper clamp on the expert gate projection output; default None (no clamp)."
    )
    gate_clamp_lower_limit: float | None = setting(
        None, "Lower clamp on the expert gate projection output; default None (no clamp)."
    )
    up_clamp_upper_limit: float | None = setting(
        None, "Upper clamp on the expert up projection output; default None (no clamp)."
    )
    up_clamp_lower_limit: float | None = setting(
        None, "Lower clamp on the expert up projection output; default None (no clamp)."
    )
    use_index_calc_kernel: bool = setting(
        False, "Use the index-calculation kernel for expert token routing.", cpu="a Neuron kernel"
    )
    moe_mask_padded_tokens: bool = setting(
        False, "Exclude padding tokens from expert routing: they take no expert capacity and output zero."
    )
    early_expert_affinity_modulation: bool = setting(
        False, "Scale expert inputs by router affinities before the expert MLP instead of after."
    )
    normalize_top_k_affinities: bool = setting(
        True, "Renormalize the top-k router weights to sum to 1 (kwarg alias: not disable_normalize_top_k_affinities)."
    )
    fused_shared_experts: bool = setting(
        False,
        "Fuse the shared experts into the routed-expert computation.",
        cpu="no family nxdi runs has shared experts",
    )
    shared_experts_sequence_parallel_enabled: bool = setting(
        False, "Run the shared experts with sequence parallelism.", cpu="no family nxdi runs has shared experts"
    )
    return_expert_index: bool = setting(
        False,
        "forward() also returns expert_index: per layer, the [B*W, top_k] chosen experts of the input_ids tokens.",
    )
    return_router_logits: bool = setting(
        False,
        "forward() also returns router_logits: per layer, the [B*W, experts] fp32 logits of the input_ids tokens.",
    )
    hybrid_sharding_config: HybridShardingSpec | None = setting(
        None,
        "Separate MoE TP/EP degrees for context encoding and token generation (ranks hold both expert layouts); replaces moe_tp/ep_degree.",
    )
    moe_tp_degree: int = setting(
        1,
        "Ranks splitting each expert's intermediate width; moe_tp_degree x moe_ep_degree = tp_degree (1 with moe_ep_degree 1: unset, every rank splits every expert).",
        bounds=(1, MAX_DEGREE),
    )
    moe_ep_degree: int = setting(
        1,
        "Expert groups the experts are split over; rank r holds group r // moe_tp_degree (divides tp_degree and the experts).",
        bounds=(1, MAX_DEGREE),
    )
    transpose_shared_experts_weights: bool = setting(
        False, "Transpose the shared-expert weights at load.", cpu="no family nxdi runs has shared experts"
    )
    blockwise_matmul_config: JsonMap = setting(
        JsonMap(),
        "Blockwise expert matmul settings (NxD BlockwiseMatmulConfig kwargs); default empty.",
        cpu="settings of a Neuron kernel",
    )
    router_config: RouterSpec = setting(
        RouterSpec(),
        "Router activation and dtype; router_act_fn and router_dtype kwargs fill it; default softmax, float32.",
    )

    def ep_degree(self, *, token_generation: bool) -> int:
        """The expert groups of context encoding or of token generation: `hybrid_sharding_config`'s
        degree for that phase when set, else `moe_ep_degree` for both."""
        h = self.hybrid_sharding_config
        if h is None:
            return self.moe_ep_degree
        return h.moe_tkg_ep_degree if token_generation else h.moe_cte_ep_degree

    @property
    def hybrid(self) -> bool:
        """Whether context encoding and token generation lay the experts out differently (each rank
        then holds both layouts: NxD's `mlp_op` and `mlp_op_tkg`)."""
        return self.ep_degree(token_generation=False) != self.ep_degree(token_generation=True)


def _user_name(cls: type) -> str:
    """The class users know a sub-spec by (`RouterSpec` -> `RouterConfig`, `LoraSpec` -> `LoraServingConfig`)."""
    return "LoraServingConfig" if cls is LoraSpec else cls.__name__.removesuffix("Spec") + "Config"


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls))


def parse_sub(cls: type[S], raw: Mapping[str, Any], *, prefix: str) -> Result[S, ConfigError]:
    """Build sub-spec `cls` from a raw mapping (or return an existing instance unchanged).

    Returns a Failure listing every unknown name (with suggestions) and every badly typed or
    out-of-range value, each field named `prefix.name`.
    """
    if isinstance(raw, cls):
        return Success(raw)
    if not isinstance(raw, Mapping):
        return Failure(ConfigError.of(prefix, raw, f"must be a {_user_name(cls)} or a dict of its attributes"))
    types_ = field_types(cls)
    nested = sub_spec_fields(cls)
    known = _names(cls)
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, value in raw.items():
        if name not in types_:
            problems.append(
                Problem.of(f"{prefix}.{name}", value, "is not a known attribute", did_you_mean(name, known))
            )
            continue
        sub = nested.get(name)
        if sub is not None and value is not None:  # a nested sub-spec: an instance or a dict of its attributes
            match parse_sub(sub, value, prefix=f"{prefix}.{name}"):
                case Success(v):
                    values[name] = v
                case Failure(err):
                    problems.extend(err.problems)
            continue
        converted, problem = coerce(f"{prefix}.{name}", value, types_[name])
        if problem:
            problems.append(problem)
        else:
            values[name] = converted
    return construct(cls, values, prefix=prefix, problems=problems)


def construct(
    cls: type[S], values: Mapping[str, Any], *, prefix: str, problems: list[Problem] | None = None
) -> Result[S, ConfigError]:
    """Run the attrs validators on `values`, reporting each out-of-range field along with `problems`."""
    found = list(problems or [])
    found.extend(p for name, value in values.items() if (p := check_field(cls, name, value, prefix)) is not None)
    if found:
        return Failure(ConfigError(problems=tuple(found)))
    return Success(cls(**values))


def check_field(cls: type, name: str, value: Any, prefix: str) -> Problem | None:
    """The problem attrs' validator of field `name` finds in `value`, or None."""
    field = attrs.fields_dict(cls)[name]
    if field.validator is None:
        return None
    try:
        field.validator(None, field, value)
    except (ValueError, TypeError) as exc:
        # attrs says "'name' must be > 0: 0"; keep only "must be > 0".
        reason = str(exc.args[0]).rsplit(": ", 1)[0] if exc.args else "is out of range"
        full = f"{prefix}.{name}" if prefix else name
        return Problem.of(full, value, reason.replace(f"'{name}' ", ""))
    return None

"""Sub-specs of NeuronSpec: on-device sampling, LoRA serving, MoE, chunked prefill, KV quantization. Pure.

Each is a frozen value whose field names are the documented NxDI attribute names. `parse_sub`
builds any of them from a raw mapping (user kwargs or JSON), reporting every unknown name and
every badly typed value at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.fields import JsonMap, coerce, did_you_mean, field_types, json_value
from nxdi.core.errors import ConfigError, Problem

S = TypeVar("S")


@attrs.frozen(kw_only=True)
class OnDeviceSamplingSpec:
    """Sampling inside the compiled program (NxDI `OnDeviceSamplingConfig`)."""

    do_sample: bool = False
    """Multinomial sampling when True, greedy argmax when False."""
    top_k: int = attrs.field(default=1, validator=attrs.validators.ge(-1))
    """Default top-k; -1 or 0 means the whole vocabulary."""
    top_p: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    """Default nucleus threshold in (0, 1]."""
    temperature: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    """Default temperature, >= 0 (0 means greedy)."""
    dynamic: bool = False
    """Take per-row top_k/top_p/temperature from `sampling_params` at run time."""
    deterministic: bool = False
    """Use 0.5 instead of a random draw when picking from the cumulative distribution."""
    global_topk: int = attrs.field(default=256, validator=attrs.validators.ge(0))
    """Candidates kept before per-row top-k (0: sort the whole vocabulary)."""
    on_device_sampling_config: bool = True
    """Literal flag the reference serializes; always True."""
    top_k_kernel_enabled: bool = False
    """Use the Neuron top-k kernel (reference default: platform is not trn1). No effect on CPU."""
    sampling_dp_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Batch-sharded (data-parallel) sampling degree."""


@attrs.frozen(kw_only=True)
class LoraSpec:
    """Multi-LoRA serving (NxDI `LoraServingConfig`), with checkpoint paths already resolved to a map."""

    max_loras: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Adapters resident in device memory at once (raised to the number of checkpoints given)."""
    max_lora_rank: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    """Largest adapter rank; smaller adapters are zero-padded to it."""
    max_cpu_loras: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    batch_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    target_modules: tuple[str, ...] | None = None
    """Modules that carry adapters (union of the adapters' target_modules when read from disk)."""
    lora_bias: Literal["none", "all", "lora_only"] = "none"
    lora_ckpt_paths: JsonMap | None = None
    """Adapter id -> checkpoint path, resident on device."""
    lora_ckpt_paths_cpu: JsonMap | None = None
    """Adapter id -> checkpoint path, kept in host memory."""
    lora_ckpt_json: str | None = None
    """JSON file the paths were read from, if any."""
    lora_memory_transpose: bool = True
    lora_shard_linear_layer: bool = True
    """Shard the adapter's linear layer across the TP group (per-core size = size / tp)."""
    is_context_encoding: bool = False
    dynamic_multi_lora: bool = False
    eviction_policy: Literal["lru", "lfu"] = "lru"
    lfu_decay_period: int = attrs.field(default=128, validator=attrs.validators.ge(1))
    base_model_quantized: bool = False
    enable_base_model_only: bool = False
    """Reserve one extra slot for requests without an adapter (applied once, unlike the reference)."""

    @property
    def effective_max_loras(self) -> int:
        return self.max_loras + (1 if self.enable_base_model_only else 0)


@attrs.frozen(kw_only=True)
class ChunkedPrefillSpec:
    """Chunked prefill (NxDI `ChunkedPrefillConfig`)."""

    max_num_seqs: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    tkg_model_enabled: bool = True
    kernel_q_tile_size: int = attrs.field(default=128, validator=attrs.validators.gt(0))
    kernel_kv_tile_size: int = attrs.field(default=1024, validator=attrs.validators.gt(0))


QuantGranularity = Literal["per_tensor_symmetric", "per_channel_symmetric", "per_key_symmetric"]


@attrs.frozen(kw_only=True)
class KVQuantSpec:
    """KV-cache quantization (NxD `KVQuantizationConfig`)."""

    quant_dtype: Literal["float8_e4m3fn", "float8_e5m2"] = "float8_e4m3fn"
    direct_cast: bool = True
    """Plain dtype casts both ways, no scales."""
    k_quantization_type: QuantGranularity = "per_tensor_symmetric"
    v_quantization_type: QuantGranularity = "per_tensor_symmetric"


@attrs.frozen(kw_only=True)
class RouterSpec:
    """MoE router: activation and dtype."""

    act_fn: Literal["softmax", "sigmoid"] = "softmax"
    dtype: str = "float32"


@attrs.frozen(kw_only=True)
class HybridShardingSpec:
    """Separate MoE TP/EP degrees for context encoding and token generation."""

    moe_cte_tp_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    moe_cte_ep_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    moe_tkg_tp_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    moe_tkg_ep_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class MoESpec:
    """Mixture-of-experts options (NxDI `MoENeuronConfig` attributes)."""

    capacity_factor: float | None = None
    """Tokens per expert = capacity_factor * fair share; None never drops tokens."""
    glu_mlp: bool = True
    glu_type: Literal["glu", "swiglu"] = "glu"
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    gate_clamp_upper_limit: float | None = None
    gate_clamp_lower_limit: float | None = None
    up_clamp_upper_limit: float | None = None
    up_clamp_lower_limit: float | None = None
    use_index_calc_kernel: bool = False
    moe_mask_padded_tokens: bool = False
    early_expert_affinity_modulation: bool = False
    normalize_top_k_affinities: bool = True
    """Renormalize the top-k router weights to sum to 1 (kwarg alias: not disable_normalize_top_k_affinities)."""
    fused_shared_experts: bool = False
    shared_experts_sequence_parallel_enabled: bool = False
    return_expert_index: bool = False
    return_router_logits: bool = False
    hybrid_sharding_config: HybridShardingSpec | None = None
    moe_tp_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    moe_ep_degree: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    transpose_shared_experts_weights: bool = False
    blockwise_matmul_config: JsonMap = JsonMap()  # noqa: RUF009 - frozen, so sharing the default is safe
    router_config: RouterSpec = RouterSpec()


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
        return Failure(ConfigError.of(prefix, raw, f"must be a {cls.__name__} or a dict of its attributes"))
    types_ = field_types(cls)
    known = _names(cls)
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, value in raw.items():
        if name not in types_:
            problems.append(
                Problem.of(f"{prefix}.{name}", value, "is not a known attribute", did_you_mean(name, known))
            )
            continue
        sub = _NESTED.get(types_[name])
        if sub is not None and isinstance(value, Mapping):
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


def sub_to_dict(value: Any) -> dict[str, Any]:
    """Every attribute of a sub-spec as standard JSON values (nested sub-specs as dicts)."""
    out: dict[str, Any] = {}
    for f in attrs.fields(type(value)):
        v = getattr(value, f.name)
        out[f.name] = sub_to_dict(v) if attrs.has(type(v)) and not isinstance(v, JsonMap) else json_value(v)
    return out


_NESTED: Mapping[Any, type] = {
    HybridShardingSpec | None: HybridShardingSpec,
    RouterSpec: RouterSpec,
}
"""Annotations whose dict values are parsed as nested sub-specs."""

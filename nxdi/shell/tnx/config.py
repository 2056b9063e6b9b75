"""transformers-neuronx's `NeuronConfig` and its sub-configs, and how each maps onto nxdi's NeuronConfig.

These are the guide's classes (distinct from NxDI's `nxdi.NeuronConfig`): `NeuronConfig`, `GQA`,
`QuantizationConfig`, `ContinuousBatchingConfig` and `GenerationConfig` (on-device sampling).
Every setting has one disposition, declared once in `SETTINGS` (rules as data):

- mapped: it becomes nxdi NeuronConfig attributes (`nxdi_kwargs`), and nxdi checks it as it checks
  its own settings (`fuse_qkv` -> `fused_qkv`, `shard_over_sequence` -> `flash_decoding_enabled`,
  `on_device_generation` -> `on_device_sampling_config`, `quant` -> int8 weight storage, ...);
- inert: a device layout or kernel choice that cannot change what the CPU engine computes
  (`attention_layout`, `group_query_attention`, `on_device_embedding`, ...); accepted and reported
  once, in the same warning as nxdi's own settings without effect on the CPU backend;
- refused: nxdi does not implement it yet; a non-default value raises naming it.

An unknown keyword or a bad value raises `IncompatibleConfigError` naming it (every problem listed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nxdi.core.planning.gqa import TnxStrategy
from nxdi.shell.exceptions import IncompatibleConfigError

GQA = TnxStrategy
"""The K/V sharding strategies of grouped-query attention (`GQA.SHARD_OVER_HEADS`, `SHARD_OVER_BATCH`,
`REPLICATED_HEADS`, `ALL_GATHER_HEADS`); `nxdi.core.planning.gqa.determine_tnx_strategy` resolves them."""


class Layout:
    """The attention / collectives / cache layouts transformers-neuronx names (`NeuronConfig(attention_layout=)`)."""

    HSB = "HSB"
    BSH = "BSH"
    SBH = "SBH"


_LAYOUTS = {"attention_layout": ("HSB", "BSH"), "collectives_layout": ("HSB", "BSH"), "cache_layout": ("SBH", "BSH")}


def _fail(problems: Sequence[str], what: str) -> None:
    if problems:
        raise IncompatibleConfigError(f"Invalid {what}:\n" + "\n".join(f"  {p}" for p in problems))


class QuantizationConfig:
    """int8 weight storage (`NeuronConfig(quant=QuantizationConfig(quant_dtype='s8', dequant_dtype='bf16'))`).

    Maps onto nxdi's weight quantization: per-channel symmetric int8 ('vector_dynamic') or
    per-tensor ('direct_cast'), weights dequantized to `dequant_dtype`, which must equal the
    model's `amp` (checked by `from_pretrained`).

    Raises:
        IncompatibleConfigError: an unknown quant_dtype, dequant_dtype or quantize_method.
    """

    def __init__(
        self,
        quant_dtype: str = "s8",
        dequant_dtype: str = "f16",
        quantize_method: str = "vector_dynamic",
        quantize_attn: bool = True,
        no_quantize_list: Sequence[str] = (),
    ) -> None:
        problems = []
        if quant_dtype not in ("s8", "f8e4m3fn"):
            problems.append(f"quant_dtype={quant_dtype!r}: is not 's8' or 'f8e4m3fn'")
        if dequant_dtype not in ("f32", "bf16", "f16"):
            problems.append(f"dequant_dtype={dequant_dtype!r}: is not 'f32', 'bf16' or 'f16'")
        if quantize_method not in ("vector_dynamic", "direct_cast"):
            problems.append(f"quantize_method={quantize_method!r}: is not 'vector_dynamic' or 'direct_cast'")
        _fail(problems, "QuantizationConfig")
        self.quant_dtype = quant_dtype
        self.dequant_dtype = dequant_dtype
        self.quantize_method = quantize_method
        self.quantize_attn = quantize_attn
        self.no_quantize_list = list(no_quantize_list)

    def nxdi_kwargs(self) -> dict[str, Any]:
        """nxdi's quantization attributes (the checkpoint path is added by the model). Module names
        are substrings of weight paths there: `self_attn` (quantize_attn=False) and `layers.N.` for a
        no_quantize_list entry `model.layers.N`."""
        skip = [] if self.quantize_attn else ["self_attn"]
        skip += [n.removeprefix("model.") + "." for n in self.no_quantize_list]
        return {
            "quantized": True,
            "quantization_dtype": "int8" if self.quant_dtype == "s8" else "f8e4m3",
            "quantization_type": "per_channel_symmetric"
            if self.quantize_method == "vector_dynamic"
            else "per_tensor_symmetric",
            **({"modules_to_not_convert": skip} if skip else {}),
        }


class ContinuousBatchingConfig:
    """Continuous batching: `ContinuousBatchingConfig(batch_size_for_shared_caches=N)` (or `max_num_seqs=N`).

    Maps onto nxdi's `is_continuous_batching` with a KV cache of N sequence slots; `sample(...,
    start_ids=)` then names the slots (NxDI's `seq_ids`).

    Raises:
        IncompatibleConfigError: neither size given, an unknown keyword, or paged attention /
            chunked prefill (not implemented through this API).
    """

    def __init__(self, **kwargs: Any) -> None:
        size = kwargs.pop("max_num_seqs", None) or kwargs.pop("batch_size_for_shared_caches", None)
        self.max_model_len = kwargs.pop("max_model_len", None)
        self.optimized_paged_attention = bool(kwargs.pop("optimized_paged_attention", False))
        self.enable_chunked_prefill = bool(kwargs.pop("enable_chunked_prefill", False))
        problems = [f"{k}={v!r}: is not a ContinuousBatchingConfig argument" for k, v in kwargs.items()]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            problems.append(f"batch_size_for_shared_caches={size!r}: must be a positive int (or give max_num_seqs)")
        for name in ("optimized_paged_attention", "enable_chunked_prefill"):
            if getattr(self, name):
                problems.append(f"{name}=True: is not supported through this API; use nxdi's block KV layout")
        _fail(problems, "ContinuousBatchingConfig")
        self.max_num_seqs: int = size

    @property
    def batch_size_for_shared_caches(self) -> int:
        return self.max_num_seqs


class GenerationConfig:
    """On-device generation (`NeuronConfig(on_device_generation=GenerationConfig(...))`).

    Maps onto nxdi's `on_device_sampling_config`. With `per_batch_line=True`, `top_k`, `top_p`,
    `top_p_min_tokens` and `temperature` take one value per sequence; with `dynamic=True`,
    `update_generation_config` changes them between calls.

    Raises:
        IncompatibleConfigError: a value out of range, lists without per_batch_line, or
            top_p_min_tokens other than 1 (nxdi's top-p keeps at least one token).
    """

    def __init__(
        self,
        *,
        max_length: int | None = None,
        do_sample: bool = False,
        top_k: int | list[int] = 50,
        top_p: float | list[float] = 1.0,
        top_p_min_tokens: int | list[int] = 1,
        global_top_k: int | None = None,
        eos_token_id: int | None = None,
        temperature: float | list[float] = 1.0,
        dynamic: bool = False,
        deterministic: bool = False,
        per_batch_line: bool = False,
    ) -> None:
        self.max_length = max_length
        self.do_sample = do_sample
        self.per_batch_line = per_batch_line
        self.top_k = top_k
        self.top_p = [float(p) for p in top_p] if isinstance(top_p, list) else float(top_p)
        self.temperature = [float(t) for t in temperature] if isinstance(temperature, list) else float(temperature)
        self.top_p_min_tokens = top_p_min_tokens
        self.global_top_k = global_top_k
        self.eos_token_id = eos_token_id
        self.dynamic = dynamic
        self.deterministic = deterministic
        _fail(self.problems(), "GenerationConfig")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GenerationConfig) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as the guide's example assigns its fields

    def problems(self, batch_size: int | None = None) -> list[str]:
        """Every bad value, each naming its field (with `batch_size`, per-row lists of the wrong length too)."""
        out = []
        for name in ("top_k", "top_p", "temperature", "top_p_min_tokens"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            if isinstance(value, list) and not self.per_batch_line:
                out.append(f"{name}={value!r}: a list needs per_batch_line=True")
            if isinstance(value, list) and batch_size is not None and len(value) != batch_size:
                out.append(f"{name}={value!r}: needs one value per sequence (batch_size={batch_size})")
            for v in values:
                if name == "top_k" and not (isinstance(v, int) and v >= -1):
                    out.append(f"top_k={v!r}: must be an int >= 1 (0 or -1: the whole vocabulary)")
                elif name == "top_p" and not 0.0 < v <= 1.0:
                    out.append(f"top_p={v!r}: must lie in (0, 1]")
                elif name == "temperature" and not v > 0.0:
                    out.append(f"temperature={v!r}: must be > 0")
                elif name == "top_p_min_tokens" and v != 1:
                    out.append(f"top_p_min_tokens={v!r}: nxdi's on-device top-p keeps at least 1 token; set 1")
        if self.global_top_k is not None and not (isinstance(self.global_top_k, int) and self.global_top_k >= 0):
            out.append(f"global_top_k={self.global_top_k!r}: must be an int >= 0")
        return out

    def rows(self, batch_size: int) -> list[list[float]]:
        """The [B, 3] per-row (top_k, top_p, temperature) sampling parameters."""

        def per_row(value: Any) -> list[Any]:
            return list(value) if isinstance(value, list) else [value] * batch_size

        ks, ps, ts = per_row(self.top_k), per_row(self.top_p), per_row(self.temperature)
        return [[float(k if self.do_sample else 1), float(p), float(t)] for k, p, t in zip(ks, ps, ts, strict=True)]

    def nxdi_kwargs(self) -> dict[str, Any]:
        """nxdi's `OnDeviceSamplingConfig` attributes."""
        dynamic = self.dynamic or self.per_batch_line
        top_k = max(self.top_k) if isinstance(self.top_k, list) else self.top_k
        top_p = self.top_p[0] if isinstance(self.top_p, list) else self.top_p
        temperature = self.temperature[0] if isinstance(self.temperature, list) else self.temperature
        global_top_k = self.global_top_k if self.global_top_k is not None else max(256, top_k)
        return {
            "do_sample": self.do_sample,
            "top_k": top_k if self.do_sample else 1,
            "top_p": top_p,
            "temperature": temperature,
            "dynamic": dynamic,
            "deterministic": self.deterministic,
            "global_topk": global_top_k,
        }


_INERT = "a Neuron device layout or kernel choice; the CPU engine computes the same values without it"
SETTINGS: dict[str, tuple[Any, str, str]] = {
    # name: (default, disposition, what nxdi does with it)
    "sparse_attn": (None, "refused", "sparse attention is not implemented"),
    "quant": (None, "mapped", "int8 weight storage (quantized, quantization_dtype, quantization_type)"),
    "kv_cache_quant": (None, "refused", "use nxdi's NeuronConfig(kv_cache_quant=True) instead"),
    "continuous_batching": (None, "mapped", "is_continuous_batching"),
    "attention_layout": ("HSB", "inert", _INERT),
    "collectives_layout": ("HSB", "inert", _INERT),
    "cache_layout": ("SBH", "inert", _INERT),
    "padding_side": ("left", "inert", "nxdi locates each prompt from its padding (start_ids), on either side"),
    "group_query_attention": (
        None,
        "inert",
        "the K/V sharding of Neuron cores; the CPU engine's is numerically the same",
    ),
    "sequence_parallel_norm": (False, "inert", _INERT),
    "sequence_parallel_norm_threshold": (2048, "inert", _INERT),
    "on_device_embedding": (False, "inert", "the CPU engine always embeds inside its programs"),
    "on_device_generation": (None, "mapped", "on_device_sampling_config"),
    "all_reduce_dtype": (None, "inert", _INERT),
    "cast_logits_dtype": ("float32", "inert", "the CPU engine returns float32 logits"),
    "fuse_qkv": (False, "mapped", "fused_qkv"),
    "qkv_tiling": (False, "inert", _INERT),
    "weight_tiling": (False, "inert", _INERT),
    "mlp_in_weight_tiling_permute_order": ([1, 2, 0, 3], "inert", _INERT),
    "mlp_out_weight_tiling_permute_order": ([1, 2, 0, 3], "inert", _INERT),
    "log_softmax_scores": (False, "refused", "log-softmax scores are not returned"),
    "shard_over_sequence": (False, "mapped", "flash_decoding_enabled"),
    "output_all_logits": (
        False,
        "refused",
        "sample() returns tokens; use nxdi's forward() for every position's logits",
    ),
    "attn_output_transposed": (False, "inert", _INERT),
    "fused_rmsnorm_qkv": (False, "inert", _INERT),
    "fused_rmsnorm_mlp": (False, "inert", _INERT),
    "mlp_out_weight_transpose": (False, "inert", _INERT),
    "fuse_mlp": (False, "inert", _INERT),
    "is_eagle_target": (False, "refused", "EAGLE speculation goes through nxdi's enable_eagle_speculation"),
    "is_eagle_draft": (False, "refused", "EAGLE speculation goes through nxdi's enable_eagle_speculation"),
    "has_pre_attention_norm": (True, "refused", "every runnable family normalizes before attention"),
    "compilation_worker_count": (None, "inert", "the CPU backend traces in this process"),
    "duplicate_q_weight_sos": (False, "inert", _INERT),
}
"""Every transformers-neuronx NeuronConfig setting: (default, disposition, what nxdi does with it)."""

_TYPES: dict[str, type | tuple[type, ...]] = {
    "quant": QuantizationConfig,
    "continuous_batching": ContinuousBatchingConfig,
    "on_device_generation": GenerationConfig,
    "group_query_attention": TnxStrategy,
}


class NeuronConfig:
    """transformers-neuronx's compile-time options (every keyword of `SETTINGS`, as attributes).

    Raises:
        IncompatibleConfigError: unknown keywords, values of the wrong type or out of range, and
            settings nxdi does not implement set off their defaults (all listed, each named).
    """

    # The settings nxdi reads (all of `SETTINGS` are attributes).
    quant: QuantizationConfig | None
    continuous_batching: ContinuousBatchingConfig | None
    on_device_generation: GenerationConfig | None
    group_query_attention: TnxStrategy | None
    attention_layout: str
    padding_side: str
    on_device_embedding: bool
    fuse_qkv: bool
    shard_over_sequence: bool

    def __init__(self, **kwargs: Any) -> None:
        problems = [
            f"{k}={v!r}: is not a transformers-neuronx NeuronConfig setting"
            for k, v in kwargs.items()
            if k not in SETTINGS
        ]
        values = {name: kwargs.get(name, default) for name, (default, _, _) in SETTINGS.items()}
        for name, value in values.items():
            default, disposition, why = SETTINGS[name]
            problems.extend(_check(name, value, default, disposition, why))
        _fail(problems, "transformers-neuronx NeuronConfig")
        self.__dict__.update(values)

    def changed(self) -> dict[str, Any]:
        """The settings moved off their defaults."""
        return {n: getattr(self, n) for n, (default, _, _) in SETTINGS.items() if getattr(self, n) != default}

    def inert(self) -> list[str]:
        """`name=value` of every inert setting moved off its default (reported once by the model)."""
        return [
            f"{n}={'GQA.' + v.name if isinstance(v, TnxStrategy) else repr(v)}"
            for n, v in self.changed().items()
            if SETTINGS[n][1] == "inert"
        ]

    def nxdi_kwargs(self) -> dict[str, Any]:
        """nxdi NeuronConfig attributes of the mapped settings."""
        out: dict[str, Any] = {}
        if self.fuse_qkv:
            out["fused_qkv"] = True
        if self.shard_over_sequence:
            out["flash_decoding_enabled"] = True
        if self.quant is not None:
            out.update(self.quant.nxdi_kwargs())
        if self.on_device_generation is not None:
            out["on_device_sampling_config"] = self.on_device_generation.nxdi_kwargs()
        if self.continuous_batching is not None:
            out["is_continuous_batching"] = True
        return out

    def __repr__(self) -> str:
        return f"NeuronConfig({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"


def _check(name: str, value: Any, default: Any, disposition: str, why: str) -> list[str]:
    if value == default:
        return []
    if disposition == "refused":
        return [f"{name}={value!r}: is not supported by nxdi ({why}); leave it at {default!r}"]
    kind = _TYPES.get(name)
    if kind is not None:
        if not isinstance(value, kind):
            return [f"{name}={value!r}: must be a {getattr(kind, '__name__', kind)} or None"]
        return []
    if name in _LAYOUTS:
        return [] if value in _LAYOUTS[name] else [f"{name}={value!r}: must be one of {_LAYOUTS[name]}"]
    if name == "padding_side":
        return [] if value in ("left", "right") else [f"padding_side={value!r}: must be 'left' or 'right'"]
    if isinstance(default, bool) and not isinstance(value, bool):
        return [f"{name}={value!r}: must be True or False"]
    return []

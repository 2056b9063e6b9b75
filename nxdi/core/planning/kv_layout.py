"""KV-cache layout: per-rank K/V shapes, dtypes and bytes of every layer. Pure.

Rules (NxD Inference's KV cache manager):
- One K and one V tensor per layer and rank, `[B, K, T, D]`: B = `kv_cache_batch_size +
  kv_cache_padding_size` (the padding rows are the garbage rows that continuous batching and attention
  data parallelism send out-of-range seq_ids to), K = `kv' / tp` KV heads (after GQA replication),
  T = cache positions, D = head_dim.
- T is `max_length` (plus `speculation_length` slack slots with fused speculation:
  `speculation_memory.cache_slots`), or the sliding window when every layer has it and it is smaller. With flash
  decoding each core of a group of g holds a 1/g share of the sequence: `max_length` is rounded up
  to a multiple of g, divided by g, and 128 reserved positions are added.
- dtype is `attention_dtype or torch_dtype`, or the quantized dtype (`float8_e4m3fn` unless a
  `kv_quant_config` says otherwise) with `kv_cache_quant`; values are dequantized to the compute dtype.
"""

from __future__ import annotations

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import DTYPE_BYTES, NeuronSpec
from nxdi.core.errors import ConfigError, Problem, problems_of
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import gqa, speculation_memory

FLASH_DECODING_RESERVED = 128
"""Extra positions per core with flash decoding (the reference's EXTRA_RESERVED_SPACE)."""
KV_QUANT_DTYPE = "float8_e4m3fn"


@attrs.frozen(kw_only=True)
class KVLayout:
    """The KV cache of one rank: `num_layers` K tensors and as many V tensors, all `shape_per_rank`."""

    tp: int = attrs.field(validator=attrs.validators.gt(0))
    num_layers: int = attrs.field(validator=attrs.validators.gt(0))
    batch_rows: int = attrs.field(validator=attrs.validators.gt(0))
    """B: cache rows, garbage rows included."""
    heads_per_rank: int = attrs.field(validator=attrs.validators.gt(0))
    positions: int = attrs.field(validator=attrs.validators.gt(0))
    """T: cache positions per rank."""
    head_dim: int = attrs.field(validator=attrs.validators.gt(0))
    dtype: str = attrs.field(validator=attrs.validators.in_(DTYPE_BYTES))
    """Storage dtype of the cache."""
    compute_dtype: str = attrs.field(validator=attrs.validators.in_(DTYPE_BYTES))
    """dtype attention reads the cache as (differs from `dtype` only when quantized)."""
    flash_decoding_group: int = 1
    """Cores sharing one KV head's sequence (1 without flash decoding)."""

    @property
    def shape_per_rank(self) -> tuple[int, int, int, int]:
        """`[B, K, T, D]` of one layer's K (and V) on one rank."""
        return (self.batch_rows, self.heads_per_rank, self.positions, self.head_dim)

    @property
    def quantized(self) -> bool:
        return self.dtype != self.compute_dtype

    @property
    def layer_bytes_per_rank(self) -> int:
        """Bytes of one layer's K plus V on one rank."""
        b, k, t, d = self.shape_per_rank
        return 2 * b * k * t * d * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_rank(self) -> int:
        return self.num_layers * self.layer_bytes_per_rank

    @property
    def total_bytes(self) -> int:
        """Bytes over all ranks (replicated KV heads counted on every rank that holds them)."""
        return self.tp * self.bytes_per_rank


def cache_positions(max_length: int, *, sliding_window: int | None = None, flash_decoding_group: int = 1) -> int:
    """T: `min(max_length, window)`, then with flash decoding `ceil(T / g) + 128` per core."""
    t = max_length if sliding_window is None else min(max_length, sliding_window)
    if flash_decoding_group > 1:
        g = flash_decoding_group
        t = -(-t // g) + FLASH_DECODING_RESERVED
    return t


def _size_problems(
    sizes: dict[str, int], padding: int, window: int | None, dtype: str, quant_dtype: str
) -> list[Problem]:
    problems = [Problem.of(k, v, "must be a positive integer") for k, v in sizes.items() if v < 1]
    if padding < 0:
        problems.append(Problem.of("kv_cache_padding_size", padding, "must be >= 0"))
    if window is not None and window < 1:
        problems.append(Problem.of("sliding_window", window, "must be a positive integer or None"))
    problems.extend(
        Problem.of(f, v, f"is not a known dtype ({', '.join(DTYPE_BYTES)})")
        for f, v in (("torch_dtype", dtype), ("kv_quant_config.quant_dtype", quant_dtype))
        if v not in DTYPE_BYTES
    )
    return problems


def kv_layout(
    *,
    tp: int,
    num_layers: int,
    kv_heads_per_rank: int,
    head_dim: int,
    kv_cache_batch_size: int,
    kv_cache_padding_size: int = 0,
    max_length: int,
    dtype: str = "bfloat16",
    kv_cache_quant: bool = False,
    quant_dtype: str = KV_QUANT_DTYPE,
    sliding_window: int | None = None,
    flash_decoding_group: int = 1,
) -> Result[KVLayout, ConfigError]:
    """The per-rank KV cache for the given sizes.

    Args:
        kv_heads_per_rank: `kv' / tp` from `gqa.shardable_head_counts`.
        dtype: `attention_dtype or torch_dtype`; the compute dtype.
        kv_cache_quant: store the cache as `quant_dtype`.

    Returns:
        `Failure` listing every non-positive size, a negative padding, an unknown dtype and a
        non-positive sliding window or flash-decoding group.
    """
    sizes = {
        "tp_degree": tp,
        "num_hidden_layers": num_layers,
        "kv_heads_per_rank": kv_heads_per_rank,
        "head_dim": head_dim,
        "kv_cache_batch_size": kv_cache_batch_size,
        "max_length": max_length,
        "flash_decoding_group": flash_decoding_group,
    }
    problems = _size_problems(sizes, kv_cache_padding_size, sliding_window, dtype, quant_dtype)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    positions = cache_positions(max_length, sliding_window=sliding_window, flash_decoding_group=flash_decoding_group)
    return Success(
        KVLayout(
            tp=tp,
            num_layers=num_layers,
            batch_rows=kv_cache_batch_size + kv_cache_padding_size,
            heads_per_rank=kv_heads_per_rank,
            positions=positions,
            head_dim=head_dim,
            dtype=quant_dtype if kv_cache_quant else dtype,
            compute_dtype=dtype,
            flash_decoding_group=flash_decoding_group,
        )
    )


def kv_layout_for(model: ModelSpec, spec: NeuronSpec) -> Result[KVLayout, ConfigError]:
    """The per-rank KV cache of `model` under `spec`.

    Heads per rank come from the GQA head counts at `tp_degree / attention_dp_degree` (the reference's
    KV cache manager divides tp by the attention data-parallel degree); flash decoding groups cores.
    """
    tp = max(spec.tp_degree // spec.attention_dp_degree, 1)
    strategy, _ = gqa.determine_strategy(tp, model.num_kv_heads)
    counts = gqa.shardable_head_counts(tp, model.num_attention_heads, model.num_kv_heads, strategy)
    group: Result[int, ConfigError] = Success(1)
    if spec.flash_decoding_enabled:
        group = gqa.flash_decoding_group(tp, model.num_attention_heads, model.num_kv_heads)
    quant = spec.kv_quant_config
    match counts, group:
        case Success(c), Success(g):
            return kv_layout(
                tp=spec.tp_degree,
                num_layers=model.num_layers,
                kv_heads_per_rank=c.kv_per_rank,
                head_dim=model.head_dim,
                kv_cache_batch_size=spec.kv_cache_batch_size,
                kv_cache_padding_size=spec.kv_cache_padding_size,
                max_length=speculation_memory.cache_slots(spec),  # fused speculation's slack slots too
                dtype=spec.attention_dtype or spec.torch_dtype,
                kv_cache_quant=spec.kv_cache_quant or quant is not None,
                quant_dtype=quant.quant_dtype if quant is not None else KV_QUANT_DTYPE,
                sliding_window=model.cache_window,
                flash_decoding_group=g,
            )
    return Failure(ConfigError(problems=problems_of(counts, group)))

"""Grouped-query attention under tensor parallelism: strategies, padded head counts, head order per rank. Pure.

Theory of operation (NxD Inference):
- `determine_strategy`: REPLICATE_TO_TP_DEGREE unless asked otherwise; it falls back to CONVERT_TO_MHA
  (with a note) whenever `tp % kv != 0`. So tp=1 with 8 KV heads converts to MHA, as in the reference.
- `shardable_head_counts`: Q heads are padded up to a multiple of tp (`q'`). MHA models get `kv' = q'`.
  When the KV heads do not split evenly over tp, REPLICATE makes `kv' = tp` (each KV head repeated
  `tp // kv` times) and CONVERT_TO_MHA makes `kv' = q'` (each KV head repeated `q // kv` times).
- `head_layout`: which original head every padded head slot holds. REPLICATE pads Q *interleaved*
  (after each group of `q // kv` heads, `(q' - q) / kv` zero heads) so Q and KV stay aligned per rank;
  CONVERT_TO_MHA pads Q, K and V with zero heads at the *tail*. Rank r holds slots
  `[r * q'/tp, (r + 1) * q'/tp)` of Q and `[r * kv'/tp, (r + 1) * kv'/tp)` of K/V; inside a rank, Q slot i
  attends KV slot `i // (q'/kv')`.

transformers-neuronx names its strategies differently (`TnxStrategy`); `tnx_heads_per_rank` gives
their per-rank Q heads, KV-cache heads and batch rows.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem


class GQAStrategy(enum.Enum):
    """NxD Inference's GQA sharding strategies."""

    REPLICATE_TO_TP_DEGREE = "replicate_to_tp_degree"
    CONVERT_TO_MHA = "convert_to_mha"


def determine_strategy(
    tp: int, kv: int, desired: GQAStrategy | None = None, *, q: int | None = None
) -> tuple[GQAStrategy, tuple[str, ...]]:
    """The strategy used, and notes (warnings for the shell) when the desired one cannot be used.

    `q`, when given, is the query head count: a model that is already multi-head (q == kv) gets no
    note, since converting it to MHA changes nothing.
    """
    strategy = desired or GQAStrategy.REPLICATE_TO_TP_DEGREE
    if strategy is GQAStrategy.REPLICATE_TO_TP_DEGREE and tp % kv != 0:
        note = f"tp_degree={tp} is not a multiple of num_key_value_heads={kv}: using CONVERT_TO_MHA"
        return GQAStrategy.CONVERT_TO_MHA, (() if q == kv else (note,))
    return strategy, ()


def extra_heads(q: int, tp: int) -> int:
    """Zero Q heads added so that `q + extra` splits evenly over tp."""
    return 0 if q % tp == 0 else tp - q % tp


@attrs.frozen(kw_only=True)
class HeadCounts:
    """Original and shardable (padded/replicated) head counts for one tp degree."""

    tp: int
    strategy: GQAStrategy
    q: int
    kv: int
    q_padded: int
    """q': Q heads after zero padding, a multiple of tp."""
    kv_padded: int
    """kv': KV heads after replication and padding, a multiple of tp."""

    @property
    def q_per_rank(self) -> int:
        return self.q_padded // self.tp

    @property
    def kv_per_rank(self) -> int:
        return self.kv_padded // self.tp

    @property
    def kv_groups(self) -> int:
        """How many Q heads of a rank share one of its KV heads (`num_key_value_groups`)."""
        return self.q_per_rank // self.kv_per_rank


def shardable_head_counts(tp: int, q: int, kv: int, strategy: GQAStrategy) -> Result[HeadCounts, ConfigError]:
    """`q'` and `kv'` for tp ranks, as the reference computes them.

    Returns:
        `Failure` when tp, q or kv is not positive, kv does not divide q, or REPLICATE_TO_TP_DEGREE is asked
        for where the KV heads need replicating but tp is not a multiple of kv (use `determine_strategy`).
    """
    named = (("tp_degree", tp), ("num_attention_heads", q), ("num_key_value_heads", kv))
    problems = [Problem.of(f, v, "must be a positive integer") for f, v in named if v < 1]
    if not problems and q % kv:
        problems.append(Problem.of("num_key_value_heads", kv, f"does not divide num_attention_heads={q}"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    q_padded = q + extra_heads(q, tp)
    if q == kv:
        kv_padded = q_padded
    elif kv < tp or kv % tp:
        kv_padded = tp if strategy is GQAStrategy.REPLICATE_TO_TP_DEGREE else q_padded
    else:
        kv_padded = kv
    needs_copies = kv_padded != kv and strategy is GQAStrategy.REPLICATE_TO_TP_DEGREE
    if needs_copies and tp % kv:
        return Failure(
            ConfigError.of(
                "tp_degree",
                tp,
                f"REPLICATE_TO_TP_DEGREE needs tp_degree to be a multiple of num_key_value_heads={kv}",
                "use CONVERT_TO_MHA, or a tp_degree that is a multiple or a divisor of the KV heads",
            )
        )
    return Success(HeadCounts(tp=tp, strategy=strategy, q=q, kv=kv, q_padded=q_padded, kv_padded=kv_padded))


@attrs.frozen(kw_only=True)
class HeadLayout:
    """The padded head order: for every padded slot, the original head it holds, or None for a zero head."""

    counts: HeadCounts
    q_sources: tuple[int | None, ...]
    """Length q'. Also the order of the O-projection's input columns."""
    kv_sources: tuple[int | None, ...]
    """Length kv'. The same for K and V."""

    def rank_q_heads(self, rank: int) -> tuple[int | None, ...]:
        """Original Q heads held by `rank` (None = zero padding head)."""
        n = self.counts.q_per_rank
        return self.q_sources[rank * n : (rank + 1) * n]

    def rank_kv_heads(self, rank: int) -> tuple[int | None, ...]:
        """Original KV heads held by `rank` (repeats are replicas; None = zero padding head)."""
        n = self.counts.kv_per_rank
        return self.kv_sources[rank * n : (rank + 1) * n]


def head_layout(counts: HeadCounts) -> HeadLayout:
    """The exact padded/replicated head order that `counts` implies (see the module rules)."""
    q, kv, qp, kvp = counts.q, counts.kv, counts.q_padded, counts.kv_padded
    group = q // kv
    if counts.strategy is GQAStrategy.REPLICATE_TO_TP_DEGREE:
        pads = (qp - q) // kv
        q_src: list[int | None] = []
        for g in range(kv):
            q_src.extend(range(g * group, (g + 1) * group))
            q_src.extend([None] * pads)
        copies = kvp // kv
        kv_src: list[int | None] = [j // copies for j in range(kvp)]
    else:
        q_src = [*range(q), *([None] * (qp - q))]
        real = q if kvp != kv else kv
        per = real // kv
        kv_src = [*(h // per for h in range(real)), *([None] * (kvp - real))]
    return HeadLayout(counts=counts, q_sources=tuple(q_src), kv_sources=tuple(kv_src))


def flash_decoding_group(tp: int, q: int, kv: int) -> Result[int, ConfigError]:
    """`num_cores_per_group = min(tp, q) / kv`: cores sharing one KV head, splitting its sequence.

    (tp, kv, q) = (32, 4, 8) -> 2; (32, 1, 8) -> 8; (16, 8, 32) -> 2.

    Returns:
        `Failure` when `min(tp, q)` is not a positive multiple of `kv` (flash decoding cannot group cores).
    """
    cores = min(tp, q)
    if kv < 1 or cores < kv or cores % kv:
        return Failure(
            ConfigError.of(
                "flash_decoding_enabled",
                True,
                f"min(tp_degree={tp}, num_attention_heads={q}) is not a multiple of num_key_value_heads={kv}",
                "disable flash decoding, or pick a tp_degree that is a multiple of the KV heads",
            )
        )
    return Success(cores // kv)


class TnxStrategy(enum.Enum):
    """transformers-neuronx's `GQA` strategies."""

    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"


def determine_tnx_strategy(
    requested: TnxStrategy | None, *, tp: int, q: int, kv: int, head_dim: int, batch_sizes: Sequence[int]
) -> tuple[TnxStrategy, tuple[str, ...]]:
    """The strategy transformers-neuronx ends up with, and a note for every fallback it takes.

    SHARD_OVER_BATCH needs every batch size divisible by tp; ALL_GATHER_HEADS needs `kv * head_dim`
    divisible by tp and a Q padding divisible by kv; failing those, and whenever kv does not split over
    tp, SHARD_OVER_HEADS becomes REPLICATED_HEADS. MHA models (q == kv) shard over heads.
    """
    notes: list[str] = []
    strategy = requested or TnxStrategy.SHARD_OVER_HEADS
    if strategy is TnxStrategy.REPLICATED_HEADS or (requested is None and q == kv):
        return strategy, ()
    if strategy is TnxStrategy.SHARD_OVER_BATCH:
        odd = [b for b in batch_sizes if b % tp]
        if not odd:
            return strategy, ()
        notes.append(f"shard-over-batch needs batch sizes divisible by tp_degree={tp}, not {odd}")
        strategy = TnxStrategy.SHARD_OVER_HEADS
    if strategy is TnxStrategy.ALL_GATHER_HEADS:
        if (kv * head_dim) % tp == 0 and extra_heads(q, tp) % kv == 0:
            return strategy, ()
        notes.append(f"all-gather-heads needs kv*head_dim and the Q padding divisible (tp_degree={tp}, kv={kv})")
        strategy = TnxStrategy.SHARD_OVER_HEADS
    if kv % tp:
        notes.append(f"num_key_value_heads={kv} does not split over tp_degree={tp}: replicating KV heads")
        strategy = TnxStrategy.REPLICATED_HEADS
    return strategy, tuple(notes)


@attrs.frozen(kw_only=True)
class TnxHeads:
    """Per-rank shapes of one transformers-neuronx strategy."""

    strategy: TnxStrategy
    q_heads_per_rank: int
    kv_cache_heads_per_rank: int
    kv_cache_batch_per_rank: int
    kv_weight_columns_per_rank: int
    """Columns of the K (and V) projection each rank holds (all-gather-heads may hold part of a head)."""


def tnx_heads_per_rank(
    strategy: TnxStrategy, *, tp: int, q: int, kv: int, head_dim: int, batch_size: int
) -> Result[TnxHeads, ConfigError]:
    """Per-rank heads and batch rows for an already-determined transformers-neuronx strategy.

    Returns:
        `Failure` when the strategy's precondition does not hold (see `determine_tnx_strategy`).
    """
    qp = q + extra_heads(q, tp)
    round_kv = kv + extra_heads(kv, tp)
    problem: str | None = None
    match strategy:
        case TnxStrategy.SHARD_OVER_HEADS:
            problem = None if kv % tp == 0 else f"needs num_key_value_heads={kv} divisible by tp_degree={tp}"
            out = (qp // tp, kv // tp, batch_size, kv * head_dim // tp)
        case TnxStrategy.SHARD_OVER_BATCH:
            problem = None if batch_size % tp == 0 else f"needs batch_size={batch_size} divisible by tp_degree={tp}"
            out = (qp // tp, kv, batch_size // tp, kv * head_dim // tp)
        case TnxStrategy.REPLICATED_HEADS:
            out = (qp // tp, qp // tp, batch_size, qp * head_dim // tp)
        case TnxStrategy.ALL_GATHER_HEADS:
            ok = (kv * head_dim) % tp == 0 and extra_heads(q, tp) % kv == 0
            problem = None if ok else f"needs kv*head_dim={kv * head_dim} and the Q padding to split over tp={tp}"
            out = (qp // tp, round_kv // tp, batch_size, kv * head_dim // tp)
    if problem is not None:
        return Failure(ConfigError.of("group_query_attention", strategy.value, problem))
    qr, kvr, br, cols = out
    return Success(
        TnxHeads(
            strategy=strategy,
            q_heads_per_rank=qr,
            kv_cache_heads_per_rank=kvr,
            kv_cache_batch_per_rank=br,
            kv_weight_columns_per_rank=cols,
        )
    )

"""Bucket tables of the block KV layout: prefix caching and chunked prefill. Pure.

Theory of operation (the 1-D tables and their rules are in `buckets`):
- Prefix caching compiles 2-D buckets `(active, prefix)`: `active` new tokens attend to themselves
  and to `prefix` positions already in the block cache.
  * CTE: active = prefill buckets (`context_encoding_buckets`, else automatic from 512, the flash
    attention kernel's minimum); prefix = `(0, *prefix_buckets)`, else `(0, *automatic from 512)`.
    Bucketing off: `[(max_ctx, 0), (max_ctx, max_ctx)]`.
  * TKG: active = `(1,)`; prefix = `token_generation_buckets`, else automatic from 256 (the block
    attention kernel's minimum) on `max_length`. Bucketing off: `[(1, max_length)]`.
  * Differences from the reference: automatic lengths never skip a power of two (see
    `buckets.auto_lengths`); `prefix_buckets` is used whenever given (the reference ignores it
    without `context_encoding_buckets`, and crashes on explicit `context_encoding_buckets` without
    it, where nxdi uses the automatic prefix buckets); a 0 in `prefix_buckets` is not a duplicate.
- Prefix-caching selection (the reference's `get_target_2d_bucket_for_prefix_caching`):
  * CTE: `(a, p)` fits `active` new and `prefix` cached tokens when `active <= a` and
    `active + prefix <= a + p`: prefix tokens that do not fit the prefix bucket are recomputed in
    the prefill bucket's empty slots. The pick is the smallest fit (smallest `a`, then smallest `p`),
    which is the reference's pick wherever the reference finds one; where its smallest prefill bucket
    cannot take the prefix (it asserts), nxdi moves up to the next prefill bucket.
  * TKG: `(a, p)` fits when `active <= a` and `prefix + active <= p` (the new token's position must
    be in the bucket). With one active token this is the reference's strict `prefix < p`; elsewhere
    nxdi uses `required <= bucket` where the reference uses a strict `<` (see `buckets`).
- Chunked prefill compiles `(chunk, tiles)` CTE buckets: chunk lengths are multiples of the kernel's
  query tile (first, median and last), tiles `[1, T//2, T]` when `T >= 4`, with
  `T = ceil(max_ctx / q_tile) * ceil(max_length * max_num_seqs / kv_tile)`. Bucketing off:
  `[(max_ctx, T)]`. Explicit `context_encoding_buckets` are the chunk lengths (nxdi's field is 1-D;
  the reference takes a 2-D list there). Selection: the smallest `(chunk, tiles)` with
  `chunk_len <= chunk` and `num_tiles <= tiles`, as the reference's (sorted) first fit.

(Over 400 lines: the two layouts' tables and their selections are one rule set checked against the
reference's, side by side; each builds on `buckets`' 1-D rules the same way.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.config.sub_specs import ChunkedPrefillSpec
from nxdi.core.errors import ConfigError, Problem, problems_of
from nxdi.core.planning import buckets

MIN_AUTO_PREFILL = 512
"""Smallest automatic prefill and prefix bucket: the flash attention kernel needs 512 tokens."""
MIN_AUTO_PREFIX_TKG = 256
"""Smallest automatic token-generation prefix bucket: the block attention TKG kernel needs 256."""
SHORT_CONTEXT = (256, 512)
"""`lo < prefill + prefix <= hi`: contexts the reference recomputes whole in a `(512, 0)` bucket."""


def _ascending(_: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    if not value or any(v < 0 for v in value) or any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError(f"{attribute.name} must be non-empty, non-negative and strictly ascending, got {value}")


def _product(rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((r, c) for r in rows for c in cols)


@attrs.frozen(kw_only=True)
class PrefixTable:
    """The `(active, prefix)` buckets of one prefix-caching sub-model (CONTEXT or TOKEN)."""

    kind: Phase = attrs.field(validator=attrs.validators.in_((Phase.CONTEXT, Phase.TOKEN)))
    active: tuple[int, ...] = attrs.field(validator=_ascending)
    """New tokens per call, ascending (CTE: prefill buckets; TKG: `(1,)`)."""
    prefix: tuple[int, ...] = attrs.field(validator=_ascending)
    """Cached positions attended to, ascending; a CTE table starts with 0 (no prefix)."""
    max_length: int = attrs.field(validator=attrs.validators.gt(0))
    """The limit served: `max_context_length` (CTE) or `max_length` (TKG)."""

    def buckets(self) -> tuple[tuple[int, int], ...]:
        """`(active, prefix)` pairs in the reference's order: active outer, prefix inner, both ascending."""
        return _product(self.active, self.prefix)


def _prefix_lengths(values: Sequence[object], *, limit: int) -> Result[tuple[int, ...], ConfigError]:
    """`(0, *values)` checked like `buckets.check_lengths`; a listed 0 is the no-prefix bucket itself."""
    rest = [v for v in values if not (type(v) is int and v == 0)]
    if not rest:
        return Success((0,))
    checked = buckets.check_lengths(rest, limit=limit, field="prefix_buckets", limit_field="max_context_length")
    return checked.map(lambda lengths: (0, *lengths))


def prefix_context_table(
    *,
    max_context_length: int,
    enable_bucketing: bool,
    prefill_buckets: Sequence[object] | None = None,
    prefix_buckets: Sequence[object] | None = None,
) -> Result[PrefixTable, ConfigError]:
    """The prefix-caching CTE table (see the module docstring).

    Returns:
        `Failure` listing every problem of `context_encoding_buckets` and `prefix_buckets`
        (not positive integers, duplicates, above `max_context_length`).
    """
    limit = max_context_length
    if limit <= 0:
        return Failure(ConfigError.of("max_context_length", limit, "must be a positive integer"))
    if not enable_bucketing:
        return Success(PrefixTable(kind=Phase.CONTEXT, active=(limit,), prefix=(0, limit), max_length=limit))
    active = (
        buckets.check_lengths(
            prefill_buckets, limit=limit, field="context_encoding_buckets", limit_field="max_context_length"
        )
        if prefill_buckets is not None
        else Success(buckets.auto_lengths(limit, MIN_AUTO_PREFILL))
    )
    prefix = (
        _prefix_lengths(prefix_buckets, limit=limit)
        if prefix_buckets is not None
        else Success((0, *buckets.auto_lengths(limit, MIN_AUTO_PREFILL)))
    )
    match active, prefix:
        case Success(a), Success(p):
            return Success(PrefixTable(kind=Phase.CONTEXT, active=a, prefix=p, max_length=limit))
    return Failure(ConfigError(problems=problems_of(active, prefix)))


def prefix_token_table(
    *, max_length: int, enable_bucketing: bool, token_buckets: Sequence[object] | None = None
) -> Result[PrefixTable, ConfigError]:
    """The prefix-caching TKG table: `(1, p)` for each prefix bucket `p` (see the module docstring).

    Returns:
        `Failure` naming `token_generation_buckets` when the explicit list is invalid.
    """
    if max_length <= 0:
        return Failure(ConfigError.of("max_length", max_length, "must be a positive integer"))
    if not enable_bucketing:
        prefix: Result[tuple[int, ...], ConfigError] = Success((max_length,))
    elif token_buckets is not None:
        prefix = buckets.check_lengths(
            token_buckets, limit=max_length, field="token_generation_buckets", limit_field="max_length"
        )
    else:
        prefix = Success(buckets.auto_lengths(max_length, MIN_AUTO_PREFIX_TKG))
    return prefix.map(lambda p: PrefixTable(kind=Phase.TOKEN, active=(1,), prefix=p, max_length=max_length))


def _cte_fits(table: PrefixTable, active: int, prefix: int) -> list[tuple[int, int]]:
    return [(a, p) for a, p in table.buckets() if active <= a and active + prefix <= a + p]


def _tkg_fits(table: PrefixTable, active: int, prefix: int) -> list[tuple[int, int]]:
    return [(a, p) for a, p in table.buckets() if active <= a and prefix + active <= p]


def _overflow(table: PrefixTable, active: int, prefix: int) -> list[Problem]:
    cte = table.kind is Phase.CONTEXT
    name = "prefill_length" if cte else "active_length"
    found: list[Problem] = []
    if active > table.active[-1]:
        found.append(
            Problem.of(
                name,
                active,
                f"exceeds the largest {'prefill' if cte else 'active-token'} bucket ({table.active[-1]})",
                "split the prompt into smaller prefill calls, or set allow_input_truncation=True",
            )
        )
    room = max(a + p for a, p in table.buckets()) if cte else table.prefix[-1]
    if active + prefix > room:
        field = "prefix_buckets" if cte else "token_generation_buckets"
        found.append(
            Problem.of(
                "prefix_length",
                prefix,
                f"{prefix} cached + {active} new tokens exceed the largest {table.kind.value} bucket ({room} positions)",
                f"add a bucket to {field} or raise {'max_context_length' if cte else 'max_length'} "
                f"(now {table.max_length}) so it holds {active + prefix}",
            )
        )
    return found


def _truncated(table: PrefixTable, active: int, prefix: int) -> tuple[int, int]:
    """The reference's fallback: TKG takes the last bucket; CTE the largest prefill bucket and the
    smallest prefix bucket holding what its empty slots leave over (else the largest)."""
    if table.kind is Phase.TOKEN:
        return table.buckets()[-1]
    a = table.active[-1]
    left = max(0, prefix - max(0, a - active))
    return a, next((p for p in table.prefix if left <= p), table.prefix[-1])


def select_prefix_bucket(
    table: PrefixTable,
    active: int,
    prefix: int,
    *,
    allow_input_truncation: bool = False,
    recompute_short_contexts: bool = True,
) -> Result[tuple[int, int], ConfigError]:
    """The `(active, prefix)` bucket for one call: the smallest that fits (see the module docstring).

    Args:
        active: new tokens of the call (CTE: the uncached part of the prompt; TKG: 1, or the
            speculation length).
        prefix: positions already cached (TKG: the largest over the batch).
        allow_input_truncation: fall back as the reference does instead of failing.
        recompute_short_contexts: the reference's measured rule for CTE: when
            `256 < active + prefix <= 512` and `(512, 0)` is compiled, recompute the whole context
            there. Kept by default because on Neuron a 512-token flash-attention prefill beats a smaller
            prefill plus a block gather of the prefix, and it changes only which graph runs, never the
            tokens; it matters only for explicit tables with prefill buckets below 512 (with automatic
            tables, whose smallest prefill bucket is 512, the smallest fit is `(512, 0)` anyway).

    Returns:
        `Success((active_bucket, prefix_bucket))`, or `Failure` naming `prefill_length` (CTE) or
        `active_length` (TKG) and/or `prefix_length` with the value, the largest bucket and the fix;
        also for `active < 1` or `prefix < 0`.
    """
    cte = table.kind is Phase.CONTEXT
    name = "prefill_length" if cte else "active_length"
    bad = [Problem.of(name, active, "must be at least 1 token")] if active < 1 else []
    bad += [Problem.of("prefix_length", prefix, "must be >= 0")] if prefix < 0 else []
    if bad:
        return Failure(ConfigError(problems=tuple(bad)))
    lo, hi = SHORT_CONTEXT
    if cte and recompute_short_contexts and lo < active + prefix <= hi and (hi, 0) in table.buckets():
        return Success((hi, 0))
    fits = _cte_fits(table, active, prefix) if cte else _tkg_fits(table, active, prefix)
    if fits:
        return Success(min(fits))
    if allow_input_truncation:
        return Success(_truncated(table, active, prefix))
    return Failure(ConfigError(problems=tuple(_overflow(table, active, prefix))))


# --- chunked prefill ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ChunkedPrefillTable:
    """The `(chunk, tiles)` CTE buckets of chunked prefill."""

    chunks: tuple[int, ...] = attrs.field(validator=_ascending)
    """Chunk lengths in tokens (new tokens of all sequences of one call), ascending."""
    tiles: tuple[int, ...] = attrs.field(validator=_ascending)
    """Attention tile counts (query tile x KV tile) a call computes, ascending."""
    max_num_tiles: int = attrs.field(validator=attrs.validators.ge(0))
    """`ceil(max_ctx / q_tile) * ceil(max_length * max_num_seqs / kv_tile)`: every tile of the grid."""
    q_tile_size: int = attrs.field(validator=attrs.validators.gt(0))
    kv_tile_size: int = attrs.field(validator=attrs.validators.gt(0))

    def buckets(self) -> tuple[tuple[int, int], ...]:
        """`(chunk, tiles)` pairs, chunk outer, both ascending (the reference's order)."""
        return _product(self.chunks, self.tiles)


def chunk_lengths(q_tile_size: int, max_context_length: int) -> tuple[int, ...]:
    """The first, median and last multiple of `q_tile_size` up to `max_context_length` rounded up.

    (128, 250) -> (128, 256); (128, 1024) -> (128, 512, 1024); (128, 64) -> (128,).
    """
    n = max(1, math.ceil(max_context_length / q_tile_size))
    picks = sorted({0, (n - 1) // 2, n - 1})
    return tuple((i + 1) * q_tile_size for i in picks)


def tile_counts(max_num_tiles: int) -> tuple[int, ...]:
    """`(1, T // 2, T)` when `T >= 4`, else `(T,)`."""
    return (1, max_num_tiles // 2, max_num_tiles) if max_num_tiles >= 4 else (max_num_tiles,)


def chunked_prefill_table(
    *,
    max_context_length: int,
    max_length: int,
    enable_bucketing: bool,
    config: ChunkedPrefillSpec,
    chunk_buckets: Sequence[object] | None = None,
) -> Result[ChunkedPrefillTable, ConfigError]:
    """The chunked-prefill CTE table (see the module docstring).

    Returns:
        `Failure` listing a `max_num_seqs` below 1 (no tile to compute) and every problem of an
        explicit `context_encoding_buckets` (the chunk lengths).
    """
    q, kv = config.kernel_q_tile_size, config.kernel_kv_tile_size
    total = math.ceil(max_context_length / q) * math.ceil(max_length * config.max_num_seqs / kv)
    seqs: Result[int, ConfigError] = (
        Success(total)
        if config.max_num_seqs >= 1
        else Failure(
            ConfigError.of(
                "chunked_prefill_config.max_num_seqs",
                config.max_num_seqs,
                "must be at least 1 (the sequences one chunked-prefill call serves)",
                "set max_num_seqs to the batch size",
            )
        )
    )
    if not enable_bucketing:
        chunks: Result[tuple[int, ...], ConfigError] = Success((max_context_length,))
    elif chunk_buckets is not None:
        chunks = buckets.check_lengths(
            chunk_buckets, limit=max_context_length, field="context_encoding_buckets", limit_field="max_context_length"
        )
    else:
        chunks = Success(chunk_lengths(q, max_context_length))
    match chunks, seqs:
        case Success(c), Success(t):
            tiles = (t,) if not enable_bucketing else tile_counts(t)
            return Success(ChunkedPrefillTable(chunks=c, tiles=tiles, max_num_tiles=t, q_tile_size=q, kv_tile_size=kv))
    return Failure(ConfigError(problems=problems_of(chunks, seqs)))


def select_chunked_bucket(table: ChunkedPrefillTable, chunk: int, tiles: int) -> Result[tuple[int, int], ConfigError]:
    """The smallest `(chunk_bucket, tiles_bucket)` with `chunk <= chunk_bucket` and `tiles <= tiles_bucket`.

    Returns:
        `Success(bucket)`, or `Failure` naming `chunk_length` and/or `num_tiles` with the largest
        bucket (no truncation: the reference has none for chunked prefill); also for `chunk < 1`
        or `tiles < 0`.
    """
    found: list[Problem] = []
    if chunk < 1 or chunk > table.chunks[-1]:
        why = "must be at least 1 token" if chunk < 1 else f"exceeds the largest chunk bucket ({table.chunks[-1]})"
        found.append(Problem.of("chunk_length", chunk, why, "" if chunk < 1 else "schedule smaller chunks"))
    if tiles < 0 or tiles > table.tiles[-1]:
        why = "must be >= 0" if tiles < 0 else f"exceeds the largest tile bucket ({table.tiles[-1]})"
        found.append(Problem.of("num_tiles", tiles, why, "" if tiles < 0 else "schedule fewer or shorter sequences"))
    if found:
        return Failure(ConfigError(problems=tuple(found)))
    return Success(min((c, t) for c, t in table.buckets() if chunk <= c and tiles <= t))


# --- adapters: the tables a NeuronSpec implies -------------------------------------------------


def prefix_context_table_for(spec: NeuronSpec) -> Result[PrefixTable, ConfigError]:
    """The prefix-caching CTE table of `spec` (meaningful with `is_prefix_caching`)."""
    return prefix_context_table(
        max_context_length=spec.max_context_length,
        enable_bucketing=spec.enable_bucketing,
        prefill_buckets=spec.context_encoding_buckets,
        prefix_buckets=spec.prefix_buckets,
    )


def prefix_token_table_for(spec: NeuronSpec) -> Result[PrefixTable, ConfigError]:
    """The prefix-caching TKG table of `spec`; `Failure` with `token_generation_batches` (as the reference)."""
    table = prefix_token_table(
        max_length=spec.max_length, enable_bucketing=spec.enable_bucketing, token_buckets=spec.token_generation_buckets
    )
    if spec.token_generation_batches is None:
        return table
    clash = Problem.of(
        "token_generation_batches",
        list(spec.token_generation_batches),
        "batch bucketing is not supported with prefix caching",
        "drop token_generation_batches",
    )
    return Failure(ConfigError(problems=(*problems_of(table), clash)))


def chunked_prefill_table_for(spec: NeuronSpec) -> Result[ChunkedPrefillTable, ConfigError]:
    """The chunked-prefill CTE table of `spec`; `Failure` when `chunked_prefill_config` is not set."""
    if spec.chunked_prefill_config is None:
        return Failure(ConfigError.of("chunked_prefill_config", None, "is not set", "set chunked_prefill_config"))
    return chunked_prefill_table(
        max_context_length=spec.max_context_length,
        max_length=spec.max_length,
        enable_bucketing=spec.enable_bucketing,
        config=spec.chunked_prefill_config,
        chunk_buckets=spec.context_encoding_buckets,
    )


@attrs.frozen(kw_only=True)
class BlockTables:
    """The block-KV tables a spec compiles instead of the plain CTE (and, with prefix caching, TKG) ones."""

    prefix_context: PrefixTable | None = None
    prefix_token: PrefixTable | None = None
    chunked_prefill: ChunkedPrefillTable | None = None


def block_tables_for(spec: NeuronSpec) -> Result[BlockTables | None, ConfigError]:
    """The prefix-caching and chunked-prefill tables of `spec`, or None when it uses neither.

    Chunked prefill wins for CTE when both are set, as in the reference's `generate_buckets_for_cte`.
    """
    chunked = spec.chunked_prefill_config is not None
    if not (chunked or spec.is_prefix_caching):
        return Success(None)
    none: Result[None, ConfigError] = Success(None)
    ctx = prefix_context_table_for(spec) if spec.is_prefix_caching and not chunked else none
    tkg = prefix_token_table_for(spec) if spec.is_prefix_caching else none
    cp = chunked_prefill_table_for(spec) if chunked else none
    match ctx, tkg, cp:
        case Success(c), Success(t), Success(p):
            return Success(BlockTables(prefix_context=c, prefix_token=t, chunked_prefill=p))
    return Failure(ConfigError(problems=problems_of(ctx, tkg, cp)))

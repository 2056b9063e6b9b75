"""Bucket tables: which padded lengths (and batch sizes) get compiled, and which one an input uses. Pure.

Theory of operation:
- Every bucket is a separately compiled program with static shapes. Context encoding (CTE) buckets are
  prompt lengths; token generation (TKG) and speculation buckets are the number of cache positions
  attended to.
- Automatic tables hold the powers of two from 128 below the maximum, then the maximum itself. Unlike
  the reference (whose `round(log2(max))` drops 512 for a maximum of 700), no power of two is skipped.
- Explicit tables are sorted (as the reference does), must be unique, positive and no larger than the
  maximum they serve; every violation is reported at once.
- Selection returns the *smallest* bucket that fits (`required <= bucket`); the reference uses a strict
  `<`, which sends an exact fit to the next bucket up. `required` is the input length plus the
  speculation length for speculation tables.
- 2-D tables (`token_generation_batches`) pair each compiled batch size (descending) with every
  sequence bucket (ascending); selection takes the smallest batch that holds the input batch, then the
  smallest sequence bucket that fits.
- The block KV layout's 2-D tables (prefix caching, chunked prefill) are in `block_buckets`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TypeGuard

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ConfigError, Problem, problems_of, problems_result

MIN_AUTO_BUCKET = 128
"""Smallest automatic bucket (unless the maximum itself is smaller)."""


def _strictly_ascending_positive(
    _: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    if not value or any(v <= 0 for v in value) or any(a >= b for a, b in itertools.pairwise(value)):
        raise ValueError(f"{attribute.name} must be non-empty, positive and strictly ascending, got {value}")


def _strictly_descending_positive(
    _: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    if not value or any(v <= 0 for v in value) or any(a <= b for a, b in itertools.pairwise(value)):
        raise ValueError(f"{attribute.name} must be non-empty, positive and strictly descending, got {value}")


_LIMIT_FIELD = {
    Phase.CONTEXT: "max_context_length",
    Phase.TOKEN: "max_length",
    Phase.SPECULATION: "max_length",
    Phase.FUSED_SPECULATION: "max_length",
}
_BUCKETS_FIELD = {
    Phase.CONTEXT: "context_encoding_buckets",
    Phase.TOKEN: "token_generation_buckets",
    Phase.SPECULATION: "token_generation_buckets",
    Phase.FUSED_SPECULATION: "token_generation_buckets",
}


@attrs.frozen(kw_only=True)
class BucketTable:
    """The compiled buckets of one sub-model."""

    kind: Phase
    lengths: tuple[int, ...] = attrs.field(validator=_strictly_ascending_positive)
    """Sequence buckets in tokens, strictly ascending (CTE: prompt length; TKG/speculation: cache positions)."""
    batch_sizes: tuple[int, ...] = attrs.field(validator=_strictly_descending_positive)
    """Compiled batch sizes, strictly descending; a single entry unless `token_generation_batches` is set."""
    max_length: int = attrs.field(validator=attrs.validators.gt(0))
    """The limit this table serves: `max_context_length` for CTE, `max_length` otherwise."""
    extra_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Tokens added to the input length before selection (the speculation length for speculation tables)."""

    @property
    def largest(self) -> int:
        """The largest sequence bucket."""
        return self.lengths[-1]

    @property
    def limit_field(self) -> str:
        """Name of the NeuronConfig field that bounds this table."""
        return _LIMIT_FIELD[self.kind]

    @property
    def is_2d(self) -> bool:
        """True when the table has several batch sizes (`token_generation_batches`)."""
        return len(self.batch_sizes) > 1

    def buckets_2d(self) -> tuple[tuple[int, int], ...]:
        """`[batch, seq]` pairs: batch sizes descending, sequence lengths ascending within each batch."""
        return tuple((b, s) for b in self.batch_sizes for s in self.lengths)


def auto_lengths(max_length: int, min_length: int = MIN_AUTO_BUCKET) -> tuple[int, ...]:
    """Automatic buckets: `min_length * 2**i` below `max_length`, then `max_length`.

    700 -> (128, 256, 512, 700); 2048 -> (128, 256, 512, 1024, 2048); 100 -> (100,).
    """
    out: list[int] = []
    p = min_length
    while p < max_length:
        out.append(p)
        p *= 2
    return (*out, max_length)


def _is_count(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_lengths(
    values: Iterable[object], *, limit: int, field: str, limit_field: str
) -> Result[tuple[int, ...], ConfigError]:
    """Validate an explicit bucket list; returns it sorted ascending.

    Returns:
        `Success(sorted lengths)`, or `Failure` naming `field` for: an empty list, a value that is not a
        positive integer, a duplicate, or a value above `limit` (the value of `limit_field`).
    """
    raw = tuple(values)
    problems: list[Problem] = []
    if not raw:
        problems.append(Problem.of(field, list(raw), "must list at least one bucket", f"add {limit} or omit {field}"))
    bad = [v for v in raw if not _is_count(v)]
    if bad:
        problems.append(Problem.of(field, list(raw), f"holds values that are not positive integers: {bad}"))
    good = sorted(v for v in raw if _is_count(v))
    dups = sorted({v for v in good if good.count(v) > 1})
    if dups:
        problems.append(Problem.of(field, list(raw), f"holds duplicates {dups}", "list each bucket once"))
    over = [v for v in good if v > limit]
    if over:
        problems.append(
            Problem.of(
                field,
                list(raw),
                f"buckets {over} exceed {limit_field}={limit}",
                f"raise {limit_field} to at least {max(over)}, or drop those buckets",
            )
        )
    return problems_result(tuple(good), problems)


def _table(
    kind: Phase, *, limit: int, enable_bucketing: bool, buckets: Sequence[object] | None, extra: int = 0
) -> Result[tuple[int, ...], ConfigError]:
    if limit <= 0:
        return Failure(ConfigError.of(_LIMIT_FIELD[kind], limit, "must be a positive integer"))
    if not enable_bucketing:
        return Success((limit,))
    if buckets is None:
        return Success(auto_lengths(limit))
    return check_lengths(buckets, limit=limit, field=_BUCKETS_FIELD[kind], limit_field=_LIMIT_FIELD[kind])


def context_encoding_table(
    *, max_context_length: int, batch_size: int, enable_bucketing: bool, buckets: Sequence[object] | None = None
) -> Result[BucketTable, ConfigError]:
    """The CTE table: `[max_context_length]` without bucketing, else `buckets` or the automatic table.

    Returns:
        `Failure` naming `context_encoding_buckets` when an explicit list is invalid (see `check_lengths`).
    """
    kind = Phase.CONTEXT
    return _table(kind, limit=max_context_length, enable_bucketing=enable_bucketing, buckets=buckets).map(
        lambda lengths: BucketTable(
            kind=kind, lengths=lengths, batch_sizes=(batch_size,), max_length=max_context_length
        )
    )


def check_batches(batches: int | Sequence[object], *, batch_size: int) -> Result[tuple[int, ...], ConfigError]:
    """`token_generation_batches` plus `batch_size`, descending; each must be a positive int <= batch_size."""
    raw = (batches,) if isinstance(batches, int) else tuple(batches)
    problems: list[Problem] = []
    bad = [v for v in raw if not _is_count(v)]
    if bad:
        problems.append(Problem.of("token_generation_batches", list(raw), f"holds non-positive or non-integers {bad}"))
    over = [v for v in raw if _is_count(v) and v > batch_size]
    if over:
        problems.append(
            Problem.of(
                "token_generation_batches",
                list(raw),
                f"batch sizes {over} exceed tkg_batch_size={batch_size}",
                f"raise tkg_batch_size to at least {max(over)}, or drop those sizes",
            )
        )
    good = {v for v in raw if _is_count(v)} | {batch_size}
    return problems_result(tuple(sorted(good, reverse=True)), problems)


def token_generation_table(
    *,
    max_length: int,
    batch_size: int,
    enable_bucketing: bool,
    buckets: Sequence[object] | None = None,
    batches: int | Sequence[object] | None = None,
) -> Result[BucketTable, ConfigError]:
    """The TKG table; with `batches` (token_generation_batches) a 2-D table, even without bucketing.

    Returns:
        `Failure` listing problems of both `token_generation_buckets` and `token_generation_batches`.
    """
    kind = Phase.TOKEN
    lengths = _table(kind, limit=max_length, enable_bucketing=enable_bucketing, buckets=buckets)
    sizes = check_batches(batches, batch_size=batch_size) if batches is not None else Success((batch_size,))
    match lengths, sizes:
        case Success(ls), Success(bs):
            return Success(BucketTable(kind=kind, lengths=ls, batch_sizes=bs, max_length=max_length))
    return Failure(ConfigError(problems=problems_of(lengths, sizes)))


def speculation_table(
    *,
    max_length: int,
    batch_size: int,
    enable_bucketing: bool,
    speculation_length: int,
    buckets: Sequence[object] | None = None,
) -> Result[BucketTable, ConfigError]:
    """The speculation table: the TKG rule on `max_length`; selection adds `speculation_length`."""
    kind = Phase.SPECULATION
    if speculation_length < 0:
        return Failure(ConfigError.of("speculation_length", speculation_length, "must be >= 0"))
    return _table(kind, limit=max_length, enable_bucketing=enable_bucketing, buckets=buckets).map(
        lambda lengths: BucketTable(
            kind=kind,
            lengths=lengths,
            batch_sizes=(batch_size,),
            max_length=max_length,
            extra_tokens=speculation_length,
        )
    )


def _overflow(table: BucketTable, n: int) -> ConfigError:
    required = n + table.extra_tokens
    spec = f" plus speculation_length={table.extra_tokens}" if table.extra_tokens else ""
    if table.largest < table.max_length:
        fix = f"add a bucket >= {required} to {_BUCKETS_FIELD[table.kind]}, or set allow_input_truncation=True"
    else:
        fix = (
            f"raise {table.limit_field} (now {table.max_length}; it defaults to seq_len) to at least {required}, "
            "or set allow_input_truncation=True"
        )
    reason = f"input length {n}{spec} exceeds the largest {table.kind.value} bucket ({table.largest})"
    return ConfigError(problems=(Problem.of("input_length", n, reason, fix),))


def select_bucket(table: BucketTable, n: int, *, allow_input_truncation: bool = False) -> Result[int, ConfigError]:
    """The smallest sequence bucket `b` with `n + table.extra_tokens <= b`.

    Args:
        n: input length in tokens (CTE: prompt width; TKG: attention-mask width).
        allow_input_truncation: fall back to the largest bucket instead of failing.

    Returns:
        `Success(bucket)`, or `Failure` (field `input_length`) saying the length, the largest bucket and
        the fix (raise the maximum / add a bucket, or allow truncation); also when `n < 1`.
    """
    if n < 1:
        return Failure(ConfigError.of("input_length", n, "must be at least 1 token"))
    required = n + table.extra_tokens
    fit = next((b for b in table.lengths if required <= b), None)
    if fit is not None:
        return Success(fit)
    if allow_input_truncation:
        return Success(table.largest)
    return Failure(_overflow(table, n))


def select_batch_bucket(
    table: BucketTable, batch: int, n: int, *, allow_input_truncation: bool = False
) -> Result[tuple[int, int], ConfigError]:
    """The `[batch, seq]` bucket: the smallest compiled batch >= `batch`, then the smallest fitting length.

    Returns:
        `Success((batch_bucket, seq_bucket))`, or `Failure` listing a batch larger than every compiled
        batch (fix: split it into chunks, see `padding.batch_plan`) and/or a length overflow.
    """
    problems: list[Problem] = []
    fits = [b for b in table.batch_sizes if batch <= b]
    if batch < 1:
        problems.append(Problem.of("batch_size", batch, "must be at least 1"))
    elif not fits:
        largest = table.batch_sizes[0]
        problems.append(
            Problem.of(
                "batch_size",
                batch,
                f"exceeds the largest compiled batch ({largest})",
                f"split the batch into chunks of at most {largest} rows",
            )
        )
    match select_bucket(table, n, allow_input_truncation=allow_input_truncation):
        case Success(seq) if not problems:
            return Success((min(fits), seq))
        case Failure(err):
            problems.extend(err.problems)
    return Failure(ConfigError(problems=tuple(problems)))


# --- adapters: the tables a NeuronSpec implies -------------------------------------------------


def context_table_for(spec: NeuronSpec) -> Result[BucketTable, ConfigError]:
    """The CTE table of `spec` (batch `ctx_batch_size`)."""
    return context_encoding_table(
        max_context_length=spec.max_context_length,
        batch_size=spec.ctx_batch_size,
        enable_bucketing=spec.enable_bucketing,
        buckets=spec.context_encoding_buckets,
    )


def token_table_for(spec: NeuronSpec) -> Result[BucketTable, ConfigError]:
    """The TKG table of `spec` (batch `tkg_batch_size`, 2-D with `token_generation_batches`)."""
    return token_generation_table(
        max_length=spec.max_length,
        batch_size=spec.tkg_batch_size,
        enable_bucketing=spec.enable_bucketing,
        buckets=spec.token_generation_buckets,
        batches=spec.token_generation_batches,
    )


def speculation_table_for(spec: NeuronSpec) -> Result[BucketTable, ConfigError]:
    """The speculation table of `spec` (batch `spec_batch_size`); meaningful when speculation_length > 0."""
    return speculation_table(
        max_length=spec.max_length,
        batch_size=spec.spec_batch_size,
        enable_bucketing=spec.enable_bucketing,
        speculation_length=spec.speculation_length,
        buckets=spec.token_generation_buckets,
    )

"""Padding plans: how inputs are padded to a bucket, and how a batch is padded or split. Pure.

Rules (the reference's, except where marked):
- Sequence padding goes on `padding_side`: `input_ids` with `pad_token_id` (0 when the model has none),
  `attention_mask` with 0, `position_ids` with 1.
- The index and position of the last real token of every row are recorded explicitly. The reference
  finds the row's output with `argmax(position_ids)`, which for a 1-token right-padded prompt
  (positions `[0, 1, 1, ...]`) picks a padding slot; nxdi reads `last_token_index` instead.
- An input wider than the bucket is an error unless truncation is allowed; truncation keeps the
  leftmost `bucket` columns with right padding (as the reference's negative pad does) and the
  rightmost (most recent) columns with left padding.
- A batch smaller than the compiled batch is completed with the lowest seq_ids the caller did not use; they are
  sorted, the pad rows repeat the chunk's first row, and outputs are read back in the caller's
  order. A larger batch is split into chunks of the compiled batch, each padded the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem

ATTENTION_MASK_PAD = 0
POSITION_PAD = 1
"""Pad value of `position_ids`, as in the reference."""


class PaddingSide(enum.Enum):
    RIGHT = "right"
    LEFT = "left"


@attrs.frozen(kw_only=True)
class PaddingPlan:
    """How every row of a `[B, W]` input becomes a `[B, bucket]` input."""

    bucket: int = attrs.field(validator=attrs.validators.gt(0))
    input_width: int = attrs.field(validator=attrs.validators.gt(0))
    """W: columns of the inputs as given (the attention-mask width)."""
    side: PaddingSide
    pad_token_id: int = 0
    row_lengths: tuple[int, ...]
    """Real (unmasked) tokens per row after truncation."""
    last_token_index: tuple[int, ...]
    """Per row, the column of its last real token in the padded `[B, bucket]` input."""
    last_position: tuple[int, ...]
    """Per row, the position id of its last real token (row_length - 1)."""

    @property
    def pad_count(self) -> int:
        """Columns added (0 when truncating)."""
        return max(self.bucket - self.input_width, 0)

    @property
    def truncated(self) -> int:
        """Columns dropped (only with allow_input_truncation)."""
        return max(self.input_width - self.bucket, 0)

    def _apply(self, row: Sequence[int], value: int) -> tuple[int, ...]:
        assert len(row) == self.input_width, f"row of width {len(row)}, plan expects {self.input_width}"
        pad = (value,) * self.pad_count
        if self.side is PaddingSide.RIGHT:
            return (*row[: self.bucket], *pad)
        return (*pad, *row[max(len(row) - self.bucket, 0) :])

    def pad_ids(self, row: Sequence[int]) -> tuple[int, ...]:
        """One row of `input_ids` padded with `pad_token_id`."""
        return self._apply(row, self.pad_token_id)

    def pad_mask(self, row: Sequence[int]) -> tuple[int, ...]:
        """One row of `attention_mask` padded with 0."""
        return self._apply(row, ATTENTION_MASK_PAD)

    def pad_positions(self, row: Sequence[int]) -> tuple[int, ...]:
        """One row of `position_ids` padded with 1."""
        return self._apply(row, POSITION_PAD)


def _padding_problems(row_lengths: Sequence[int], input_width: int, bucket: int, truncate: bool) -> list[Problem]:
    problems: list[Problem] = []
    if not row_lengths:
        problems.append(Problem.of("input_ids", [], "holds no rows"))
    problems.extend(
        Problem.of(f"attention_mask[{i}]", n, f"must hold between 1 and {input_width} real tokens")
        for i, n in enumerate(row_lengths)
        if not 1 <= n <= input_width
    )
    if input_width > bucket and not truncate:
        problems.append(
            Problem.of(
                "input_ids",
                input_width,
                f"inputs of {input_width} tokens are longer than the bucket ({bucket} tokens)",
                "raise the maximum length, or set allow_input_truncation=True",
            )
        )
    problems.extend(
        Problem.of(f, v, "must be at least 1") for f, v in (("input_width", input_width), ("bucket", bucket)) if v < 1
    )
    return problems


def padding_plan(
    row_lengths: Sequence[int],
    *,
    input_width: int,
    bucket: int,
    side: PaddingSide = PaddingSide.RIGHT,
    pad_token_id: int | None = None,
    allow_input_truncation: bool = False,
) -> Result[PaddingPlan, ConfigError]:
    """Plan the padding of a `[B, input_width]` input whose rows hold `row_lengths` real tokens.

    Real tokens sit at the start of each row with right padding and at the end with left padding.

    Returns:
        `Success(PaddingPlan)`, or `Failure` listing: an empty batch, a row length outside
        `[1, input_width]`, and an input wider than `bucket` without `allow_input_truncation`.
    """
    problems = _padding_problems(row_lengths, input_width, bucket, allow_input_truncation)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    kept = tuple(min(n, bucket) for n in row_lengths)
    return Success(
        PaddingPlan(
            bucket=bucket,
            input_width=input_width,
            side=side,
            pad_token_id=0 if pad_token_id is None else pad_token_id,
            row_lengths=kept,
            last_token_index=tuple((n - 1 if side is PaddingSide.RIGHT else bucket - 1) for n in kept),
            last_position=tuple(n - 1 for n in kept),
        )
    )


@attrs.frozen(kw_only=True)
class BatchChunk:
    """One call of a compiled program with batch `len(seq_ids)`."""

    user_rows: tuple[int, ...]
    """Rows of the caller's batch carried by this call, in the caller's order."""
    seq_ids: tuple[int, ...]
    """seq_ids as run: the callers' ids plus pad ids, sorted ascending."""
    source_rows: tuple[int, ...]
    """For each run row, the caller row whose inputs it receives (pad rows repeat the chunk's first row)."""
    is_pad: tuple[bool, ...]
    """For each run row, True when it is padding (its outputs are discarded)."""
    output_rows: tuple[int, ...]
    """For each entry of `user_rows`, the run row that holds its outputs."""


@attrs.frozen(kw_only=True)
class BatchPlan:
    """How a caller's batch maps onto calls of a program compiled for `compiled_batch` rows."""

    compiled_batch: int
    chunks: tuple[BatchChunk, ...]


def _chunk(rows: tuple[int, ...], seq_ids: Sequence[int], compiled_batch: int) -> BatchChunk:
    ids = [seq_ids[r] for r in rows]
    taken = set(seq_ids)  # pad ids avoid every id of the call, so a pad row never aliases a real row
    missing = (i for i in range(len(seq_ids) + compiled_batch) if i not in taken)
    pad_ids = [next(missing) for _ in range(compiled_batch - len(rows))]
    run = sorted([*ids, *pad_ids])
    where = {s: j for j, s in enumerate(run)}
    source = {s: r for s, r in zip(ids, rows, strict=True)}
    return BatchChunk(
        user_rows=rows,
        seq_ids=tuple(run),
        source_rows=tuple(source.get(s, rows[0]) for s in run),
        is_pad=tuple(s not in source for s in run),
        output_rows=tuple(where[s] for s in ids),
    )


def batch_plan(seq_ids: Sequence[int], *, compiled_batch: int) -> Result[BatchPlan, ConfigError]:
    """Pad a smaller batch, or split a larger one into chunks of `compiled_batch` rows.

    Args:
        seq_ids: the caller's seq_id per row (`[B]`), each a distinct non-negative integer.

    Returns:
        `Success(BatchPlan)`, or `Failure` listing an empty batch, negative or duplicate seq_ids and a
        non-positive compiled batch.
    """
    problems: list[Problem] = []
    if not seq_ids:
        problems.append(Problem.of("seq_ids", [], "holds no rows"))
    if compiled_batch < 1:
        problems.append(Problem.of("batch_size", compiled_batch, "must be at least 1"))
    negative = [s for s in seq_ids if s < 0]
    if negative:
        problems.append(Problem.of("seq_ids", list(seq_ids), f"holds negative ids {negative}"))
    dups = sorted({s for s in seq_ids if list(seq_ids).count(s) > 1})
    if dups:
        problems.append(Problem.of("seq_ids", list(seq_ids), f"holds duplicate ids {dups}", "give each row its own id"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    starts = range(0, len(seq_ids), compiled_batch)
    chunks = tuple(
        _chunk(tuple(range(s, min(s + compiled_batch, len(seq_ids)))), seq_ids, compiled_batch) for s in starts
    )
    return Success(BatchPlan(compiled_batch=compiled_batch, chunks=chunks))

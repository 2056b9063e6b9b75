"""Host-side preparation of step inputs: compact padded prompts, pad to a bucket, pick batch rows,
fit a batch to the compiled batch sizes. Pure.

Callers may pad prompts on either side (or anywhere: only `attention_mask` says which columns are
real). The programs want right padding with the last real token's index known, so prompts are
first compacted: each row's real tokens move to the front, in order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from returns.result import Success
from torch import Tensor

from nxdi.core.planning import padding
from nxdi.core.programs.inputs import StepInputs


def compact(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's real tokens to the front: ids [B, W] -> ids [B, W] (tail = 0), lengths [B]."""
    real = attention_mask.to(torch.bool)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real columns first, in order
    ids = input_ids.gather(1, order)
    lengths = real.sum(dim=1)
    keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return torch.where(keep, ids, torch.zeros_like(ids)), lengths


def uncompact(values: Tensor, attention_mask: Tensor, *, fill: float = 0) -> Tensor:
    """Per-token outputs of compacted rows back in the caller's columns (the inverse of `compact`).

    Args:
        values: [L, B, S, *rest], row b's token j at [:, b, j] (S: the bucket the rows ran in).
        attention_mask: [B, W] the caller's mask (any padding side).
        fill: the value of padding columns, and of real tokens past S (cut by truncation).

    Returns:
        [L, B, W, *rest]: each row's real columns hold its tokens' values in order.
    """
    real = attention_mask.to(torch.bool)
    b, w = real.shape
    s = values.shape[2]
    order = real.cumsum(1) - 1  # [B, W]: each real column's token index in its compacted row
    kept = real & (order < s)
    picked = values[:, torch.arange(b)[:, None], order.clamp(0, s - 1)]  # [L, B, W, *rest]
    return picked.masked_fill(~kept.view(1, b, w, *([1] * (values.dim() - 3))), fill)


def context_inputs(ids: Tensor, lengths: Tensor, *, bucket: int, pad_token_id: int = 0) -> StepInputs:
    """Right-padded (or truncated) context-encoding inputs [B, bucket] from compacted ids [B, W].

    Rows longer than `bucket` keep their first `bucket` tokens (truncation was allowed upstream).
    """
    b, w = ids.shape
    lengths = lengths.clamp(max=bucket)
    ids = torch.nn.functional.pad(ids, (0, bucket - w)) if w < bucket else ids[:, :bucket]
    cols = torch.arange(bucket)[None, :]
    ids = torch.where(cols < lengths[:, None], ids, torch.full_like(ids, pad_token_id)).to(torch.int64)
    positions = cols.expand(b, bucket).contiguous().to(torch.int64)
    return StepInputs(input_ids=ids, position_ids=positions, last_index=(lengths - 1).to(torch.int64))


def select_rows(x: StepInputs, rows: Tensor) -> StepInputs:
    """The inputs of batch rows `rows` [B'] (rows may repeat: padding rows copy a real one)."""
    return StepInputs(
        input_ids=x.input_ids.index_select(0, rows),
        position_ids=x.position_ids.index_select(0, rows),
        last_index=x.last_index.index_select(0, rows),
        adapter_ids=None if x.adapter_ids is None else x.adapter_ids.index_select(0, rows),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunChunk:
    """One program call of a batch: which caller rows it carries and where each run row goes."""

    batch: int
    """B: rows of the program it runs."""
    user_rows: tuple[int, ...]
    """Caller rows carried, in the caller's order."""
    source_rows: tuple[int, ...]
    """Per run row, the caller row whose inputs it gets (padding rows repeat the chunk's first row)."""
    cache_rows: tuple[int, ...]
    """Per run row, the cache row it reads and writes; -1 for padding rows (they write nothing)."""
    output_rows: tuple[int, ...]
    """Per entry of `user_rows`, the run row that holds its outputs."""

    @property
    def in_order(self) -> bool:
        """The run rows are cache rows 0..B-1 in order (the runtime then slices instead of gathering)."""
        return self.cache_rows == tuple(range(self.batch))

    def carries_all(self, batch: int) -> bool:
        """The chunk runs a caller's whole batch of `batch` rows as they are: no padding row, none
        moved, so its inputs and outputs need no gathering (a decode step's usual case)."""
        rows = tuple(range(batch))
        return self.user_rows == rows and self.source_rows == rows and self.output_rows == rows


def gather_rows(parts: Sequence[tuple[Sequence[int], Tensor]], batch: int, *, dim: int = 0) -> Tensor | None:
    """The outputs of a batch's chunks in the caller's row order: `parts` holds each chunk's caller
    rows and its values (those rows along `dim`); returns them as one tensor of `batch` rows along
    `dim` (None without parts; the one part's own tensor when it holds every row in order)."""
    if not parts:
        return None
    if len(parts) == 1 and tuple(parts[0][0]) == tuple(range(batch)) and parts[0][1].shape[dim] == batch:
        return parts[0][1]  # one chunk of every row in order: its values as they are
    first = parts[0][1]
    shape = list(first.shape)
    shape[dim] = batch
    out = first.new_empty(shape)
    for user_rows, values in parts:
        out.index_copy_(dim, torch.tensor(list(user_rows), dtype=torch.int64), values)
    return out


def plan_runs(cache_rows: Sequence[int], batch_sizes: Sequence[int]) -> tuple[RunChunk, ...]:
    """Fit a batch to compiled batch sizes (`_plan_runs`); remembered per batch, since a decode
    loop asks the same each step."""
    return _plan_runs(tuple(cache_rows), tuple(batch_sizes))


@functools.lru_cache(maxsize=1024)
def _plan_runs(cache_rows: tuple[int, ...], batch_sizes: tuple[int, ...]) -> tuple[RunChunk, ...]:
    """Fit a batch to compiled batch sizes: chunks of the largest size, each padded to the smallest
    size that holds it (REFERENCE §3: seq_ids sorted, padding rows repeat the first row, outputs
    read back in the caller's order; `padding.batch_plan`).

    Args:
        cache_rows: [B] the cache row of every caller row (`forward_inputs.route_rows`): distinct,
            except garbage rows (which may repeat) and -1 (masked rows, which write nothing).
        batch_sizes: the compiled batch sizes of the program's phase (any order).
    """
    rows = list(cache_rows)
    # The planner wants distinct non-negative ids: a masked or repeated row gets one past every
    # cache row (unique), and keeps its own cache row for the run.
    above = max(max(rows), 0) + 1
    first = {r: i for i, r in reversed(list(enumerate(rows)))}
    ids = [r if r >= 0 and first[r] == i else above + i for i, r in enumerate(rows)]
    largest = max(batch_sizes)
    chunks = []
    for start in range(0, len(rows), largest):
        part = ids[start : start + largest]
        batch = min(b for b in batch_sizes if b >= len(part))
        planned = padding.batch_plan(part, compiled_batch=batch)
        assert isinstance(planned, Success), f"distinct non-negative ids always plan: {planned}"
        (chunk,) = planned.unwrap().chunks
        users = tuple(start + r for r in chunk.user_rows)
        sources = tuple(start + r for r in chunk.source_rows)
        run = tuple(-1 if pad else rows[s] for s, pad in zip(sources, chunk.is_pad, strict=True))
        chunks.append(
            RunChunk(batch=batch, user_rows=users, source_rows=sources, cache_rows=run, output_rows=chunk.output_rows)
        )
    return tuple(chunks)

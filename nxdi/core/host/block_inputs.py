"""A serving client's block-KV arguments, checked and turned into one block step's inputs. Pure.

With `is_block_kv_layout` the client owns the cache's blocks (vLLM's block manager) and tells every
`forward()` call where each sequence lives: `block_table` (its blocks, in position order; padded
with 0 or -1), `slot_mapping` (the flat slot `block * pa_block_size + offset` each new token is
written to; -1 for padding), `computed_context_lens` (tokens already cached: a prefix-cache hit or
the decode position) and `full_context_lens` (tokens once this call has run). Two call shapes:

- Rows (continuous batching, prefix caching): `input_ids` [B, W] — a prefill passes whole prompts
  from position 0 and only the tokens from `computed_context_lens` on are computed (the prefix is
  read from its blocks); a decode passes one token per row. `slot_mapping` [B, >= new tokens]
  covers each row's new tokens; `block_table` [B, NB]; the context lens [B] or [B, 1].
- Chunked prefill: `input_ids` [1, T] concatenates R requests' new tokens (prompt chunks, or one
  decode token); `slot_mapping` [T]; `block_table` [R, NB]; the context lens [R]. Request r's
  tokens are the next `full[r] - computed[r]`. The output is one token (or logits) per request.

Every problem is listed at once (argument, row, value), before anything runs.
"""

from __future__ import annotations

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.inputs import StepInputs

_SHOWN = 4


@attrs.frozen(kw_only=True)
class BlockLimits:
    """What the compiled block cache holds."""

    num_blocks: int
    """pa_num_blocks: blocks 0..num_blocks-1 exist."""
    block_size: int
    max_length: int
    """Positions 0..max_length-1 fit in a sequence."""
    vocab_size: int


@attrs.frozen(eq=False, kw_only=True)
class Segments:
    """Each request of a call, before padding: its new tokens and where they go."""

    tokens: tuple[tuple[int, ...], ...]
    """New token ids of each request."""
    computed: tuple[int, ...]
    """Tokens each request has cached already (its first new token's position)."""
    slots: tuple[tuple[int, ...], ...]
    """Flat cache slot of each new token."""
    tables: tuple[tuple[int, ...], ...]
    """Each request's blocks covering positions 0..full-1."""
    first_column: tuple[int, ...]
    """Where each request's first new token is in the caller's `input_ids`: its column in the
    request's row (rows; the others follow it), or its index in the one row (chunked prefill)."""

    @property
    def new(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self.tokens)

    @property
    def full(self) -> tuple[int, ...]:
        return tuple(c + n for c, n in zip(self.computed, self.new, strict=True))


def _rows(t: Tensor | None, name: str, count: int, problems: list[Problem]) -> list[int] | None:
    """A per-request length argument ([R] or [R, 1]) as a list, or None (absent)."""
    if t is None:
        return None
    flat = t.reshape(-1) if t.dim() == 2 and t.shape[-1] == 1 else t
    if flat.dim() != 1 or flat.shape[0] != count:
        problems.append(
            Problem.of(name, list(t.shape), f"must hold one length per request ({count})", f"shape [{count}]")
        )
        return None
    return [int(v) for v in flat.tolist()]


def _check_segments(seg: Segments, limits: BlockLimits, problems: list[Problem]) -> None:
    """Lengths within the cache, slots inside the cache and in the blocks the table names."""
    bs = limits.block_size
    for r, (computed, new, slots, table) in enumerate(zip(seg.computed, seg.new, seg.slots, seg.tables, strict=True)):
        full = computed + new
        if new < 1:
            problems.append(Problem.of(f"request {r}", new, "has no new token to compute", "send at least one token"))
            continue
        if full > limits.max_length:
            why = f"reaches position {full - 1}, past max_length={limits.max_length}"
            problems.append(Problem.of(f"full_context_lens[{r}]", full, why))
            continue
        needed = -(-full // bs)
        if len(table) < needed:
            why = f"names {len(table)} blocks; positions 0..{full - 1} need {needed} of {bs}"
            problems.append(Problem.of(f"block_table[{r}]", list(table), why, "pass every block of the sequence"))
            continue
        bad_blocks = [b for b in table[:needed] if not 0 <= b < limits.num_blocks]
        if bad_blocks:
            why = f"holds blocks {bad_blocks[:_SHOWN]} outside 0..{limits.num_blocks - 1} (pa_num_blocks)"
            problems.append(Problem.of(f"block_table[{r}]", list(table[:needed]), why))
            continue
        expected = [table[p // bs] * bs + p % bs for p in range(computed, full)]
        wrong = [(computed + i, s, e) for i, (s, e) in enumerate(zip(slots, expected, strict=True)) if s != e]
        if wrong:
            shown = ", ".join(f"position {p}: {s} (its block table says {e})" for p, s, e in wrong[:_SHOWN])
            why = "disagrees with block_table"
            problems.append(
                Problem.of(
                    f"slot_mapping[{r}]",
                    shown,
                    why,
                    "slot = block_table[p // pa_block_size] * pa_block_size + p % pa_block_size",
                )
            )
        bad_ids = [t for t in seg.tokens[r] if not 0 <= t < limits.vocab_size]
        if bad_ids:
            why = f"holds ids {bad_ids[:_SHOWN]} outside the vocabulary 0..{limits.vocab_size - 1}"
            problems.append(Problem.of(f"input_ids (request {r})", bad_ids[:_SHOWN], why))


def _checked(
    tokens: list[tuple[int, ...]],
    computed: list[int],
    slots: list[tuple[int, ...]],
    block_table: Tensor,
    limits: BlockLimits,
    problems: list[Problem],
    *,
    first_column: list[int],
) -> Result[Segments, ConfigError]:
    """The segments, once checked against the cache (`_check_segments`) with the problems found so far."""
    seg = Segments(
        tokens=tuple(tokens),
        computed=tuple(computed),
        slots=tuple(slots),
        tables=tuple(tuple(int(v) for v in row.tolist()) for row in block_table),
        first_column=tuple(first_column),
    )
    _check_segments(seg, limits, problems)
    return Failure(ConfigError(problems=tuple(problems))) if problems else Success(seg)


def _slot(table: Tensor, position: int, block_size: int) -> int:
    """The flat slot of `position` by a block table row (valid or not: checked with the rest)."""
    index = position // block_size
    block = int(table[index]) if index < table.shape[0] else -1
    return block * block_size + position % block_size


def row_segments(
    input_ids: Tensor,
    position_ids: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    full_context_lens: Tensor | None,
    computed_context_lens: Tensor | None,
    *,
    limits: BlockLimits,
    max_prefix: int | None = None,
) -> Result[Segments, ConfigError]:
    """The requests of a row-per-request call (continuous batching, prefix caching).

    Args:
        input_ids, position_ids: [B, W] (a prefill: whole prompts from position 0, right padded; a
            decode: one token per row, W = 1).
        slot_mapping: [B, >= new tokens] slots of each row's new tokens (-1 after them).
        block_table: [B, NB].
        full_context_lens: [B] or [B, 1] (default: the highest position + 1).
        computed_context_lens: [B] or [B, 1] (default: 0 for a prefill, the position for a decode).
        max_prefix: the prefix the chosen program reads: a prefill row's cached tokens beyond it
            are computed again (their slots come from the block table), as the reference does.

    Returns:
        The segments, or a ConfigError listing every problem.
    """
    problems: list[Problem] = []
    b, w = input_ids.shape
    prefill = int(position_ids.min()) == 0 and w > 1
    last = position_ids.max(dim=1).values
    full = _rows(full_context_lens, "full_context_lens", b, problems) or [int(p) + 1 for p in last.tolist()]
    default_computed = [0] * b if prefill else [int(p) for p in position_ids[:, 0].tolist()]
    computed = _rows(computed_context_lens, "computed_context_lens", b, problems) or default_computed
    if slot_mapping.dim() != 2 or slot_mapping.shape[0] != b:
        problems.append(Problem.of("slot_mapping", list(slot_mapping.shape), f"must be [{b}, new tokens]"))
    if block_table.dim() != 2 or block_table.shape[0] != b:
        problems.append(Problem.of("block_table", list(block_table.shape), f"must be [{b}, blocks per sequence]"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    tokens, slots, columns = [], [], []
    for r in range(b):
        c, f = computed[r], full[r]
        if not 0 <= c <= f:
            problems.append(Problem.of(f"computed_context_lens[{r}]", c, f"must be within 0..full_context_lens ({f})"))
            c = f
        keep = c if max_prefix is None or not prefill else min(c, max_prefix)
        # A prefill row holds the whole prompt (columns = positions); a decode row its new tokens.
        cols = range(keep, f) if prefill else range(0, f - c)
        if max(cols, default=-1) >= w:
            why = f"needs columns up to {max(cols)} of input_ids, which has {w}"
            problems.append(Problem.of(f"full_context_lens[{r}]", f, why))
            cols = range(0)
        tokens.append(tuple(int(input_ids[r, col]) for col in cols))
        columns.append(cols.start)
        again = [_slot(block_table[r], p, limits.block_size) for p in range(keep, c)]
        n = len(cols) - len(again)  # the client's slots cover the tokens after its computed ones
        row_slots = slot_mapping[r].tolist()
        if len(row_slots) < n:
            problems.append(Problem.of(f"slot_mapping[{r}]", len(row_slots), f"has fewer slots than new tokens ({n})"))
            row_slots = row_slots + [-1] * n
        slots.append(tuple(again) + tuple(int(s) for s in row_slots[:n]))
        computed[r] = keep
    return _checked(tokens, computed, slots, block_table, limits, problems, first_column=columns)


def chunked_segments(
    input_ids: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    full_context_lens: Tensor,
    computed_context_lens: Tensor,
    *,
    limits: BlockLimits,
) -> Result[Segments, ConfigError]:
    """The requests of a chunked-prefill call: input_ids [1, T] holding each request's next
    `full - computed` tokens in turn, slot_mapping [T], block_table [R, NB], the lens [R].

    Returns:
        The segments, or a ConfigError listing every problem (the token counts must add up to T).
    """
    problems: list[Problem] = []
    if input_ids.shape[0] != 1:
        problems.append(Problem.of("input_ids", list(input_ids.shape), "must be one row [1, T] in chunked prefill"))
    r = block_table.shape[0] if block_table.dim() == 2 else -1
    if r < 1:
        problems.append(Problem.of("block_table", list(block_table.shape), "must be [requests, blocks per request]"))
    full = _rows(full_context_lens, "full_context_lens", r, problems) if r > 0 else None
    computed = _rows(computed_context_lens, "computed_context_lens", r, problems) if r > 0 else None
    if problems or full is None or computed is None:
        return Failure(ConfigError(problems=tuple(problems)))
    ids, flat_slots = input_ids.reshape(-1).tolist(), slot_mapping.reshape(-1).tolist()
    counts = [f - c for f, c in zip(full, computed, strict=True)]
    if sum(counts) != len(ids) or len(flat_slots) < len(ids):
        why = f"the requests' new tokens (full - computed = {counts}) add up to {sum(counts)}"
        problems.append(Problem.of("input_ids", len(ids), why + f", slot_mapping holds {len(flat_slots)}"))
        return Failure(ConfigError(problems=tuple(problems)))
    tokens, slots, starts, at = [], [], [], 0
    for n in counts:
        tokens.append(tuple(int(t) for t in ids[at : at + n]))
        slots.append(tuple(int(s) for s in flat_slots[at : at + n]))
        starts.append(at)
        at += n
    return _checked(tokens, computed, slots, block_table, limits, problems, first_column=starts)


def as_rows(seg: Segments, *, batch: int, tokens: int, blocks: int, pad_id: int = 0) -> tuple[StepInputs, BlockInputs]:
    """One request per row, padded to `batch` rows of `tokens` tokens over prefixes of `blocks` blocks.

    Padding rows and tokens write nowhere (slot -1); a padding row's output is discarded.
    """
    ids = torch.full((batch, tokens), pad_id, dtype=torch.int64)
    pos = torch.zeros((batch, tokens), dtype=torch.int64)
    slot = torch.full((batch, tokens), -1, dtype=torch.int64)
    segment = torch.full((batch, tokens), -1, dtype=torch.int64)
    table = torch.zeros((batch, 1, blocks), dtype=torch.int64)
    computed = torch.zeros((batch, 1), dtype=torch.int64)
    out = torch.zeros((batch, 1), dtype=torch.int64)
    for r, (toks, c, s, t) in enumerate(zip(seg.tokens, seg.computed, seg.slots, seg.tables, strict=True)):
        n = len(toks)
        ids[r, :n] = torch.tensor(toks)
        pos[r, :n] = torch.arange(c, c + n)
        slot[r, :n] = torch.tensor(s)
        segment[r, :n] = 0
        used = t[: min(len(t), blocks)]
        table[r, 0, : len(used)] = torch.tensor(used, dtype=torch.int64).clamp(min=0)
        computed[r, 0] = c
        out[r, 0] = n - 1
    x = StepInputs(input_ids=ids, position_ids=pos, last_index=out[:, 0])
    return x, BlockInputs(slot_mapping=slot, block_table=table, computed=computed, segment=segment, out_index=out)


def as_chunks(
    seg: Segments, *, segments: int, tokens: int, blocks: int, pad_id: int = 0
) -> tuple[StepInputs, BlockInputs]:
    """Every request in one row of `tokens` tokens, as `segments` segments over prefixes of `blocks` blocks.

    Padding segments have no tokens (their output is discarded); padding tokens write nowhere.
    """
    ids = torch.full((1, tokens), pad_id, dtype=torch.int64)
    pos = torch.zeros((1, tokens), dtype=torch.int64)
    slot = torch.full((1, tokens), -1, dtype=torch.int64)
    segment = torch.full((1, tokens), -1, dtype=torch.int64)
    table = torch.zeros((1, segments, blocks), dtype=torch.int64)
    computed = torch.zeros((1, segments), dtype=torch.int64)
    out = torch.zeros((1, segments), dtype=torch.int64)
    at = 0
    for r, (toks, c, s, t) in enumerate(zip(seg.tokens, seg.computed, seg.slots, seg.tables, strict=True)):
        n = len(toks)
        ids[0, at : at + n] = torch.tensor(toks)
        pos[0, at : at + n] = torch.arange(c, c + n)
        slot[0, at : at + n] = torch.tensor(s)
        segment[0, at : at + n] = r
        used = t[: min(len(t), blocks)]
        table[0, r, : len(used)] = torch.tensor(used, dtype=torch.int64).clamp(min=0)
        computed[0, r] = c
        out[0, r] = at + n - 1
        at += n
    x = StepInputs(input_ids=ids, position_ids=pos, last_index=torch.zeros(1, dtype=torch.int64))
    return x, BlockInputs(slot_mapping=slot, block_table=table, computed=computed, segment=segment, out_index=out)


def in_caller_columns(t: Tensor, ran: Segments, *, asked: Segments, width: int, fill: float) -> Tensor:
    """A row-per-request step's per-token outputs in the caller's `input_ids` [B, W] layout.

    Args:
        t: [L, B, S, ...] the step's rows (row r: request r's new tokens of `ran` in order, then
            padding), B the caller's rows.
        ran: the requests as the step ran them (`as_rows`).
        asked: the same requests as the caller asked for them: `ran` itself, or with fewer tokens
            when cached tokens past the program's prefix bucket were computed again (those are
            the caller's cached prefix, not reported).
        width: W, the columns of the caller's input_ids.
        fill: what every other column (padding, a cached prefix) holds.

    Returns:
        [L, B, W, ...]: request r's token i of `ran` at column `ran.first_column[r] + i` of row r,
        for the columns from `asked.first_column[r]` on.
    """
    out = t.new_full((t.shape[0], t.shape[1], width, *t.shape[3:]), fill)
    for r, (start, n, wanted) in enumerate(zip(ran.first_column, ran.new, asked.first_column, strict=True)):
        skip = max(0, wanted - start)  # tokens computed again: the caller's cached prefix
        out[:, r, start + skip : start + n] = t[:, r, skip:n]
    return out

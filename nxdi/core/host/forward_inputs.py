"""The checks of a `forward()` call's tensors, before any work is done. Pure.

A serving client drives `forward()` directly, so every tensor it passes is checked against the
compiled model and against what the KV cache holds (`cached`: tokens per cache row), and every
problem is listed at once, naming the argument, the row and the value:

- `input_ids` [B, W] (or [W]): integer ids in [0, vocab_size) wherever the mask says the token is
  real; never empty, never float, bool or complex (those would be truncated silently).
- `attention_mask` [B, W'] with W' >= W (a decode may pass the mask of the whole sequence): 0/1.
- `position_ids` [B, W] (or [B] with W == 1): integers; where given they are honoured, so they must
  agree with the cache. A call whose smallest position is 0 encodes prompts, and each row's real
  tokens then sit at positions 0..n-1. Any other call decodes: each row's tokens at
  consecutive positions starting no later than the tokens its cache row holds (earlier rewinds the
  row: the later entries are overwritten as generation goes on), and never on a row with nothing
  cached. Several tokens per row continue the row from a cached prefix; they run as that many
  token-generation steps.
- `seq_ids` [B]: integer cache rows in [0, cache_rows), distinct. Otherwise (REFERENCE §6):
  - with `apply_seq_ids_mask`, a seq_id of -1 marks a padding row: it runs (its outputs are
    returned, and meaningless) but writes no cache row at all. The reference writes such rows into
    128 extra cache positions; nxdi's runtime drops their writes instead (a padding row, see
    `nxdi.effects.runtime.Runtime.run`), so no cache row or position is spent on them.
  - with `kv_cache_padding_size` P > 0, a seq_id outside [0, cache_rows) (negative included, -1
    unless masked) and every row of a seq_id given twice go to the garbage rows (cache rows
    cache_rows..cache_rows+P-1, in turn): they run and their outputs are returned, and meaningless,
    but they read and write only garbage rows, so every real row's cache stays as it was. Every
    row of a duplicate goes there, since nothing says which of them owns the row.
  - otherwise such seq_ids are refused, naming them.
  Rows sent to a garbage row or masked hold no sequence: their positions are not checked against
  the cache (only against max_length) and they add nothing to what the cache holds.

(Over 400 lines: one check per argument, each reporting into the same list against the same limits;
the seq_ids rules above are most of it.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.errors import ConfigError, Problem

_SHOWN = 4
"""How many offending entries a problem quotes."""


@attrs.frozen(eq=False, kw_only=True)
class ForwardInputs:
    """A checked call: int64 tensors of consistent shapes, and which sub-model it runs."""

    input_ids: Tensor
    """[B, W]"""
    attention_mask: Tensor
    """[B, W], 0/1"""
    position_ids: Tensor
    """[B, W]"""
    seq_ids: Tensor
    """[B] the caller's seq_ids"""
    phase: Phase
    cache_rows: Tensor
    """[B] the cache row each row reads and writes: its seq_id, a garbage row, or -1 (a masked
    padding row, which writes nothing); see the module docstring."""
    routed: Tensor
    """[B] bool: the row went to a garbage row or is masked, so it holds no sequence."""

    def cached_after(self, capacity: int) -> dict[int, int]:
        """Tokens each named cache row holds once this call has run: `seq_id -> count`
        (a prompt keeps at most `capacity` tokens, the largest context bucket); rows sent to a
        garbage row or masked are left out."""
        # Python lists, not tensor indexing: this runs on every decode step (one tensor index
        # costs several microseconds)
        keep = [b for b, r in enumerate(self.routed.tolist()) if not r]
        seq_ids = self.seq_ids.tolist()
        if self.phase is Phase.CONTEXT:
            counts = self.attention_mask.sum(1).clamp(max=capacity).tolist()
        else:
            counts = [p + 1 for p in self.position_ids[:, -1].tolist()]
        return {int(seq_ids[b]): int(counts[b]) for b in keep}


@attrs.frozen(kw_only=True)
class Limits:
    """What the compiled model accepts."""

    vocab_size: int
    cache_rows: int
    """KV cache rows (kv_cache_batch_size): the seq_ids there are."""
    max_length: int
    """Positions 0..max_length-1 fit in the cache."""
    garbage_rows: int = 0
    """kv_cache_padding_size: cache rows after the real ones that take out-of-range and duplicate seq_ids."""
    mask_seq_ids: bool = False
    """apply_seq_ids_mask: a seq_id of -1 marks a padding row, which writes nothing."""


def _entries(where: Tensor) -> list[tuple[int, ...]]:
    return [tuple(i) for i in where.nonzero().tolist()[:_SHOWN]]


def as_integers(name: str, value: object) -> tuple[Tensor | None, list[Problem]]:
    """`value` as an int64 tensor, or (None and) the problem of a value that is not integers: floats,
    bools and complex values would be truncated silently."""
    fix = "pass integer tensors (torch.long)"
    try:
        t = value if isinstance(value, Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        return None, [Problem.of(name, type(value).__name__, f"is not a tensor of integers ({e})", fix)]
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        return None, [Problem.of(name, str(t.dtype), "must hold integers (it would be truncated silently)", fix)]
    return t.to(torch.int64), []


def _shape_problems(ids: Tensor, mask: Tensor | None, positions: Tensor | None, rows: Tensor | None) -> list[Problem]:
    b, w = ids.shape
    problems = []
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < w):
        why = f"has shape {tuple(mask.shape)}; input_ids is {(b, w)}, so it must be [{b}, {w}] (or wider, in a decode)"
        problems.append(Problem.of("attention_mask", tuple(mask.shape), why))
    if positions is not None and tuple(positions.shape) != (b, w):
        why = f"has shape {tuple(positions.shape)}; input_ids is {(b, w)}, so it must be [{b}, {w}]"
        problems.append(Problem.of("position_ids", tuple(positions.shape), why))
    if rows is not None and rows.numel() != b:
        why = f"names {rows.numel()} cache rows for a batch of {b}: one seq_id per row of input_ids"
        problems.append(Problem.of("seq_ids", rows.flatten().tolist(), why))
    return problems


def _filled(ids: Tensor, mask: Tensor | None, positions: Tensor | None) -> tuple[Tensor, Tensor]:
    """Whichever of attention_mask / position_ids is missing, as NxDI's preprocessing infers it."""
    b, w = ids.shape
    if mask is None and positions is None:
        mask = torch.ones(b, w, dtype=torch.int64)
    if positions is None:
        assert mask is not None
        if w == mask.shape[1]:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        else:  # new tokens after a mask covering the whole sequence so far
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -w:]
    if mask is None:
        cols = torch.arange(w)[None, :]
        mask = (positions >= cols).to(torch.int64) if w > 1 else torch.ones(b, 1, dtype=torch.int64)
    if mask.shape[1] != w:
        mask = torch.ones(b, w, dtype=torch.int64) if w == 1 else mask[:, -w:]
    return mask, positions


def _context_problems(mask: Tensor, positions: Tensor, given: bool) -> list[Problem]:
    problems = []
    for b in range(mask.shape[0]):
        real = mask[b].to(torch.bool)
        n = int(real.sum())
        if n == 0:
            problems.append(Problem.of(f"attention_mask[{b}]", mask[b].tolist(), "has no real token (an empty prompt)"))
        elif given and not torch.equal(positions[b][real], torch.arange(n)):
            got = positions[b][real].tolist()
            why = (
                f"row {b} is a prefill (the call's smallest position is 0), so its {n} real tokens sit at "
                f"positions 0..{n - 1}, not {got[:8]}{'...' if n > 8 else ''}"
            )
            fix = (
                "pass the positions of the whole prompt from 0, or continue that row from its cache in a "
                "call of its own"
            )
            problems.append(Problem.of(f"position_ids[{b}]", got[:8], why, fix))
    return problems


def _token_problems(
    positions: Tensor, rows: Tensor, routed: Tensor, cached: Sequence[int], limits: Limits
) -> list[Problem]:
    problems = []
    for b, (p, s) in enumerate(zip(positions[:, 0].tolist(), rows.tolist(), strict=True)):
        if not 0 <= s < limits.cache_rows or p >= limits.max_length or bool(routed[b]):
            continue  # reported already, or a row that holds no sequence
        held = cached[s]
        if held == 0:
            why = f"row {b} decodes at position {p} on cache row seq_id={s}, which holds nothing"
            fix = "encode that sequence's prompt first (a call whose positions start at 0)"
            problems.append(Problem.of(f"position_ids[{b}]", p, why, fix))
        elif p > held:
            why = (
                f"row {b} decodes at position {p}, but cache row seq_id={s} holds {held} tokens (positions "
                f"0..{held - 1}): the expected position is {held}; positions {held}..{p - 1} would be missing"
            )
            problems.append(Problem.of(f"position_ids[{b}]", p, why, f"pass position {held} for that row"))
    return problems


def check_forward_inputs(
    input_ids: object,
    attention_mask: object | None,
    position_ids: object | None,
    seq_ids: object | None,
    *,
    limits: Limits,
    cached: Sequence[int],
) -> Result[ForwardInputs, ConfigError]:
    """Check one `forward()` call and fill in the inferred tensors (see the module docstring).

    Args:
        cached: tokens each of the `limits.cache_rows` cache rows holds now.

    Returns:
        The checked inputs, or a ConfigError listing every problem (field, value, why, fix).
    """
    plain = _plain_decode(input_ids, attention_mask, position_ids, seq_ids, limits, cached)
    if plain is not None:
        return Success(plain)
    ids, problems = as_integers("input_ids", input_ids)
    mask = positions = rows = None
    if attention_mask is not None:
        mask, found = as_integers("attention_mask", attention_mask)
        problems += found
    if position_ids is not None:
        positions, found = as_integers("position_ids", position_ids)
        problems += found
    if seq_ids is not None:
        rows, found = as_integers("seq_ids", seq_ids)
        problems += found
    if ids is not None:
        if ids.dim() == 1:
            ids = ids[None, :]
            mask = mask[None, :] if mask is not None and mask.dim() == 1 else mask
        if ids.dim() != 2 or ids.numel() == 0:
            why = f"has shape {tuple(ids.shape)}; it must be [batch, tokens] with at least one token and one row"
            problems.append(Problem.of("input_ids", tuple(ids.shape), why))
    if positions is not None and ids is not None and ids.dim() == 2 and positions.dim() == 1 and ids.shape[1] == 1:
        positions = positions[:, None]  # one position per row of a decode
    if rows is not None and rows.dim() == 2 and rows.shape[1] == 1:
        rows = rows[:, 0]
    if problems or ids is None:
        return Failure(ConfigError(problems=tuple(problems)))
    problems += _shape_problems(ids, mask, positions, rows)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    b, w = ids.shape
    if mask is not None:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            values = mask[bad].unique().tolist()[:_SHOWN]
            problems.append(
                Problem.of(
                    "attention_mask", values, "holds values other than 0 and 1", "pass 1 for real tokens, 0 for padding"
                )
            )
            return Failure(ConfigError(problems=tuple(problems)))
    filled_mask, filled_positions = _filled(ids, mask, positions)
    rows = torch.arange(b) if rows is None else rows.flatten()
    cache_rows, routed, row_problems = route_rows(rows, limits, given=seq_ids is not None)
    if bool((filled_positions < 0).any()):
        at = _entries(filled_positions < 0)
        problems.append(Problem.of("position_ids", at, "holds negative positions (at these [row, column])"))
        return Failure(ConfigError(problems=tuple(problems + row_problems)))
    phase = Phase.CONTEXT if int(filled_positions.min()) == 0 else Phase.TOKEN
    # A prompt's padding columns are never embedded; every token a decode is given is real.
    problems += _id_problems(ids, filled_mask if phase is Phase.CONTEXT else torch.ones_like(ids), limits)
    if phase is Phase.TOKEN and mask is not None and not bool((mask[:, -w:] == 1).all()):
        why = "marks a token being decoded as padding (0); a decode's new tokens are all real"
        fix = "pass 1 for the new token (or leave attention_mask out and pass position_ids)"
        problems.append(Problem.of("attention_mask", mask[:, -w:].flatten().tolist()[:8], why, fix))
    problems += row_problems
    if phase is Phase.CONTEXT:
        problems += _context_problems(filled_mask, filled_positions, given=position_ids is not None)
    steps = filled_positions[:, :1] + torch.arange(w)
    consecutive = torch.equal(filled_positions, steps)
    if phase is Phase.TOKEN and not consecutive:
        r = next(r for r in range(b) if not torch.equal(filled_positions[r], steps[r]))
        got = filled_positions[r].tolist()
        why = f"row {r} decodes {w} tokens at positions {got}: the tokens of a decode follow each other"
        problems.append(Problem.of(f"position_ids[{r}]", got, why, "pass consecutive positions, or one token per row"))
    if phase is Phase.TOKEN and consecutive:
        top = int(filled_positions.max())
        if top >= limits.max_length:
            why = f"position {top} is past max_length={limits.max_length} (seq_len); generation cannot continue"
            problems.append(
                Problem.of("position_ids", top, why, "raise seq_len / max_length, or generate fewer tokens")
            )
        problems += _token_problems(filled_positions, rows, routed, cached, limits)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    return Success(
        ForwardInputs(
            input_ids=ids,
            attention_mask=filled_mask,
            position_ids=filled_positions,
            seq_ids=rows,
            phase=phase,
            cache_rows=cache_rows,
            routed=routed,
        )
    )


def _plain_decode(
    input_ids: object,
    attention_mask: object | None,
    position_ids: object | None,
    seq_ids: object | None,
    limits: Limits,
    cached: Sequence[int],
) -> ForwardInputs | None:
    """The checked inputs of a plain decode step, found on Python ints; None for any other call
    (the full check then decides, and words any problem).

    A plain decode step: int64 input_ids and position_ids [B, 1], no attention_mask, seq_ids none
    or int64 [B], distinct cache rows; every id in the vocabulary, every position at or below the
    tokens its row holds (and at least 1), below max_length. This is what a decode loop passes
    each step; in a decode step of the 1.1B shape the full check's few dozen tensor ops took about
    0.3 ms, this path 0.14 ms. Equal to the full check's result where it gives one (a property
    test holds the two together)."""
    if attention_mask is not None or not isinstance(input_ids, Tensor) or not isinstance(position_ids, Tensor):
        return None
    if input_ids.dtype != torch.int64 or input_ids.dim() != 2 or input_ids.shape[1] != 1:
        return None
    b = input_ids.shape[0]
    if position_ids.dtype != torch.int64 or tuple(position_ids.shape) != (b, 1) or b == 0:
        return None
    if seq_ids is None:
        rows = list(range(b))
    elif isinstance(seq_ids, Tensor) and seq_ids.dtype == torch.int64 and tuple(seq_ids.shape) == (b,):
        rows = seq_ids.tolist()
    else:
        return None
    ids = [i for (i,) in input_ids.tolist()]
    positions = [p for (p,) in position_ids.tolist()]
    fits = all(0 <= i < limits.vocab_size for i in ids) and len(set(rows)) == b
    if not fits or not all(0 <= s < limits.cache_rows for s in rows):
        return None
    if not all(1 <= p < limits.max_length and p <= cached[s] for p, s in zip(positions, rows, strict=True)):
        return None  # a prefill, a row holding nothing, or a position past the cache: the full check words it
    seq = torch.arange(b) if seq_ids is None else seq_ids
    return ForwardInputs(
        input_ids=input_ids,
        attention_mask=torch.ones(b, 1, dtype=torch.int64),
        position_ids=position_ids,
        seq_ids=seq,
        phase=Phase.TOKEN,
        cache_rows=torch.tensor(rows, dtype=torch.int64),
        routed=torch.zeros(b, dtype=torch.bool),
    )


def _id_problems(ids: Tensor, mask: Tensor, limits: Limits) -> list[Problem]:
    """Real tokens outside the vocabulary (padding columns are never embedded, so any id goes there)."""
    bad = ((ids < 0) | (ids >= limits.vocab_size)) & mask.to(torch.bool)
    if not bool(bad.any()):
        return []
    values = ids[bad].unique().tolist()[:_SHOWN]
    why = f"holds ids {values} (at [row, column] {_entries(bad)}) outside the vocabulary 0..{limits.vocab_size - 1}"
    fix = "tokenize with the model's own tokenizer, or mark padding columns 0 in attention_mask"
    return [Problem.of("input_ids", values, why, fix)]


def route_rows(rows: Tensor, limits: Limits, *, given: bool) -> tuple[Tensor, Tensor, list[Problem]]:
    """The cache row of every row of `rows` [B] (seq_ids) and whether it was routed away from its
    seq_id (garbage row or mask; see the module docstring), or the problems of seq_ids that cannot
    run: out of range or duplicate without kv_cache_padding_size, and a batch larger than the cache
    when the caller gave no seq_ids.

    Returns:
        cache rows [B] int64, routed [B] bool, and the problems (empty when it can run).
    """
    ids = rows.tolist()
    masked = [limits.mask_seq_ids and s == -1 for s in ids]
    counts = Counter(s for s, m in zip(ids, masked, strict=True) if not m)
    bad = [not m and not (0 <= s < limits.cache_rows and counts[s] == 1) for s, m in zip(ids, masked, strict=True)]
    if not given and any(s >= limits.cache_rows for s in ids):
        why = f"a batch of {len(ids)} rows needs {len(ids)} KV cache rows; the model has {limits.cache_rows}"
        fix = f"pass at most {limits.cache_rows} rows per call, or compile with kv_cache_batch_size >= {len(ids)}"
        return rows, torch.zeros_like(rows, dtype=torch.bool), [Problem.of("input_ids", len(ids), why, fix)]
    if any(bad) and limits.garbage_rows == 0:
        return rows, torch.zeros_like(rows, dtype=torch.bool), _row_problems(ids, limits, masked)
    out, garbage = [], 0
    for s, m, g in zip(ids, masked, bad, strict=True):
        if m:
            out.append(-1)  # writes nothing (a padding row of the runtime)
        elif g:
            out.append(limits.cache_rows + garbage % max(limits.garbage_rows, 1))
            garbage += 1
        else:
            out.append(s)
    routed = torch.tensor([m or g for m, g in zip(masked, bad, strict=True)], dtype=torch.bool)
    return torch.tensor(out, dtype=torch.int64), routed, []


def _row_problems(ids: list[int], limits: Limits, masked: list[bool]) -> list[Problem]:
    problems = []
    high = [r for r in ids if r >= limits.cache_rows]
    low = [r for r, m in zip(ids, masked, strict=True) if r < 0 and not m]
    twice = sorted(r for r, n in Counter(r for r, m in zip(ids, masked, strict=True) if not m).items() if n > 1)
    garbage = "set kv_cache_padding_size >= 1 to send them to a garbage row"
    if high:
        why = f"holds ids {high} outside the KV cache rows 0..{limits.cache_rows - 1}"
        fix = (
            f"use seq_ids below {limits.cache_rows}, compile with kv_cache_batch_size >= {max(high) + 1}, or {garbage}"
        )
        problems.append(Problem.of("seq_ids", ids, why, fix))
    if low:
        mask = "" if limits.mask_seq_ids else ", or mark padding rows -1 with apply_seq_ids_mask=True"
        fix = f"cache rows are numbered from 0{mask}; or {garbage}"
        problems.append(Problem.of("seq_ids", ids, f"holds negative ids {low}", fix))
    if twice:
        fix = f"give each row its own cache row, or {garbage}"
        problems.append(Problem.of("seq_ids", ids, f"holds duplicate ids {twice}", fix))
    return problems

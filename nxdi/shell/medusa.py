"""Medusa decoding: the loop that drives a Medusa model's tree steps (`generate(assistant_model=model)`).

A model compiled with `is_medusa=True` returns, from every step, its heads' top-K candidates
(`forward().medusa_tokens` [B, H, K]), and has one tree program per length bucket (the
speculation phase, `nxdi.core.programs.medusa`). Each round, per row:

1. The tree's tokens are laid out from the row's last emitted token `cur` (the root, at position
   L) and the previous step's candidates (`token_tree.candidate_tokens`).
2. One tree step scores all N nodes at slots L..L+N-1, accepts the longest chain the target's
   greedy tokens agree with, moves the chain's keys and values to slots L..L+n, and returns the
   emitted tokens (the chain and the target's own next token: 1 to depth+1 per step) and the
   heads' candidates at the chain's last node for the next round.
3. The host keeps what each row has room for (max_new_tokens, its EOS) and moves each row on to
   its own position L + n + 1: rows accept different lengths.

Greedy only: every emitted token is the target's argmax after its prefix, so the output is the
target's greedy output token for token. Near the end of the cache (L + N past max_length) the
rows finish with the target's token-generation steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.planning import buckets
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.medusa import MedusaPlan
from nxdi.core.programs import medusa, token_tree
from nxdi.core.programs.inputs import StepInputs
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap


def check_model(model: NeuronBaseForCausalLM, assistant: Any, *, batch: int) -> MedusaPlan:
    """The model's Medusa plan, once `generate(assistant_model=assistant)` can run Medusa on `batch` rows.

    Raises:
        IncompatibleConfigError: listing every reason it cannot (the assistant is another model,
        or the prompts are more rows than the compiled batch).
    """
    problems = []
    if assistant is not model:
        problems.append(
            f"assistant_model is a {type(assistant).__name__}, not the model itself: Medusa's heads are part of the "
            "model, so pass the model (or its HuggingFaceGenerationAdapter) as assistant_model"
        )
    if batch > model.spec.spec_batch_size:
        problems.append(
            f"generate() got {batch} prompts, more than the tree programs' batch (spec_batch_size="
            f"{model.spec.spec_batch_size}); compile with batch_size >= {batch}"
        )
    if problems:
        raise IncompatibleConfigError("Medusa decoding: " + "; ".join(problems))
    return unwrap(medusa_plan.plan_for(model.spec), "Invalid Medusa configuration")


def generate(
    model: NeuronBaseForCausalLM,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
) -> tuple[Tensor, dict[str, int]]:
    """Up to `max_new_tokens` greedy tokens per row [B, N] (a row past its EOS padded with
    `pad_token_id`), and counts (`adapter.speculation_stats`): `tree_steps`, single-token
    `decode_steps`, tokens `emitted`, candidates `proposed` (the tree's depth per live row and tree
    step: the most a step can accept) and `accepted` (so accepted / proposed is the acceptance rate).

    Raises:
        IncompatibleConfigError: the prompts plus the new tokens do not fit max_length.
    """
    batch = input_ids.shape[0]
    plan = unwrap(medusa_plan.plan_for(model.spec), "Invalid Medusa configuration")
    lengths = attention_mask.to(torch.int64).sum(-1)  # [B]
    longest = int(lengths.max())
    if longest + max_new_tokens - 1 > model.spec.max_length:
        raise IncompatibleConfigError(
            f"generate(): a {longest}-token prompt plus {max_new_tokens} new tokens needs "
            f"{longest + max_new_tokens - 1} positions, more than max_length={model.spec.max_length} (seq_len). "
            "Fix: raise seq_len, or lower max_new_tokens"
        )
    greedy = torch.tensor([[1.0, 1.0, 1.0]] * batch)
    model.reset()
    first = model.forward(input_ids, attention_mask=attention_mask, sampling_params=greedy)
    cur = _greedy(first)
    candidates = first[medusa.MEDUSA_TOKENS]  # [B, H, K]
    out = [[int(t)] for t in cur]
    at = lengths.clone()  # [B]: the position of `cur`, the next root
    stats = {"tree_steps": 0, "decode_steps": 0, "emitted": batch, "proposed": 0, "accepted": 0}
    while any(_room(row, max_new_tokens, eos_token_id) for row in out):
        room = torch.tensor([_room(row, max_new_tokens, eos_token_id) for row in out])
        if int(at.max()) + plan.nodes > model.spec.max_length:
            # No room for a tree step: finish with single-token steps of the rows that go on (a
            # finished row may sit at max_length, where no step can run, so it is left out).
            rows = (room > 0).nonzero()[:, 0]
            decoded = model.forward(
                cur[rows, None], position_ids=at[rows, None], seq_ids=rows, sampling_params=greedy[rows]
            )
            nxt = _greedy(decoded)
            for i, row in enumerate(rows.tolist()):
                out[row].append(int(nxt[i]))
            cur, at = cur.index_put((rows,), nxt), at.index_add(0, rows, torch.ones_like(rows))
            stats["decode_steps"] += 1
            stats["emitted"] += len(rows)
            continue
        step = tree_step(model, token_tree.candidate_tokens(cur, candidates, plan.tree), at)
        stats["tree_steps"] += 1
        candidates = step.candidates
        going = _keep(out, step.tokens, step.counts, room, eos_token_id, stats)
        bonus = step.tokens.gather(1, (step.counts - 1)[:, None])[:, 0]
        cur, at = torch.where(going, bonus, cur), torch.where(going, at + step.counts, at)
    return _padded(out, pad_token_id), stats


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class TreeStep:
    """What one tree step returned (D: the tree's depth)."""

    logits: Tensor | None
    """[B, N, V] the target's logits at every node (None under on-device sampling without output_logits)."""
    tokens: Tensor
    """[B, D+1] the emitted tokens: the accepted chain, the target's own next token, then -1."""
    counts: Tensor
    """[B] tokens emitted, 1..D+1."""
    candidates: Tensor
    """[B, H, K] the heads' candidates at the chain's last node (the next tree's)."""


def tree_step(model: NeuronBaseForCausalLM, ids: Tensor, at: Tensor) -> TreeStep:
    """One tree step of every row: `ids` [B, N] laid out by the model's tree, the root of row b at
    position `at[b]` (slots at..at+N-1). Afterwards row b's cache holds `at + counts` tokens (the
    accepted chain compacted behind the root), which forward() then continues from.

    Raises:
        IncompatibleConfigError: a row's tree does not fit max_length (no bucket holds at + N).
    """
    b, n = ids.shape
    x = StepInputs(
        input_ids=ids.to(torch.int64),
        position_ids=at[:, None] + torch.arange(n)[None, :],  # slots L..L+N-1
        last_index=torch.full((b,), n - 1, dtype=torch.int64),
    )
    table = model._tables[Phase.SPECULATION]  # the tree programs' table (causal_lm sets it for Medusa)
    bucket = unwrap(buckets.select_bucket(table, int(at.max())), "A Medusa tree step does not fit")
    runtime = model._require_runtime()
    logits, _, extras = model._run_batched(runtime, Phase.SPECULATION, bucket, x, torch.arange(b), torch.ones(b, 3))
    counts = extras[medusa.ACCEPTED_COUNTS]
    for row in range(b):  # what each cache row now holds (forward() checks positions against it)
        model._cached[row] = int(at[row] + counts[row])
    return TreeStep(
        logits=logits, tokens=extras[medusa.ACCEPTED_TOKENS], counts=counts, candidates=extras[medusa.MEDUSA_TOKENS]
    )


def _keep(
    out: list[list[int]], tokens: Tensor, counts: Tensor, room: Tensor, eos: int | None, stats: dict[str, int]
) -> Tensor:
    """Append what each live row has room for, up to its EOS; [B] bool: the rows that go on."""
    going = torch.zeros(len(out), dtype=torch.bool)
    for row in (room > 0).nonzero()[:, 0].tolist():
        n = int(counts[row])
        emitted = tokens[row, : min(n, int(room[row]))].tolist()
        if eos is not None and eos in emitted:
            emitted = emitted[: emitted.index(eos) + 1]
        out[row].extend(emitted)
        stats["emitted"] += len(emitted)
        stats["proposed"] += tokens.shape[1] - 1  # the tree's depth D: tokens is [B, D+1]
        stats["accepted"] += min(len(emitted), n - 1)
        left = int(room[row]) - len(emitted)
        going[row] = len(emitted) == n and left > 0 and (eos is None or eos not in emitted)
    return going


def _greedy(out: Any) -> Tensor:
    """[B] the step's greedy tokens: the argmax of its logits, or the tokens sampled on device
    (greedy: generate passes top_k=1 rows)."""
    if out.logits is not None:
        return out.logits[:, -1].argmax(-1)
    return out.tokens.reshape(-1).to(torch.int64)


def _room(row: list[int], max_new: int, eos: int | None) -> int:
    """How many more tokens a row may emit: none after its EOS or at `max_new`."""
    return 0 if eos is not None and eos in row else max_new - len(row)


def _padded(out: list[list[int]], pad: int) -> Tensor:
    """[B, N] the rows padded with `pad` to one width."""
    width = max(len(r) for r in out)
    return torch.tensor([r + [pad] * (width - len(r)) for r in out], dtype=torch.int64)

"""Greedy EAGLE speculation driven from the host: a test oracle for the fused EAGLE programs.

The flat-draft EAGLE round of NxDI's fused speculation (`nxdi.core.programs.eagle_fused` runs
it inside one program), driven step by step from the host with the same programs (see `nxdi.core.programs.eagle` for the pairing):

1. Prefill. The target encodes the prompts and returns its hidden states h; its greedy token `cur`
   follows each prompt. The draft encodes the pairs (t_{q+1}, h_q) of the prompt with `cur` at the
   last one (`eagle.pair_inputs`), so its output there already proposes the token after `cur`.
2. Draft. From that output, `propose` drafts k-1 tokens d_1..d_{k-1}, feeding its own hidden
   states back.
3. Verify. The target scores [cur, d_1 .. d_{k-1}] at positions L .. L+k-1 in one step (every
   token's logits and hidden states); `speculation.greedy_accept` keeps the prefix its argmax
   agrees with, then its own token: exactly the target's greedy tokens.
4. Re-pair. The draft runs over that step's pairs up to the accepted count, with the target's
   hidden states (`pair_inputs(..., last_index=count-1)`): its provisional slots are rewritten from
   the target's h, and its output at the last pair proposes the next round's first token.

Rows accept different counts and continue from their own positions. A row that has all its tokens
stops moving (its later rounds rewrite its own slots, unread). Greedy only: no EOS, no sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.partition import Partition
from nxdi.core.programs import decoder, eagle, inputs, kv_cache, speculation
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache

TargetForward = Callable[..., tuple[Tensor, KVCache, Mapping[str, Tensor]]]
"""The target program's `forward_outputs` (`decoder.forward_outputs`, which takes `hidden=True`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stats:
    """How a generation went: target steps after the prefill, draft tokens proposed and accepted."""

    target_steps: int
    proposed: int
    accepted: int

    @property
    def acceptance(self) -> float:
        """Accepted over proposed draft tokens (0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Pair:
    """A target and an EAGLE draft over the same vocabulary."""

    target_forward: TargetForward
    target_weights: Any
    """The target program's weights value (`decoder.DecoderWeights` for the decoder)."""
    target_spec: ModelSpec
    draft_weights: eagle.EagleWeights
    draft_spec: ModelSpec


def _target(pair: Pair, cache: KVCache, x: StepInputs, *, every: bool) -> tuple[Tensor, Tensor, KVCache]:
    """The target's logits ([B, S, V] with `every`, else [B, 1, V]), hidden states [B, S, E] and cache."""
    logits, cache, extras = pair.target_forward(
        pair.target_weights, cache, x, spec=pair.target_spec, all_logits=every, hidden=True
    )
    return logits, extras[decoder.HIDDEN], cache


Pending = tuple[Tensor, Tensor, Tensor]
"""The draft's output at each row's last pair: logits [B, V], its hidden state [B, E], the pair's position [B]."""


def _prefill(pair: Pair, prompts: Sequence[Sequence[int]], length: int) -> tuple[KVCache, KVCache, Tensor, Pending]:
    """Rule 1: the caches (`length` slots) after the prompts, each row's first token [B] and the draft's pending output."""
    bucket, b = max(len(p) for p in prompts), len(prompts)
    tcache = kv_cache.empty_cache(pair.target_spec, batch=b, length=length, dtype=pair.target_weights.embed.dtype)
    dcache = kv_cache.empty_cache(pair.draft_spec, batch=b, length=length, dtype=pair.draft_weights.decoder.embed.dtype)
    x = inputs.prompt_inputs(prompts, length=bucket)
    logits, hidden, part = _target(pair, tcache.prefix(bucket), x, every=False)
    cur = logits[:, 0].argmax(-1)  # [B]
    draft_logits, own, dpart = eagle.forward(
        pair.draft_weights, dcache.prefix(bucket), *eagle.pair_inputs(x, hidden, cur), spec=pair.draft_spec
    )
    pending = (eagle.last_of(draft_logits, x.last_index), eagle.last_of(own, x.last_index), x.last_index)
    return tcache.splice(part), dcache.splice(dpart), cur, pending


def generate(
    pair: Pair, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int
) -> tuple[list[list[int]], Stats]:
    """`max_new_tokens` greedy tokens per prompt, speculated k-1 at a time by the EAGLE draft.

    Args:
        pair: the target and the draft.
        prompts: B token-id lists (each non-empty).
        k: the speculation length (tokens one target step scores), >= 2.
        max_new_tokens: tokens to generate per row, >= 1.

    Returns:
        Each row's new tokens (the target's greedy continuation), and the counts.

    Raises:
        ValueError: k < 2, max_new_tokens < 1 or an empty prompt.
    """
    # (Over 40 lines: one round of rules 2-4 per iteration, kept whole so the state it threads
    # through (caches, the draft's pending output, each row's token and position) reads top to bottom.)
    if k < 2 or max_new_tokens < 1 or not all(prompts):
        raise ValueError(f"need k >= 2 (got {k}), max_new_tokens >= 1 (got {max_new_tokens}) and non-empty prompts")
    b = len(prompts)
    # Every slot a round can write: a row's last round moves it up to k past its last token, and
    # it then keeps running (unread) from there while other rows finish.
    length = max(len(p) for p in prompts) + max_new_tokens + 2 * k
    tcache, dcache, cur, pending = _prefill(pair, prompts, length)
    out = [[int(t)] for t in cur]
    at = pending[2] + 1  # [B]: the position of `cur`
    steps = proposed = accepted = 0
    while any(len(row) < max_new_tokens for row in out):
        drafted, dcache = propose(
            pair.draft_weights, dcache, pending[0], pending[1], pending[2], steps=k - 1, spec=pair.draft_spec
        )
        positions = at[:, None] + torch.arange(k)  # [B, k]
        step_x = StepInputs(
            input_ids=torch.cat((cur[:, None], drafted), 1),
            position_ids=positions,
            last_index=torch.full((b,), k - 1, dtype=torch.int64),
        )
        scored, hidden, tcache = _target(pair, tcache, step_x, every=True)
        tokens, counts = speculation.greedy_accept(scored, drafted)
        live = torch.tensor([len(row) < max_new_tokens for row in out])
        steps, proposed = steps + 1, proposed + int(live.sum()) * (k - 1)
        accepted += int((counts - 1)[live].sum())
        for row in live.nonzero()[:, 0].tolist():
            out[row].extend(tokens[row, : int(counts[row])].tolist()[: max_new_tokens - len(out[row])])
        last = counts - 1  # [B]: the index of the target's own token
        nxt = tokens.gather(1, last[:, None])[:, 0]
        draft_logits, own, dcache = eagle.forward(  # rule 4
            pair.draft_weights, dcache, *eagle.pair_inputs(step_x, hidden, nxt, last_index=last), spec=pair.draft_spec
        )
        pending = (
            torch.where(live[:, None], eagle.last_of(draft_logits, last), pending[0]),
            torch.where(live[:, None], eagle.last_of(own, last), pending[1]),
            torch.where(live, at + last, pending[2]),
        )
        cur, at = torch.where(live, nxt, cur), torch.where(live, at + counts, at)
    return out, Stats(target_steps=steps, proposed=proposed, accepted=accepted)


def greedy(pair: Pair, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy tokens, one step per token (what `generate` must equal)."""
    bucket, b, dtype = max(len(p) for p in prompts), len(prompts), pair.target_weights.embed.dtype
    cache = kv_cache.empty_cache(pair.target_spec, batch=b, length=bucket + max_new_tokens, dtype=dtype)
    x = inputs.prompt_inputs(prompts, length=bucket)
    logits, _, part = _target(pair, cache.prefix(bucket), x, every=False)
    cache = cache.splice(part)
    at, tokens = x.last_index + 1, [logits[:, 0].argmax(-1)]
    for _ in range(max_new_tokens - 1):
        logits, _, cache = _target(pair, cache, inputs.token_inputs(tokens[-1], at), every=False)
        tokens.append(logits[:, 0].argmax(-1))
        at = at + 1
    return torch.stack(tokens, 1).tolist()


def propose(
    w: eagle.EagleWeights,
    cache: KVCache,
    logits: Tensor,
    hidden: Tensor,
    position: Tensor,
    *,
    steps: int,
    spec: ModelSpec,
    part: Partition | None = None,
    coll: Collectives = SINGLE,
) -> tuple[Tensor, KVCache]:
    """Greedy draft tokens, one per step, each fed back with the draft's own hidden state (rule 4).

    Args:
        logits: [B, V] the draft's logits at its last pair (position `position`), which give the
            first proposal; hidden: [B, E] its own hidden state there.
        position: [B] that pair's position q; the proposals' pairs go to q+1, q+2, ...
        steps: how many tokens to propose (k - 1 for speculation_length k); the cache view must
            hold positions up to q + steps - 1.

    Returns:
        tokens [B, steps] int64 and the cache with the provisional pairs of the first steps-1
        proposals written (the last proposal is not fed back: the target scores it first).
    """
    tokens = [logits.argmax(-1)]  # [B]
    for i in range(steps - 1):
        x = inputs.token_inputs(tokens[-1], position + 1 + i)
        step_logits, g, cache = eagle.forward(w, cache, x, hidden[:, None], spec=spec, part=part, coll=coll)
        tokens.append(step_logits[:, 0].argmax(-1))
        hidden = g[:, 0]
    return torch.stack(tokens, dim=1), cache

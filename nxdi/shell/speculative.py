"""Speculative decoding with a draft model: the loop that drives a target and a draft nxdi model.

The target is compiled with `speculation_length` k (its speculation programs score k tokens per
row in one step, `NeuronBaseForCausalLM.forward` with k-token inputs); the draft is any nxdi
causal LM over the same vocabulary with the same batch size. Each round, per row:

1. The draft proposes k-1 tokens after the row's last accepted token `cur` (at position L): it
   first reads [prev, cur] at positions L-1, L (`prev`, the token before `cur`, is re-read so that
   every row catches up in one 2-column call whether or not the draft saw it: a token re-read at
   its own position writes the same keys and values; in the first round, after the prompts, `cur`
   alone), then one token per step.
2. The target scores [cur, d_1 .. d_{k-1}] at positions L .. L+k-1 in one speculation step.
3. `nxdi.core.programs.speculation` accepts a prefix of the proposals and adds the target's own
   next token: greedy (exactly the target's greedy tokens) or speculative sampling (exactly the
   target's distribution). Rows accept different counts; each continues from its own position.

Rejected tokens need no cleanup in either cache: their slots lie after the row's new position,
which no later step reads before writing it again. Near the end of the cache (L + k beyond
max_length) a row's step starts at max_length - k instead: it re-reads the row's last accepted
tokens before `cur` and holds only the proposals that fit, so every write stays inside the cache
and the target needs no token-generation program (trace_tokengen_model=False compiles none).

Supported: greedy and multinomial decoding with temperature / top-k / top-p, max_new_tokens or
max_length, and an EOS token. Other logits processors and stopping criteria are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nxdi.core.host import batching
from nxdi.core.programs import speculation
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.exceptions import IncompatibleConfigError


def check_pair(target: NeuronBaseForCausalLM, draft: NeuronBaseForCausalLM, *, batch: int) -> int:
    """k, once the pair can run speculative decoding on `batch` rows.

    Raises:
        IncompatibleConfigError: listing every reason it cannot (no speculation programs on the
        target, a draft over another vocabulary, batch sizes that do not hold `batch` rows, a
        model that returns no logits).
    """
    problems = []
    k = target.spec.speculation_length
    if k < 2:
        problems.append(
            f"the target's speculation_length={k}: compile it with speculation_length >= 2 (the tokens one "
            "speculation step scores: the last accepted token and k-1 draft tokens)"
        )
    tv, dv = target.model_spec.vocab_size, draft.model_spec.vocab_size
    if tv != dv:
        problems.append(f"the draft's vocab_size={dv} differs from the target's {tv}: they must share a tokenizer")
    for name, m in (("target", target), ("draft", draft)):
        if m.spec.batch_size != batch:
            problems.append(f"the {name}'s batch_size={m.spec.batch_size}, but generate() got {batch} prompts")
        if m.spec.on_device_sampling_config is not None and not m.spec.output_logits:
            problems.append(f"the {name} samples on device without output_logits=True: speculation needs logits")
    if problems:
        raise IncompatibleConfigError("speculative decoding: " + "; ".join(problems))
    return k


class _Picker:
    """Turns logits into tokens and distributions with one generation config's settings."""

    def __init__(self, params: Tensor | None, generator: torch.Generator) -> None:
        self.params, self.generator = params, generator  # params [B, 3]: None for greedy

    def dist(self, logits: Tensor) -> Tensor:
        """[B, ..., V] processed probabilities (one-hot argmax when greedy)."""
        if self.params is None:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return speculation.probs(logits.float(), self.params, global_topk=0)  # the whole vocabulary, as transformers

    def pick(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens [B] and the distributions [B, V] they were drawn from."""
        p = self.dist(logits)
        if self.params is None:
            return logits.argmax(-1), p
        return speculation.draw(p, self.uniforms(p.shape[0])), p

    def uniforms(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.generator)


def generate(
    target: NeuronBaseForCausalLM,
    draft: NeuronBaseForCausalLM,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    params: Tensor | None,
    eos_token_id: int | None,
    pad_token_id: int,
    generator: torch.Generator,
) -> tuple[Tensor, dict[str, int]]:
    """Up to `max_new_tokens` new tokens per row [B, N] (a row past its EOS padded with
    `pad_token_id`), with greedy (`params` None) or sampled tokens (`params` [B, 3]: top_k, top_p,
    temperature per row); and counts: target speculation steps, tokens they emitted, draft tokens
    proposed, and draft tokens accepted.

    Raises:
        IncompatibleConfigError: the pair cannot run it (`check_pair`), or the prompts plus the new
        tokens do not fit max_length, or max_length is not above speculation_length.
    """
    batch = input_ids.shape[0]
    k = check_pair(target, draft, batch=batch)
    lengths = attention_mask.to(torch.int64).sum(-1, keepdim=True)  # [B, 1]
    limit = min(target.spec.max_length, draft.spec.max_length)
    if int(lengths.max()) + max_new_tokens > limit or limit <= k:
        raise IncompatibleConfigError(
            f"generate(): a {int(lengths.max())}-token prompt plus {max_new_tokens} new tokens exceeds "
            f"max_length={limit} (of the target or the draft), or max_length is not above speculation_length={k}. "
            "Fix: raise seq_len, or lower max_new_tokens"
        )
    pick = _Picker(params, generator)
    target.reset()
    draft.reset()
    first = target.forward(input_ids, attention_mask=attention_mask).logits[:, -1]
    draft.forward(input_ids, attention_mask=attention_mask)
    cur, _ = pick.pick(first)
    # history[b, p]: row b's token at position p (its prompt, then what it emitted): the target
    # re-reads its last tokens when a step would run past max_length (`_window`).
    prompts, _ = batching.compact(input_ids, attention_mask)
    history = torch.zeros(batch, limit, dtype=torch.int64)
    width = min(prompts.shape[1], limit)  # columns past the longest prompt are padding
    history[:, :width] = prompts[:, :width]
    history.scatter_(1, lengths, cur[:, None])
    out = [[int(t)] for t in cur]
    at = lengths.clone()  # [B, 1]: the position of `cur`
    stats = {"target_steps": 0, "emitted": batch, "proposed": 0, "accepted": 0}
    first_round = True
    while not all(_room(row, max_new_tokens, eos_token_id) == 0 for row in out):
        room = torch.tensor([_room(row, max_new_tokens, eos_token_id) for row in out])
        drafted, qs = _propose(draft, pick, history, at, k=k, limit=limit, first_round=first_round)
        first_round = False
        inputs, positions, offset = _window(history, at, drafted, limit=limit)
        scored = target.forward(inputs, position_ids=positions).logits
        # Align each row's scores with its proposals: index j scores the token after position at + j
        # (past the row's usable proposals the scores repeat the last one; nothing there is kept).
        scored = scored.gather(1, (offset + torch.arange(k)).clamp(max=k - 1)[..., None].expand(scored.shape))
        if params is None:
            tokens, counts = speculation.greedy_accept(scored, drafted)
        else:
            p = pick.dist(scored)  # [B, k, V]
            tokens, counts = speculation.sample_accept(p, torch.stack(qs, 1), drafted, pick.uniforms(batch, k))
        live = room > 0
        usable = (limit - 1 - at[:, 0]).clamp(max=k - 1)  # [B] proposals that fit before max_length
        stats["target_steps"] += 1
        stats["proposed"] += int(usable[live].sum())
        stats["accepted"] += int(torch.minimum(counts - 1, usable)[live].sum())
        # A row keeps what it has room for, up to its EOS; a finished row keeps nothing and stays.
        kept = torch.minimum(counts, room)
        for row in live.nonzero()[:, 0].tolist():
            emitted = tokens[row, : int(kept[row])].tolist()
            if eos_token_id is not None and eos_token_id in emitted:
                emitted = emitted[: emitted.index(eos_token_id) + 1]
            kept[row] = len(emitted)
            out[row].extend(emitted)
            start = int(at[row]) + 1
            history[row, start : start + len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        stats["emitted"] += int(kept.sum())
        at = at + kept[:, None]
    return _padded(out, pad_token_id), stats


def _propose(
    draft: NeuronBaseForCausalLM,
    pick: _Picker,
    history: Tensor,
    at: Tensor,
    *,
    k: int,
    limit: int,
    first_round: bool,
) -> tuple[Tensor, list[Tensor]]:
    """The draft's k-1 proposals after each row's token at `at` [B, 1]: tokens [B, k-1] and the
    distributions [B, V] they were drawn from, one per proposal.

    A row near max_length needs fewer (`_window`); its later draft steps are fed at position
    limit - 1 instead of past it, so no cache write leaves the cache, and their proposals are junk
    the target never reads.
    """
    cur = history.gather(1, at)  # [B, 1]
    if first_round:  # the draft holds each prompt: `cur` is all it lacks
        logits = draft.forward(cur, position_ids=at).logits
    else:
        # [prev, cur]: the token before `cur` is re-read (at its own position it writes the same
        # keys and values) so every row catches up in one call. Positions from 1 on: a call holding
        # position 0 would be a prefill; only a finished row (still at a 1-token prompt) is moved.
        lo = (at - 1).clamp(min=1)
        logits = draft.forward(history.gather(1, torch.cat([lo, lo + 1], 1)), position_ids=torch.cat([lo, lo + 1], 1))
        logits = logits.logits
    proposals, qs = [], []
    for i in range(k - 1):
        d, q = pick.pick(logits[:, -1])
        proposals.append(d)
        qs.append(q)
        if i < k - 2:
            logits = draft.forward(d[:, None], position_ids=(at + i + 1).clamp(max=limit - 1)).logits
    return torch.stack(proposals, 1), qs


def _window(history: Tensor, at: Tensor, drafted: Tensor, *, limit: int) -> tuple[Tensor, Tensor, Tensor]:
    """What the target scores per row: (tokens [B, k], positions [B, k], offset [B, 1]).

    A row's k consecutive positions start at its last token (`at`) when they fit before `limit`:
    [cur, d_1 .. d_{k-1}]. Near the end they start at limit - k instead, so the step re-reads the
    row's `offset` = at - start tokens before `cur` (at their own positions: the same keys and
    values) and holds the limit - 1 - at proposals that fit. Every write stays inside the cache,
    and no token-generation program is needed to finish (trace_tokengen_model=False).
    """
    k = drafted.shape[1] + 1
    start = at.clamp(max=limit - k)  # [B, 1]
    positions = start + torch.arange(k)  # [B, k]
    known = history.gather(1, positions)
    proposed = drafted.gather(1, (positions - at - 1).clamp(min=0))
    return torch.where(positions <= at, known, proposed), positions, at - start


def _room(row: list[int], max_new: int, eos: int | None) -> int:
    """How many more tokens a row may emit: none after its EOS or at `max_new`."""
    return 0 if eos is not None and eos in row else max_new - len(row)


def _padded(out: list[list[int]], pad: int) -> Tensor:
    """[B, N] the rows padded with `pad` to one width."""
    width = max(len(r) for r in out)
    return torch.tensor([r + [pad] * (width - len(r)) for r in out], dtype=torch.int64)

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
max_length) the target finishes with single-token steps.

Supported: greedy and multinomial decoding with temperature / top-k / top-p, max_new_tokens or
max_length, and an EOS token. Other logits processors and stopping criteria are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
        tokens do not fit max_length.
    """
    batch = input_ids.shape[0]
    k = check_pair(target, draft, batch=batch)
    lengths = attention_mask.to(torch.int64).sum(-1, keepdim=True)  # [B, 1]
    limit = min(target.spec.max_length, draft.spec.max_length)
    if int(lengths.max()) + max_new_tokens > limit:
        raise IncompatibleConfigError(
            f"generate(): a {int(lengths.max())}-token prompt plus {max_new_tokens} new tokens exceeds "
            f"max_length={limit} (of the target or the draft). Fix: raise seq_len, or lower max_new_tokens"
        )
    pick = _Picker(params, generator)
    target.reset()
    draft.reset()
    first = target.forward(input_ids, attention_mask=attention_mask).logits[:, -1]
    draft.forward(input_ids, attention_mask=attention_mask)
    cur, _ = pick.pick(first)
    prev = input_ids.gather(1, lengths - 1 + _prompt_start(attention_mask))[:, 0]  # each prompt's last token
    out = [[int(t)] for t in cur]
    at = lengths.clone()  # [B, 1]: the position of `cur`
    stats = {"target_steps": 0, "emitted": batch, "proposed": 0, "accepted": 0}
    first_round = True
    while not all(_room(row, max_new_tokens, eos_token_id) == 0 for row in out):
        room = torch.tensor([_room(row, max_new_tokens, eos_token_id) for row in out])
        if int(at.max()) + k > limit:
            # No room for a speculation step: finish with the target's single-token steps (a
            # finished row stays where it is, rewriting its own slot).
            nxt, _ = pick.pick(target.forward(cur[:, None], position_ids=at).logits[:, -1])
            going = room > 0
            for row in going.nonzero()[:, 0].tolist():
                out[row].append(int(nxt[row]))
            prev, cur = torch.where(going, cur, prev), torch.where(going, nxt, cur)
            at = at + going[:, None].long()
            continue
        proposals, qs = [], []
        if first_round:  # the draft holds each prompt: `cur` is all it lacks
            logits = draft.forward(cur[:, None], position_ids=at).logits
        else:  # [prev, cur]: positions from 1 on (a call holding position 0 would be a prefill)
            logits = draft.forward(torch.stack([prev, cur], 1), position_ids=torch.cat([at - 1, at], 1)).logits
        for i in range(k - 1):
            d, q = pick.pick(logits[:, -1])
            proposals.append(d)
            qs.append(q)
            if i < k - 2:
                logits = draft.forward(d[:, None], position_ids=at + i + 1).logits
        first_round = False
        drafted = torch.stack(proposals, 1)  # [B, k-1]
        scored = target.forward(torch.cat([cur[:, None], drafted], 1), position_ids=at + torch.arange(k)).logits
        if params is None:
            tokens, counts = speculation.greedy_accept(scored, drafted)
        else:
            p = pick.dist(scored)  # [B, k, V]
            tokens, counts = speculation.sample_accept(p, torch.stack(qs, 1), drafted, pick.uniforms(batch, k))
        live = room > 0
        stats["target_steps"] += 1
        stats["proposed"] += int(live.sum()) * (k - 1)
        stats["accepted"] += int((counts - 1)[live].sum())
        # A row keeps what it has room for, up to its EOS; a finished row keeps nothing and stays.
        kept = torch.minimum(counts, room)
        for row in live.nonzero()[:, 0].tolist():
            emitted = tokens[row, : int(kept[row])].tolist()
            if eos_token_id is not None and eos_token_id in emitted:
                emitted = emitted[: emitted.index(eos_token_id) + 1]
            kept[row] = len(emitted)
            out[row].extend(emitted)
        stats["emitted"] += int(kept.sum())
        seq = torch.cat([prev[:, None], cur[:, None], tokens], 1)  # [B, k+2]
        prev = seq.gather(1, kept[:, None])[:, 0]  # with nothing kept: prev and cur unchanged
        cur = seq.gather(1, kept[:, None] + 1)[:, 0]
        at = at + kept[:, None]
    return _padded(out, pad_token_id), stats


def _room(row: list[int], max_new: int, eos: int | None) -> int:
    """How many more tokens a row may emit: none after its EOS or at `max_new`."""
    return 0 if eos is not None and eos in row else max_new - len(row)


def _prompt_start(mask: Tensor) -> Tensor:
    """[B, 1] where each row's prompt starts: 0 when right padded, the padding width when left padded."""
    return mask.to(torch.int64).argmax(-1, keepdim=True)


def _padded(out: list[list[int]], pad: int) -> Tensor:
    """[B, N] the rows padded with `pad` to one width."""
    width = max(len(r) for r in out)
    return torch.tensor([r + [pad] * (width - len(r)) for r in out], dtype=torch.int64)

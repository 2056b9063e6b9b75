"""The transformers-neuronx sampling loop, on an nxdi causal LM's context and token steps.

`run` encodes the prompts once, then asks `pick` for each next token and runs one token step per
token, as transformers-neuronx's `sample` does (a prompt longer than the largest
`context_length_estimate`: its first that many tokens in parallel, the rest one per token step): the result is the prompts followed by the new
tokens, [B, <= sequence_length]; once a row has produced an EOS token, its later tokens are EOS
too; the streamer gets each step's tokens ([B, 1]) and `end()` at the end; the stopping criteria
are asked `(input_ids, probs)` after each step and stop the loop when they return True.

Host picking (`host_pick`): repeated n-grams banned as transformers' NoRepeatNGramLogitsProcessor
bans them, then temperature, top-k and top-p (keeping at least one token), then a multinomial draw
(the global torch RNG: `torch.manual_seed` makes it repeatable); top_k=1 is greedy argmax, so its
tokens equal transformers' greedy decoding. On-device picking takes the model's sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from nxdi.shell.causal_lm import NeuronBaseForCausalLM

Pick = Callable[[Any, Tensor], tuple[Tensor, Tensor | None]]
"""(the step's output, every token so far [B, N]) -> (next tokens [B, 1], their probabilities [B, V] or None)."""


def filter_top_k_top_p(scores: Tensor, *, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """The candidates left after top-k then top-p, best first: (scores [B, k], vocabulary ids [B, k]).

    top_k <= 0 keeps the whole vocabulary; top-p keeps the smallest prefix whose probability
    reaches top_p, and at least one token (dropped candidates get -inf)."""
    k = scores.shape[-1] if top_k <= 0 else min(top_k, scores.shape[-1])
    values, indices = torch.topk(scores, k, dim=-1)  # [B, k], sorted
    if top_p < 1.0:
        probs = torch.softmax(values.float(), dim=-1)
        before = probs.cumsum(-1) - probs  # probability mass ahead of each candidate
        values = values.masked_fill(before >= top_p, -float("inf"))
    return values, indices


def host_pick(*, top_k: int, top_p: float, temperature: float, no_repeat_ngram_size: int | None) -> Pick:
    """Pick tokens on the host from the step's last-position logits (see the module docstring)."""
    ban = NoRepeatNGramLogitsProcessor(no_repeat_ngram_size) if no_repeat_ngram_size else None

    def pick(out: Any, history: Tensor) -> tuple[Tensor, Tensor]:
        scores = out.logits[:, -1].float()  # [B, V]
        if ban is not None:
            scores = ban(history, scores)
        if temperature != 1.0:
            scores = scores / temperature
        if top_k == 1:  # greedy: the first best token, as transformers' argmax picks it
            return scores.argmax(-1, keepdim=True), torch.softmax(scores, dim=-1)
        values, indices = filter_top_k_top_p(scores, top_k=top_k, top_p=top_p)
        probs = torch.softmax(values, dim=-1)
        return torch.gather(indices, 1, torch.multinomial(probs, 1)), probs

    return pick


def device_pick(out: Any, history: Tensor) -> tuple[Tensor, None]:
    """The tokens the model sampled on device (`on_device_generation`)."""
    return out.tokens.reshape(-1, 1).to(torch.long), None


def run(
    model: NeuronBaseForCausalLM,
    input_ids: Tensor,
    mask: Tensor,
    *,
    sequence_length: int,
    pick: Pick,
    eos_token_id: int | list[int] | None,
    streamer: Any = None,
    stopping_criteria_list: Any = None,
    step_kwargs: dict[str, Any] | None = None,
) -> Tensor:
    """Generate until `sequence_length` tokens per row (prompt included), every row at EOS, or the
    stopping criteria say stop. `input_ids` [B, W], `mask` [B, W] (1 for real tokens); returns
    [B, W + new]. `step_kwargs` go to every forward (seq_ids, sampling_params)."""
    extra = step_kwargs or {}
    batch, width = input_ids.shape
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long).reshape(-1)
    done = torch.zeros(batch, 1, dtype=torch.bool)
    tokens = [input_ids]
    head = min(width, model.spec.max_context_length)
    positions = mask[:, :head].to(torch.int64).sum(-1, keepdim=True)  # [B, 1] each row's next position
    model.reset()
    out = model.forward(input_ids[:, :head], attention_mask=mask[:, :head], **extra)
    for column in range(head, width):  # past the largest context bucket: the rest one token per step
        out = model.forward(input_ids[:, column : column + 1], position_ids=positions, **extra)
        positions = positions + 1
    for length in range(width, sequence_length):
        token, probs = pick(out, torch.cat(tokens, dim=-1))
        at_eos = torch.isin(token, eos)
        done = done | at_eos
        if eos.numel():  # rows already finished repeat EOS
            token = torch.where(done & ~at_eos, eos[0], token)
        tokens.append(token)
        if streamer is not None:
            streamer.put(torch.cat(tokens, dim=-1) if getattr(streamer, "response_with_prefix", False) else token)
        if length + 1 >= sequence_length or bool(done.all()):
            break
        if stopping_criteria_list is not None and stopping_criteria_list(input_ids, probs):
            break
        out = model.forward(token, position_ids=positions, **extra)
        positions = positions + 1
    if streamer is not None:
        streamer.end()
    return torch.cat(tokens, dim=-1)

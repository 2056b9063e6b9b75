"""generate() on a fused-speculation model: the loop that drives its fused steps.

`HuggingFaceGenerationAdapter(model).generate(...)` on a model with `enable_fused_speculation`
(no assistant_model: the draft is inside the model) runs `generate` here instead of one token per
step. Each call returns every row's accepted tokens (`nxdi.shell.fused_speculation` documents
`fused_outputs`); rows accept different counts and each continues from its own position.

- Greedy: each row's tokens are the target's greedy tokens, as without speculation.
- Sampling (temperature / top_k / top_p, as `sampling_params` rows; needs
  on_device_sampling_config with do_sample=True or dynamic=True): the program's speculative
  sampling keeps the target's distribution.
- Stops: max_new_tokens / max_length and eos_token_id (several ids allowed), per row; a row
  past its end is padded with pad_token_id. A finished row keeps being fed what its last step
  returned (so async_mode's predicted call still matches), or, at max_length, its last inputs.
- `adapter.speculation_stats` counts fused steps (`target_steps`), tokens emitted, draft tokens
  proposed (the most a step can accept per live row: k-1, with a token tree its depth, as Medusa's
  count) and accepted, as the draft-model path does (accepted / proposed is the acceptance rate).
Other logits processors, stopping criteria, a streamer and output scores are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdi.shell.exceptions import IncompatibleConfigError

_DEVICE_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
_STOPS = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})


def check_request(
    model: Any,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any,
) -> None:
    """Refuse what a fused loop cannot honour, listing all of it.

    Raises:
        IncompatibleConfigError: logits processors other than temperature / top_k / top_p,
            stopping criteria other than max length and EOS, a streamer, output scores or logits,
            or do_sample=True on a model that samples greedily on device.
    """
    problems = [type(p).__name__ for p in logits_processor if not isinstance(p, _DEVICE_WARPERS)]
    problems += [type(c).__name__ for c in stopping_criteria if type(c).__name__ not in _STOPS]
    if streamer is not None:
        problems.append("streamer")
    if generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    ):
        problems.append("output_scores/output_logits")
    ods = model.spec.on_device_sampling_config
    if generation_config.do_sample and not (ods.do_sample or ods.dynamic):
        problems.append("do_sample=True (on_device_sampling_config samples greedily: set do_sample or dynamic)")
    if problems:
        raise IncompatibleConfigError(
            f"generate() with fused speculation: {problems} are not supported; the fused program runs "
            "temperature / top_k / top_p, max_new_tokens / max_length and eos_token_id. Fix: drop them"
        )


def generate(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    params: Tensor,
    eos_token_ids: frozenset[int],
    pad_token_id: int,
) -> tuple[Tensor, dict[str, int]]:
    """Up to `max_new_tokens` new tokens per row [B, N] (rows past their end padded with
    `pad_token_id`) and the acceptance counts.

    Args:
        params: [B, 3] (top_k, top_p, temperature) per row (top_k 1 for greedy).

    Raises:
        IncompatibleConfigError: the prompts plus the new tokens need more than max_length positions.
    """
    spec = model.spec
    limit = spec.max_length
    lengths = attention_mask.to(torch.int64).sum(-1).clamp(max=model.context_capacity)
    longest = int(lengths.max())
    if longest + max_new_tokens - 1 > limit:
        raise IncompatibleConfigError(
            f"generate(): a {longest}-token prompt plus {max_new_tokens} new tokens needs "
            f"{longest + max_new_tokens - 1} positions, more than max_length={limit} (seq_len). Fix: raise "
            "seq_len, or lower max_new_tokens / max_length"
        )
    model.reset()
    fused = model.forward(input_ids, attention_mask=attention_mask, sampling_params=params).fused_outputs
    out = [[int(t)] for t in fused[0][:, 0]]
    ids, at = fused[1], fused[3]  # [B, 1] each
    stats = {"target_steps": 0, "emitted": len(out), "proposed": 0, "accepted": 0}
    while True:
        room = torch.tensor([_room(row, max_new_tokens, eos_token_ids) for row in out])
        live = room > 0
        if not bool(live.any()):
            break
        fused = model.forward(ids, position_ids=at, sampling_params=params).fused_outputs
        accepted, counts = fused[0], (fused[3] - at)[:, 0]
        stats["target_steps"] += 1
        stats["proposed"] += int(live.sum()) * (accepted.shape[1] - 1)  # [B, k] flat, [B, depth + 1] a tree
        stats["accepted"] += int((counts - 1)[live].sum())
        for row in live.nonzero()[:, 0].tolist():
            emitted = accepted[row, : min(int(counts[row]), int(room[row]))].tolist()
            stop = next((i for i, t in enumerate(emitted) if t in eos_token_ids), None)
            emitted = emitted if stop is None else emitted[: stop + 1]
            stats["emitted"] += len(emitted)
            out[row].extend(emitted)
        going = fused[3] < limit  # a row at max_length can take no further step: it stays
        ids, at = torch.where(going, fused[1], ids), torch.where(going, fused[3], at)
    return _padded(out, pad_token_id), stats


def _room(row: list[int], max_new: int, eos: frozenset[int]) -> int:
    """How many more tokens a row may emit: none after an EOS or at `max_new`."""
    return 0 if any(t in eos for t in row) else max_new - len(row)


def _padded(out: list[list[int]], pad: int) -> Tensor:
    width = max(len(r) for r in out)
    return torch.tensor([r + [pad] * (width - len(r)) for r in out], dtype=torch.int64)


def decode(
    adapter: Any,
    input_ids: Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any,
    model_kwargs: dict[str, Any],
) -> Tensor | GenerateDecoderOnlyOutput:
    """The adapter's decoding loop for a fused model (`_sample`, and `_assisted_decoding` without
    a separate draft): sequences [B, W + N], and `adapter.speculation_stats`."""
    model = adapter.neuron_model
    check_request(model, logits_processor, stopping_criteria, generation_config, streamer)
    batch, width = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    params = adapter._sampling_rows(generation_config, batch, model_kwargs.get("sampling_params"))
    eos = generation_config._eos_token_tensor
    pad = generation_config._pad_token_tensor
    new, adapter.speculation_stats = generate(
        model,
        input_ids,
        mask,
        max_new_tokens=generation_config.max_length - width,
        params=params,
        eos_token_ids=frozenset() if eos is None else frozenset(int(t) for t in eos.reshape(-1)),
        pad_token_id=0 if pad is None else int(pad),
    )
    sequences = torch.cat([input_ids, new], dim=-1)
    return GenerateDecoderOnlyOutput(sequences=sequences) if generation_config.return_dict_in_generate else sequences

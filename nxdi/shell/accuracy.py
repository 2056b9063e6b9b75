"""Accuracy against Hugging Face transformers on the same checkpoint (NxDI's utils/accuracy).

- `check_accuracy`: token matching. Both sides decode greedily; the golden side is transformers
  with left-padded prompts, the nxdi side gets the same prompts (it compacts any padding itself).
- `get_generate_outputs` (and `get_generate_outputs_from_token_ids`): generate from text prompts
  with a transformers model (`is_hf=True`, prompts padded left) or an nxdi model (padded right,
  through HuggingFaceGenerationAdapter; with `draft_model`, speculative decoding), returning
  generate()'s output and the decoded strings.
- `check_accuracy_logits`: logit matching with the REFERENCE §10 scheme (`nxdi.core.host.logit_validation`):
  per position, shift removed, max-scaled closeness on the expected top-k groups. Every step is fed
  the golden token (teacher forcing), which is what the reference's restart-after-divergence
  amounts to, without re-encoding a longer prompt; a flipped argmax beyond the near-tie tolerance
  fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdi.core.host import logit_validation as accuracy
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.exceptions import IncompatibleConfigError, LogitMatchingValidationError
from nxdi.shell.generation import HuggingFaceGenerationAdapter

TEST_PROMPT = "Hello, I am a language model, and I am here to help,"


@attrs.frozen(kw_only=True)
class LogitReport:
    """What check_accuracy_logits compared."""

    positions: tuple[tuple[int, accuracy.PositionResult], ...]
    """(batch row, result) for every checked position, in generation order."""
    restarts: int
    """Positions where the argmaxes differed (within the near-tie tolerance, or the check failed):
    the golden token was fed on, as the reference's restart from the golden tokens does."""

    @property
    def passed(self) -> bool:
        return all(r.passed for _, r in self.positions)

    def worst(self) -> dict[str, float]:
        """Largest scaled error per top-k group over all positions."""
        out: dict[str, float] = {}
        for _, r in self.positions:
            for k, v in r.max_error.items():
                out[k] = max(out.get(k, 0.0), v)
        return out


def _inputs(
    neuron_model: NeuronBaseForCausalLM, tokenizer: Any, prompt: str | None, inputs: Any
) -> tuple[Tensor, Tensor]:
    if inputs is not None:
        ids = torch.as_tensor(inputs["input_ids"] if isinstance(inputs, Mapping) else inputs)
        mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
        return ids, torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
    if tokenizer is None:
        raise ValueError("give `inputs` (input_ids and attention_mask) or a `tokenizer` to encode the prompt")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = neuron_model.spec.batch_size
    encoded = tokenizer([prompt or TEST_PROMPT] * batch, return_tensors="pt", padding=True)
    return encoded["input_ids"], encoded["attention_mask"]


def _golden(neuron_model: NeuronBaseForCausalLM, golden_model: Any) -> Any:
    if golden_model is not None:
        return golden_model
    model = neuron_model.load_hf_model(neuron_model.checkpoint_path)
    return model.float().eval()


def _strip(row: Tensor, pad: int | None) -> Tensor:
    return row if pad is None else row[row != pad]


def check_accuracy(
    neuron_model: NeuronBaseForCausalLM,
    tokenizer: Any = None,
    generation_config: GenerationConfig | None = None,
    expected_token_ids: Tensor | None = None,
    num_tokens_to_check: int | None = None,
    prompt: str | None = None,
    inputs: Any = None,
    golden_model: Any = None,
) -> Tensor:
    """Greedy tokens of `neuron_model` equal the golden tokens (transformers unless given).

    Returns the generated token ids. Raises AssertionError showing both sides on a mismatch.
    """
    ids, mask = _inputs(neuron_model, tokenizer, prompt, inputs)
    config = GenerationConfig(**(generation_config.to_dict() if generation_config else {}))
    config.do_sample = False
    if num_tokens_to_check is not None:
        config.max_new_tokens = num_tokens_to_check
    elif generation_config is None or generation_config.max_new_tokens is None:
        config.max_length = neuron_model.spec.max_length
    if config.pad_token_id is None:
        config.pad_token_id = neuron_model.model_spec.pad_token_id or 0
    with torch.inference_mode():
        if expected_token_ids is None:
            expected_token_ids = _golden(neuron_model, golden_model).generate(
                ids, attention_mask=mask, generation_config=config
            )
        actual = HuggingFaceGenerationAdapter(neuron_model).generate(ids, attention_mask=mask, generation_config=config)
    pad = config.pad_token_id
    for row, (e, a) in enumerate(zip(expected_token_ids, actual, strict=True)):
        e, a = _strip(e, pad), _strip(a, pad)
        if num_tokens_to_check is not None:
            e, a = e[: int(mask[row].sum()) + num_tokens_to_check], a[: int(mask[row].sum()) + num_tokens_to_check]
        if not torch.equal(e, a):
            raise AssertionError(f"token mismatch in row {row}:\n  expected {e.tolist()}\n  actual   {a.tolist()}")
    return actual


def _greedy_logits(model: Any, ids: Tensor, mask: Tensor, n: int, pad: int) -> tuple[Tensor, Tensor]:
    """(logits [n, B, V], tokens [B, n]) of n greedy steps of a transformers-style model."""
    config = GenerationConfig(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad,
    )
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    return torch.stack(out.logits).float(), out.sequences[:, ids.shape[1] :]


def _forced_logits(model: NeuronBaseForCausalLM, ids: Tensor, mask: Tensor, tokens: Tensor) -> Tensor:
    """Logits [n, B, V] of the prompt's next token and then of each step fed the golden `tokens` [B, n-1..n]."""
    model.reset()
    out = model.forward(ids, attention_mask=mask)
    logits = [out.logits[:, -1].float()]
    positions = mask.to(torch.int64).sum(-1, keepdim=True)
    for k in range(tokens.shape[1] - 1):
        out = model.forward(tokens[:, k : k + 1], position_ids=positions + k)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def check_accuracy_logits(
    neuron_model: NeuronBaseForCausalLM,
    tokenizer: Any = None,
    generation_config: GenerationConfig | None = None,
    prompt: str | None = None,
    expected_logits: Tensor | None = None,
    divergence_difference_tol: float = accuracy.DEFAULT_DIVERGENCE_TOL,
    tol_map: Mapping[int | None, tuple[float, float]] | None = None,
    num_tokens_to_check: int | None = None,
    inputs: Any = None,
    golden_model: Any = None,
) -> LogitReport:
    """Logits of `neuron_model` match the golden model's within `tol_map` (REFERENCE §10).

    Args:
        expected_logits: [N, B, V] golden logits (computed with transformers when None).
        tol_map: top-k -> (atol, rtol); None selects the default map.

    Raises:
        IncompatibleConfigError: on-device sampling without output_logits (no logits to compare).
        LogitMatchingValidationError: some position is out of tolerance; `.results` is the report.
    """
    spec = neuron_model.spec
    if spec.on_device_sampling_config is not None and not spec.output_logits:
        raise IncompatibleConfigError("check_accuracy_logits needs output_logits=True with on-device sampling")
    tol = dict(tol_map) if tol_map is not None else dict(accuracy.DEFAULT_TOL_MAP)
    ids, mask = _inputs(neuron_model, tokenizer, prompt, inputs)
    pad = neuron_model.model_spec.pad_token_id or 0
    prompt_len = int(mask.sum(-1).max())
    n = min(spec.max_length - prompt_len + 1, num_tokens_to_check or spec.max_length)
    with torch.inference_mode():
        if expected_logits is None:
            expected_logits, expected_tokens = _greedy_logits(_golden(neuron_model, golden_model), ids, mask, n, pad)
        else:
            expected_tokens = expected_logits.argmax(-1).T
        actual = _forced_logits(neuron_model, ids, mask, expected_tokens)
    checked = []
    for row in range(ids.shape[0]):
        # Every step is fed the golden token (teacher forcing), so each position is compared on the
        # golden prefix; a near-tie that flips the argmax is noted, not failed.
        checked.extend(
            (
                row,
                accuracy.compare_position(
                    i, expected_logits[i, row], actual[i, row], tol_map=tol, divergence_tol=divergence_difference_tol
                ),
            )
            for i in range(n)
        )
    restarts = sum(1 for _, r in checked if r.token_mismatch)
    report = LogitReport(positions=tuple(checked), restarts=restarts)
    if not report.passed:
        bad = [(row, r) for row, r in checked if not r.passed]
        lines = [f"row {row} position {r.index}: errors {r.max_error}, diverged={r.diverged}" for row, r in bad[:10]]
        raise LogitMatchingValidationError(
            f"logits out of tolerance at {len(bad)} of {len(checked)} positions:\n" + "\n".join(lines), report
        )
    return report


def get_generate_outputs_from_token_ids(
    model: Any,
    token_ids: Tensor | list[list[int]],
    tokenizer: Any,
    attention_mask: Tensor | None = None,
    is_hf: bool = False,
    draft_model: NeuronBaseForCausalLM | None = None,
    input_capture_hook: Any = None,
    input_start_offsets: Sequence[int] | None = None,
    **generate_kwargs: Any,
) -> tuple[Any, list[str]]:
    """`get_generate_outputs` from token ids: `token_ids` [B, W] with its `attention_mask`, or
    unpadded rows (a list of id lists, or a tensor without a mask) that `tokenizer.pad` pads, on the
    left for transformers and on the right for nxdi, masking pad ids. Returns and raises as
    `get_generate_outputs` does."""
    if input_capture_hook is not None:
        raise IncompatibleConfigError(
            "get_generate_outputs(input_capture_hook=...): capturing the model's inputs is not supported by nxdi; "
            "pass input_capture_hook=None"
        )
    kwargs = dict(generate_kwargs)
    if not is_hf:
        kwargs.update(_speculation_kwargs(model, draft_model, kwargs))
    if attention_mask is None:
        if tokenizer.pad_token is None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
        rows = token_ids.tolist() if isinstance(token_ids, Tensor) else [list(r) for r in token_ids]
        side = "left" if is_hf else "right"
        padded = tokenizer.pad({"input_ids": rows}, padding_side=side, return_attention_mask=True, return_tensors="pt")
        token_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
        attention_mask[token_ids == tokenizer.pad_token_id] = 0
    ids = torch.as_tensor(token_ids)
    mask = torch.as_tensor(attention_mask)
    if input_start_offsets:
        ids = _shift_right(ids, input_start_offsets, fill=tokenizer.pad_token_id or 0)
        mask = _shift_right(mask, input_start_offsets, fill=0)
    offsets = list(input_start_offsets) if input_start_offsets else None
    generator = model if is_hf else HuggingFaceGenerationAdapter(model, input_start_offsets=offsets)
    outputs = generator.generate(ids, attention_mask=mask, **kwargs)
    if not is_hf:
        model.reset()
        if draft_model is not None:
            draft_model.reset()
    sequences = outputs.sequences if isinstance(outputs, GenerateDecoderOnlyOutput) else outputs
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return outputs, list(texts)


def get_generate_outputs(
    model: Any,
    prompts: Sequence[str],
    tokenizer: Any,
    is_hf: bool = False,
    draft_model: NeuronBaseForCausalLM | None = None,
    generation_config: GenerationConfig | None = None,
    device: str = "neuron",
    input_capture_hook: Any = None,
    input_start_offsets: Sequence[int] | None = None,
    **generate_kwargs: Any,
) -> tuple[Any, list[str]]:
    """Generate from text `prompts` (one per batch row) and decode the result (NxDI's utility).

    Args:
        model: a transformers causal LM (`is_hf=True`) or a loaded nxdi causal LM, driven through
            `HuggingFaceGenerationAdapter`.
        tokenizer: encodes the prompts (padded left for transformers, right for nxdi; a missing
            pad token becomes the EOS token, as NxDI does) and decodes the outputs.
        draft_model: a loaded nxdi draft for speculative decoding on `model` (compiled with
            speculation_length, trace_tokengen_model=False if it decodes only so). Decoding is
            greedy unless `do_sample` is passed explicitly (NxDI always decodes greedily here;
            nxdi also samples speculatively). With fused speculation and no draft, generate()
            gets `prompt_lookup_num_tokens=speculation_length`, as NxDI passes it.
        generation_config: passed to generate() (None: the model's own).
        device: accepted for NxDI compatibility ("neuron" or "cpu"); the model runs on the backend
            it was loaded with.
        input_capture_hook: must be None (nxdi does not capture inputs).
        input_start_offsets: shift each row's prompt right by its offset (one value: every row),
            padding before it, as NxDI does.
        generate_kwargs: passed to generate() (`max_length`, `max_new_tokens`, ...); they win over
            `generation_config`, as in transformers.

    Returns:
        (outputs, output_tokens): what generate() returned (token ids [B, W+N], prompts included,
        or a GenerateDecoderOnlyOutput with return_dict_in_generate=True), and each row's text
        decoded with special tokens skipped (prompt included). An nxdi model (and its draft) is
        reset afterwards.

    Raises:
        IncompatibleConfigError: an input_capture_hook; a draft that cannot run with `model`
            (see `HuggingFaceGenerationAdapter.generate`).
        ValueError: `device` is neither "neuron" nor "cpu".
    """
    if device not in ("neuron", "cpu"):
        raise ValueError(f"get_generate_outputs(device={device!r}): expected 'neuron' or 'cpu'")
    if tokenizer.pad_token is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    side = "left" if is_hf else "right"
    inputs = tokenizer(list(prompts), padding=True, padding_side=side, return_tensors="pt")
    return get_generate_outputs_from_token_ids(
        model,
        inputs["input_ids"],
        tokenizer,
        attention_mask=inputs["attention_mask"],
        is_hf=is_hf,
        draft_model=draft_model,
        input_capture_hook=input_capture_hook,
        input_start_offsets=input_start_offsets,
        **({} if generation_config is None else {"generation_config": generation_config}),
        **generate_kwargs,
    )


def _speculation_kwargs(model: Any, draft: NeuronBaseForCausalLM | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """generate() kwargs that select NxDI's speculation for `model`: the draft's adapter as
    `assistant_model` (greedy unless `do_sample` is given), or prompt lookup for fused speculation."""
    spec = model.spec
    if draft is not None:
        return {"assistant_model": HuggingFaceGenerationAdapter(draft), "do_sample": given.get("do_sample", False)}
    if spec.enable_fused_speculation:
        extra: dict[str, Any] = {"prompt_lookup_num_tokens": spec.speculation_length}
        if not spec.enable_eagle_speculation:
            extra["do_sample"] = given.get("do_sample", False)
        return extra
    return {}


def _shift_right(t: Tensor, offsets: Sequence[int], *, fill: int) -> Tensor:
    """[B, W] -> [B, W + max(offsets)]: row b moved right by offsets[b] (one offset: every row)."""
    b, w = t.shape
    per_row = list(offsets) * b if len(offsets) == 1 else list(offsets)
    if len(per_row) != b:
        raise IncompatibleConfigError(
            f"input_start_offsets has {len(offsets)} values for {b} prompts: give one, or one per prompt"
        )
    out = torch.full((b, w + max(per_row)), fill, dtype=t.dtype)
    for row, offset in enumerate(per_row):
        out[row, offset : offset + w] = t[row]
    return out

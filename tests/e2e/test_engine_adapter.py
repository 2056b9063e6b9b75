"""HuggingFaceGenerationAdapter with transformers' generation features: stopping criteria (EOS and
custom), streamers, max_new_tokens / max_length, and logits processors (REFERENCE §8, §15)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from tests.support.engine_fixtures import PAD, PROMPTS, hf_generate, nxdi_generate, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eos_stops_rows_and_pads_them_as_transformers_does(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    free = hf_greedy("llama", PROMPTS)
    eos = int(free[0, 4])  # row 0 stops at its 5th token; the other rows may or may not meet it
    model = loaded_model("llama", batch_size=4)
    ours = nxdi_generate(model, PROMPTS, eos_token_id=eos)
    theirs = hf_generate(tiny_model("llama"), PROMPTS, max_new_tokens=32, eos_token_id=eos)
    assert torch.equal(ours, theirs)
    alone = nxdi_generate(model, [PROMPTS[0]], eos_token_id=eos)
    assert alone.shape[1] == 5 and int(alone[0, -1]) == eos  # stops as soon as every row is done
    assert torch.equal(alone, hf_generate(tiny_model("llama"), [PROMPTS[0]], max_new_tokens=32, eos_token_id=eos))


class _StopAfter(StoppingCriteria):
    """Stop a row once `token` has been generated."""

    def __init__(self, token: int, prompt_width: int) -> None:
        self.token, self.width = token, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return (input_ids[:, self.width :] == self.token).any(-1)  # type: ignore[return-value]


def test_custom_stopping_criteria_are_honoured(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    prompt = [PROMPTS[2]]
    stop = int(hf_greedy("llama", prompt)[0, 6])
    width = len(prompt[0])
    criteria = StoppingCriteriaList([_StopAfter(stop, width)])
    ours = nxdi_generate(loaded_model("llama", batch_size=1), prompt, stopping_criteria=criteria)
    theirs = hf_generate(tiny_model("llama"), prompt, max_new_tokens=32, stopping_criteria=criteria)
    assert torch.equal(ours, theirs) and int(ours[0, -1]) == stop and ours.shape[1] <= 7


class _Collector:
    """A TextStreamer-like object: records every put() and end()."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(value.tolist())

    def end(self) -> None:
        self.calls.append("end")


def test_streamers_receive_the_prompt_then_each_token_then_end(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    ours, theirs = _Collector(), _Collector()
    out = nxdi_generate(loaded_model("llama", batch_size=1), [PROMPTS[0]], max_new_tokens=6, streamer=ours)
    hf_generate(tiny_model("llama"), [PROMPTS[0]], max_new_tokens=6, streamer=theirs)
    assert ours.calls == theirs.calls
    assert ours.calls[0] == [list(PROMPTS[0])] and ours.calls[-1] == "end"
    assert [c[0] for c in ours.calls[1:-1]] == out[0].tolist()


@pytest.mark.parametrize("limit", [{"max_new_tokens": 5}, {"max_length": 17}, {"max_new_tokens": 1}])
def test_max_new_tokens_and_max_length(limit: dict[str, int], loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=4)
    full = nxdi_generate(model, PROMPTS, max_new_tokens=12)
    ids, mask = padded(PROMPTS, "right")  # width 14: max_length 17 leaves 3 new tokens
    out = HuggingFaceGenerationAdapter(model).generate(
        ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, eos_token_id=None, **limit
    )
    n = limit.get("max_new_tokens", limit.get("max_length", 0) - ids.shape[1])
    assert out.shape == (4, ids.shape[1] + n)
    assert torch.equal(out[:, ids.shape[1] :], full[:, :n])


def test_logits_processors_run_on_the_host(loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]) -> None:
    """repetition_penalty (not an on-device sampler setting) matches transformers without on-device
    sampling, and with on-device sampling when output_logits lets the host apply it.

    Left padding here: transformers exempts leading pad columns from the penalty but, assuming left
    padding, penalizes the pad id in right-padded rows (it warns about right padding); the host
    processors see the caller's own layout, so only the left-padded layouts are comparable."""
    theirs = hf_generate(tiny_model("llama"), PROMPTS, max_new_tokens=16, repetition_penalty=1.5)
    settings = dict(side="left", max_new_tokens=16, repetition_penalty=1.5)
    assert torch.equal(nxdi_generate(loaded_model("llama", batch_size=4), PROMPTS, **settings), theirs)
    ods = loaded_model("llama", batch_size=4, output_logits=True, on_device_sampling_config={"top_k": 1})
    assert torch.equal(nxdi_generate(ods, PROMPTS, **settings), theirs)
    assert not torch.equal(theirs, hf_generate(tiny_model("llama"), PROMPTS, max_new_tokens=16))


def test_logits_processors_the_device_cannot_run_are_refused_not_ignored(loaded_model: Callable[..., Any]) -> None:
    ods = loaded_model("llama", batch_size=4, on_device_sampling_config={"top_k": 1})
    with pytest.raises(IncompatibleConfigError, match=r"RepetitionPenaltyLogitsProcessor.*output_logits=True") as e:
        nxdi_generate(ods, PROMPTS, max_new_tokens=4, repetition_penalty=1.5)
    assert "dynamic" not in str(e.value) and "do_sample" not in str(e.value)  # fixes that would not help
    with pytest.raises(IncompatibleConfigError, match=r"do_sample=True.*greedily on device") as greedy:
        nxdi_generate(ods, PROMPTS, max_new_tokens=4, do_sample=True, top_k=5)
    assert "dynamic=True" in str(greedy.value)  # device sampling is a fix for sampling itself


def test_the_ngram_filter_refusal_offers_only_fixes_that_work(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """Under on-device sampling `no_repeat_ngram_size` is refused; the fix it names (output_logits=True)
    then gives transformers' tokens, and it names no device-sampling setting (which would raise again)."""
    ods = loaded_model("llama", batch_size=4, on_device_sampling_config={"top_k": 1})
    with pytest.raises(IncompatibleConfigError, match=r"NoRepeatNGramLogitsProcessor.*output_logits=True") as err:
        nxdi_generate(ods, PROMPTS, max_new_tokens=4, no_repeat_ngram_size=2)
    assert "dynamic" not in str(err.value) and "do_sample" not in str(err.value)
    fixed = loaded_model("llama", batch_size=4, output_logits=True, on_device_sampling_config={"top_k": 1})
    settings = dict(side="left", max_new_tokens=16, no_repeat_ngram_size=2)
    theirs = hf_generate(tiny_model("llama"), PROMPTS, max_new_tokens=16, no_repeat_ngram_size=2)
    assert torch.equal(nxdi_generate(fixed, PROMPTS, **settings), theirs)

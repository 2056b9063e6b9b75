"""On-device sampling through the model: greedy, top-k / top-p / temperature per row, seeds.

Membership checks use the logits the same step returned (output_logits=True), so they test the
sampler inside the program, not a re-implementation. Top-p follows the Hugging Face rule (REFERENCE
§15): the smallest set of tokens whose probability reaches p, crossing token included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nxdi.shell.causal_lm import prepare_sampling_params
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from tests.support.engine_fixtures import PAD, PROMPTS, nxdi_generate, padded, runtime_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLING = dict(batch_size=4, output_logits=True, on_device_sampling_config={"do_sample": True, "top_k": 8})
DYNAMIC = dict(batch_size=4, output_logits=True, on_device_sampling_config={"dynamic": True, "top_k": 8})


def _sample_run(model: Any, **kwargs: Any) -> Any:
    ids, mask = padded(PROMPTS, "right")
    settings = {"max_new_tokens": 24, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    out = HuggingFaceGenerationAdapter(model).generate(
        ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **settings
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)  # [B, N], [B, N, V]


@pytest.mark.parametrize("config", [SAMPLING, DYNAMIC], ids=["do_sample", "dynamic"])
def test_top_k_1_sampling_equals_greedy(
    config: dict[str, Any], loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **config)
    ours = nxdi_generate(model, PROMPTS, do_sample=True, top_k=1)
    assert torch.equal(ours, hf_greedy("llama", PROMPTS))
    assert torch.equal(nxdi_generate(model, PROMPTS, do_sample=False), ours)  # greedy rows: top_k 1
    greedy_device = loaded_model("llama", batch_size=4, on_device_sampling_config={"top_k": 1})
    assert torch.equal(nxdi_generate(greedy_device, PROMPTS), ours)


@pytest.mark.parametrize("top_k", [2, 5])
def test_sampled_tokens_lie_in_the_top_k_of_their_step(top_k: int, loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", **SAMPLING)
    runtime_of(model).set_seed(top_k)
    tokens, logits = _sample_run(model, do_sample=True, top_k=top_k, temperature=1.5)
    allowed = logits.topk(top_k, dim=-1).indices  # [B, N, k]
    assert bool((allowed == tokens[..., None]).any(-1).all()), "a token outside the top-k was sampled"
    below_first = (tokens != logits.argmax(-1)).sum()
    assert below_first >= 10, "sampling should often pick other than the argmax at temperature 1.5"


def test_global_topk_limits_the_candidates(loaded_model: Callable[..., Any]) -> None:
    """top_k 0 means the whole vocabulary, yet only global_topk candidates are ever drawn."""
    model = loaded_model(
        "llama", batch_size=4, output_logits=True, on_device_sampling_config={"do_sample": True, "global_topk": 3}
    )
    runtime_of(model).set_seed(0)
    tokens, logits = _sample_run(model, sampling_params=prepare_sampling_params(4, top_k=[0], temperature=[3.0]))
    assert bool((logits.topk(3, dim=-1).indices == tokens[..., None]).any(-1).all())
    assert len(set(tokens.flatten().tolist())) > 4


def _hf_top_p_set(logits: torch.Tensor, *, top_k: int, top_p: float, temperature: float) -> tuple[set[int], Any]:
    """transformers' warpers applied to one row [V]: the surviving tokens and their probabilities."""
    x = TemperatureLogitsWarper(temperature)(None, logits[None].clone())  # type: ignore[arg-type]
    if top_k > 0:  # 0: no top-k limit (transformers' warper refuses 0)
        x = TopKLogitsWarper(top_k)(None, x)  # type: ignore[arg-type]
    x = TopPLogitsWarper(top_p)(None, x)[0]  # type: ignore[arg-type]
    probs = torch.softmax(x, dim=-1)
    return {int(t) for t in (probs > 0).nonzero().flatten()}, probs


def test_top_p_keeps_the_smallest_set_reaching_p_crossing_token_included(loaded_model: Callable[..., Any]) -> None:
    """p is put halfway through the second token's mass: Hugging Face keeps {1st, 2nd} (the
    reference drops the crossing 2nd token). 256 draws must stay in the set, include the 2nd
    token, and follow the renormalised probabilities."""
    model = loaded_model("llama", **DYNAMIC)
    runtime_of(model).set_seed(11)
    prompt = torch.tensor([list(PROMPTS[0])] * 4)
    temperature = 2.0
    model.reset()
    logits = model.forward(prompt).logits[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1).sort(descending=True).values
    top_p = float(probs[0] + probs[1] / 2)
    keep, expected = _hf_top_p_set(logits, top_k=0, top_p=top_p, temperature=temperature)
    assert len(keep) == 2
    params = prepare_sampling_params(4, top_k=[0], top_p=[top_p], temperature=[temperature])
    draws = torch.cat([model.forward(prompt, sampling_params=params).tokens for _ in range(64)])
    assert set(draws.tolist()) == keep
    for token in keep:
        frequency = float((draws == token).float().mean())
        assert abs(frequency - float(expected[token])) < 0.1, (token, frequency, float(expected[token]))


def test_dynamic_sampling_takes_per_row_sampling_params(loaded_model: Callable[..., Any]) -> None:
    """Row 0 greedy by top_k 1, row 1 greedy by temperature 0, rows 2-3 sampling top-3 / top-p."""
    model = loaded_model("llama", **DYNAMIC)
    runtime_of(model).set_seed(5)
    params = torch.tensor([[1, 1.0, 1.0], [8, 1.0, 0.0], [3, 1.0, 2.0], [0, 0.6, 1.5]])
    tokens, logits = _sample_run(model, sampling_params=params)
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[:2], greedy[:2])
    assert bool((logits[2].topk(3, dim=-1).indices == tokens[2, :, None]).any(-1).all())
    assert not torch.equal(tokens[2], greedy[2])
    for step in range(tokens.shape[1]):
        keep, _ = _hf_top_p_set(logits[3, step], top_k=0, top_p=0.6, temperature=1.5)
        assert int(tokens[3, step]) in keep
    assert not torch.equal(tokens[3], greedy[3])


def test_generation_config_sampling_settings_reach_the_device_sampler(loaded_model: Callable[..., Any]) -> None:
    """generate(top_k=k) with do_sample on: per-row params come from the generation config."""
    model = loaded_model("llama", **DYNAMIC)
    runtime_of(model).set_seed(1)
    tokens, logits = _sample_run(model, do_sample=True, top_k=3, temperature=2.0)
    assert bool((logits.topk(3, dim=-1).indices == tokens[..., None]).any(-1).all())
    assert not torch.equal(tokens, logits.argmax(-1))


def test_a_fixed_seed_reproduces(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", **SAMPLING)
    runtime_of(model).set_seed(1234)
    first, _ = _sample_run(model, do_sample=True, top_k=8, temperature=2.0)
    second, _ = _sample_run(model, do_sample=True, top_k=8, temperature=2.0)
    assert not torch.equal(first, second), "the random stream moves on between runs"
    runtime_of(model).set_seed(1234)
    again, _ = _sample_run(model, do_sample=True, top_k=8, temperature=2.0)
    assert torch.equal(first, again)
    # two freshly loaded models start from the same default seed
    a, b = (loaded_model("llama", fresh=True, **SAMPLING) for _ in range(2))
    assert torch.equal(
        _sample_run(a, do_sample=True, top_k=8, temperature=2.0)[0],
        _sample_run(b, do_sample=True, top_k=8, temperature=2.0)[0],
    )


def test_deterministic_sampling_needs_no_seed(loaded_model: Callable[..., Any]) -> None:
    config = dict(batch_size=4, on_device_sampling_config={"do_sample": True, "deterministic": True})
    model = loaded_model("llama", **config)
    first = nxdi_generate(model, PROMPTS, do_sample=True, top_k=8, temperature=2.0)
    runtime_of(model).set_seed(99)
    assert torch.equal(nxdi_generate(model, PROMPTS, do_sample=True, top_k=8, temperature=2.0), first)


def test_host_sampling_without_on_device_sampling_follows_the_torch_seed(loaded_model: Callable[..., Any]) -> None:
    """No on-device sampling: transformers' warpers and multinomial run on the host (any top_k)."""
    model = loaded_model("llama", batch_size=4)
    torch.manual_seed(7)
    first = nxdi_generate(model, PROMPTS, do_sample=True, top_k=500, temperature=1.5)
    torch.manual_seed(7)
    assert torch.equal(nxdi_generate(model, PROMPTS, do_sample=True, top_k=500, temperature=1.5), first)

"""Every family with a transformers-neuronx class, through that API, against transformers.

For each family the guide names a `*ForSampling` class of (Llama, Mistral, Mixtral, GPT-2, OPT,
BLOOM, GPT-J, GPT-NeoX): `NeuronAutoModelForCausalLM.from_pretrained` picks the family's class,
`sample(top_k=1)` gives transformers' greedy tokens at batch 1 and at a left-padded batch 4 of
uneven prompts (`start_ids` = each row's padding), and `HuggingFaceGenerationModelAdapter(config,
model).generate(output_logits=True)` gives transformers' fp32 logits within 1e-4 of the largest at
every step. (The NxDI API's side of the same checks: `test_classic_families.py`, `test_families.py`.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from nxdi.core import families
from nxdi.shell.tnx import HuggingFaceGenerationModelAdapter, NeuronAutoModelForCausalLM
from tests.support.engine_fixtures import PROMPTS, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = [r.name for r in families.runnable() if r.classes.tnx]
NEW = 10


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Iterator[tuple[str, Any]]:
    """(family, its model after to_neuron(): batch 4, n_positions 64, fp32)."""
    name = request.param
    model = NeuronAutoModelForCausalLM.from_pretrained(str(tiny_checkpoint(name)), batch_size=4, n_positions=64)
    assert type(model).__name__ == families.record_for(name).unwrap().classes.tnx[0]
    model.to_neuron()
    yield name, model
    model.nxdi_model.close()


def _hf(tiny_model: Callable[[str], Any], name: str, prompts: tuple[tuple[int, ...], ...]) -> Any:
    """transformers' greedy generation on the left-padded prompts: finished rows repeat EOS, as
    transformers-neuronx's sample() does (EOS as the padding token)."""
    hf = tiny_model(name)
    ids, mask = padded(prompts, "left")
    eos = hf.config.eos_token_id
    with torch.no_grad():
        return hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize("batch", [1, 4])
def test_sample_gives_transformers_greedy_tokens(
    family: tuple[str, Any], tiny_model: Callable[[str], Any], batch: int
) -> None:
    name, model = family
    prompts = PROMPTS[:batch]
    ids, mask = padded(prompts, "left")
    pads = (1 - mask).sum(-1)
    out = model.sample(ids, ids.shape[1] + NEW, top_k=1, start_ids=pads)
    torch.testing.assert_close(out, _hf(tiny_model, name, prompts).sequences, rtol=0, atol=0)


def test_generate_logits_equal_transformers(
    family: tuple[str, Any], tiny_model: Callable[[str], Any], tiny_checkpoint: Callable[..., Path]
) -> None:
    name, model = family
    ids, mask = padded(PROMPTS, "left")
    want = _hf(tiny_model, name, PROMPTS)
    adapter = HuggingFaceGenerationModelAdapter(AutoConfig.from_pretrained(tiny_checkpoint(name)), model)
    eos = tiny_model(name).config.eos_token_id
    got = adapter.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(got.sequences, want.sequences)
    for step, (ours, theirs) in enumerate(zip(got.logits, want.logits, strict=True)):
        err = (ours - theirs).abs().max().item()
        assert err <= 1e-4 * theirs.abs().max().item(), (step, err)

"""A serving client's whole model life cycle, through NxDI's module paths (the compat package).

As vLLM's Neuron plugin does it: NeuronConfig kwargs from its scheduler settings, the class from
`MODEL_TYPES`, config through the class hooks, a compiled folder named by the config's hash that
is first tried with `Cls(folder).load(folder)` (a miss must be FileNotFoundError or ValueError),
then compile + load, requests served in cache slots by `forward()` with the `[B, 3]`
sampling_params, and the tokens read from `output.hidden_states`.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import nxdi
from nxdi.core import families
from nxdi.core.families.record import FamilyRecord
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import empty_cache
from nxdi.shell.exceptions import ArtifactIntegrityError
from tests.support.engine_fixtures import PROMPTS
from tests.support.serving_client import apply_overrides, client_defaults

NEW_TOKENS = 6
SLOTS = len(PROMPTS)
RUNNABLE = families.runnable()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings without effect on the CPU warn; not the point here
        yield


def serve(model: Any, prompts: Sequence[Sequence[int]], prepare: Callable[..., Tensor]) -> Tensor:
    """Each prompt prefilled alone into its slot, then every slot decoded together (slots in shuffled
    order), greedy through on-device sampling; the new tokens [B, NEW_TOKENS] in prompt order."""
    params = prepare(batch_size=SLOTS, top_k=[1] * SLOTS, top_p=[1.0] * SLOTS, temperature=[1.0] * SLOTS)
    model.reset()
    out = torch.zeros(len(prompts), NEW_TOKENS, dtype=torch.long)
    for slot, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)])
        step = model(
            ids,
            attention_mask=None,
            seq_ids=torch.tensor([slot]),
            position_ids=torch.arange(len(prompt))[None],
            sampling_params=params[:1],
        )
        out[slot, 0] = step.hidden_states.reshape(-1)[0]
    order = torch.tensor([2, 0, 3, 1])
    for k in range(1, NEW_TOKENS):
        positions = torch.tensor([[len(prompts[s]) + k - 1] for s in order.tolist()])
        step = model(
            out[order, k - 1 : k], attention_mask=None, seq_ids=order, position_ids=positions, sampling_params=params
        )
        out[order, k] = step.hidden_states.reshape(-1)
    return out


def test_client_life_cycle_through_nxdi_module_paths(
    compat_package: Path, tiny_checkpoint: Callable[..., Path], hf_greedy: Callable[..., Tensor], tmp_path: Path
) -> None:
    from neuronx_distributed_inference.modules.generation.sampling import (
        prepare_sampling_params,
        validate_sampling_params,
    )
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    path = tiny_checkpoint("llama")
    cls = MODEL_TYPES["llama"]["causal-lm"]
    kwargs = apply_overrides(client_defaults(max_num_seqs=SLOTS), {"skip_warmup": False})
    config = cls.get_config_cls()(cls.get_neuron_config_cls()(**kwargs), load_config=load_pretrained_config(path))
    folder = tmp_path / hashlib.md5(config.to_json_string().encode("utf-8")).hexdigest()
    with pytest.raises((FileNotFoundError, ValueError)):  # nothing compiled yet: the client compiles
        cls(folder).load(folder)
    model = cls(path, config)
    model.compile(folder)
    model.load(folder)
    expected = hf_greedy("llama", PROMPTS, NEW_TOKENS)
    validate_sampling_params(prepare_sampling_params(SLOTS), model.config.neuron_config.on_device_sampling_config)
    assert torch.equal(serve(model, PROMPTS, prepare_sampling_params), expected)

    # A restart finds the compiled folder; settings assigned before load() are honoured and checked.
    again = cls(folder)
    assert again.config.transformers_version == config.transformers_version
    again.config.neuron_config.skip_warmup = True
    again.load(folder)
    assert torch.equal(serve(again, PROMPTS, prepare_sampling_params), expected)
    changed = cls(folder)
    changed.config.neuron_config.seq_len = 32  # changes the compiled graphs
    with pytest.raises(ArtifactIntegrityError, match="different configuration"):
        changed.load(folder)


@pytest.mark.parametrize("record", RUNNABLE, ids=[r.name for r in RUNNABLE])
def test_inner_model_runs_the_family_program(
    record: FamilyRecord, tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    assert record.classes is not None and record.classes.causal_lm is not None
    cls = getattr(nxdi, record.classes.causal_lm)
    path = tiny_checkpoint(record.name)
    neuron_config = cls.get_neuron_config_cls()(torch_dtype="float32", seq_len=32)
    config = cls.get_config_cls()(neuron_config, load_config=nxdi.load_pretrained_config(path))
    inner = cls._model_cls(config)
    weights = inner.weights(cls.get_state_dict(path, config))
    ids = torch.tensor([list(PROMPTS[0])])
    n = ids.shape[1]
    inputs = StepInputs(input_ids=ids, position_ids=torch.arange(n)[None], last_index=torch.tensor([n - 1]))
    cache = empty_cache(inner.model_spec, batch=1, length=32, dtype=torch.float32)
    logits, _ = inner.forward(weights, cache, inputs, all_logits=True)
    with torch.no_grad():
        expected = tiny_model(record.name)(ids).logits.float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

"""The decoder program traces with torch.export, with weights bound as parameters (not baked-in constants)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nxdi.core import families
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import catalog, inputs, kv_cache
from nxdi.effects import weight_loader as weight_io
from nxdi.testing.strategies.decoders import plan_of, program_of


class BoundStep(torch.nn.Module):
    """The program with its weights registered once as parameters (tied tensors registered once)."""

    def __init__(self, program: catalog.Program, tensors: dict[str, torch.Tensor], spec: ModelSpec) -> None:
        super().__init__()
        self.program, self.spec = program, spec
        self.params = torch.nn.ParameterDict()
        self.slots: dict[str, str] = {}
        seen: dict[int, str] = {}
        for name, t in tensors.items():
            slot = seen.setdefault(id(t), name.replace(".", "__"))
            if slot == name.replace(".", "__"):
                self.params[slot] = torch.nn.Parameter(t, requires_grad=False)
            self.slots[name] = slot

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, *cache: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        w = self.program.weights({n: self.params[s] for n, s in self.slots.items()}, spec=self.spec)
        x = inputs.StepInputs(input_ids=ids, position_ids=pos, last_index=last)
        logits, new = self.program.forward(w, kv_cache.KVCache.from_tensors(cache), x, spec=self.spec)
        return (logits, *new.to_tensors())


@pytest.mark.parametrize("variant", ["llama3-tied", "qwen3", "gpt2", "opt-post-ln", "bloom", "gptj", "gpt_neox"])
@pytest.mark.parametrize("phase", ["token", "context"])
def test_steps_export_and_match_eager(variant: str, phase: str, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(variant)
    spec = families.parse_model_spec(json.loads((path / "config.json").read_text())).unwrap()
    tensors = weight_io.get_state_dict(path, plan_of(spec)).unwrap()
    step = BoundStep(program_of(spec), tensors, spec)
    cache = kv_cache.empty_cache(spec, batch=2, length=32, dtype=torch.float32)
    if phase == "context":
        x = inputs.prompt_inputs([[5, 6, 7], [8]], length=16)
        cache = cache.prefix(16)
    else:
        x = inputs.token_inputs(torch.tensor([3, 4]), torch.tensor([7, 12]))
    args = (*x.to_tensors(), *cache.to_tensors())
    ep = torch.export.export(step, args, strict=False)
    unique = {id(t) for t in tensors.values()}
    assert len(ep.graph_signature.parameters) == len(unique), "every weight is a parameter, tied ones once"
    weight_shapes = {tuple(t.shape) for t in tensors.values() if t.dim() == 2}
    assert not [c for c in ep.constants.values() if isinstance(c, torch.Tensor) and tuple(c.shape) in weight_shapes]
    got, want = ep.module()(*args), step(*args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

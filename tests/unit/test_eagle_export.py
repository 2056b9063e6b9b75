"""The EAGLE draft program traces: `torch.export` captures a context-encoding step, a one-token step
and a whole drafting round (`propose`) with static shapes, and the exported graphs give the eager
results for other values of the same shapes (nothing in them depends on the values)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import eagle, kv_cache
from nxdi.core.programs.inputs import StepInputs
from nxdi.testing import checkpoints
from nxdi.testing.strategies.decoders import program_of
from tests.support import eagle_loop

LAYOUT = EagleDraft(input_norm=True, fc_bias=True)


def _draft() -> tuple[ModelSpec, eagle.EagleWeights]:
    spec = families.parse_model_spec(checkpoints.tiny_config("llama", num_hidden_layers=1).to_dict()).unwrap()
    table = program_of(spec).table
    plan = weights.weight_plan_for(table, spec, eagle_draft=LAYOUT).unwrap()
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) * 0.2 for k, s in plan.source_shapes().items()}
    tensors = weight_ops.convert(plan, state).unwrap()
    return spec, eagle.weights_from_slots(LAYOUT.table(table).slots(tensors, spec), spec=spec)


class _Step(torch.nn.Module):
    def __init__(self, spec: ModelSpec, w: eagle.EagleWeights) -> None:
        super().__init__()
        self.spec, self.w = spec, w

    def forward(self, ids: Tensor, pos: Tensor, last: Tensor, prev: Tensor, *cache: Tensor) -> Any:
        x = StepInputs(input_ids=ids, position_ids=pos, last_index=last)
        logits, own, new = eagle.forward(self.w, kv_cache.KVCache.from_tensors(cache), x, prev, spec=self.spec)
        return logits, own, *new.to_tensors()


class _Propose(torch.nn.Module):
    def __init__(self, spec: ModelSpec, w: eagle.EagleWeights) -> None:
        super().__init__()
        self.spec, self.w = spec, w

    def forward(self, logits: Tensor, hidden: Tensor, position: Tensor, *cache: Tensor) -> Any:
        kv = kv_cache.KVCache.from_tensors(cache)
        tokens, new = eagle_loop.propose(self.w, kv, logits, hidden, position, steps=3, spec=self.spec)
        return tokens, *new.to_tensors()


def _step_inputs(spec: ModelSpec, s: int, seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b = 2
    start = torch.randint(0, 4, (b, 1), generator=g) if s == 1 else torch.zeros(b, 1, dtype=torch.int64)
    last = torch.randint(0, s, (b,), generator=g)
    cache = kv_cache.empty_cache(spec, batch=b, length=16, dtype=torch.float32)
    filled = [torch.randn(t.shape, generator=g) for t in cache.to_tensors()]
    return (
        torch.randint(0, spec.vocab_size, (b, s), generator=g),
        start + torch.arange(s),
        last,
        torch.randn(b, s, spec.hidden_size, generator=g),
        *filled,
    )


@pytest.mark.parametrize("s", [8, 1], ids=["context", "token"])
def test_a_draft_step_exports_with_static_shapes(s: int) -> None:
    spec, w = _draft()
    module = _Step(spec, w)
    ep = torch.export.export(module, _step_inputs(spec, s, 0), strict=False)
    for seed in range(1, 4):
        x = _step_inputs(spec, s, seed)
        for got, want in zip(ep.module()(*x), module(*x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_drafting_round_exports_with_static_shapes() -> None:
    spec, w = _draft()
    module = _Propose(spec, w)

    def inputs(seed: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        cache = kv_cache.empty_cache(spec, batch=2, length=16, dtype=torch.float32)
        return (
            torch.randn(2, spec.vocab_size, generator=g),
            torch.randn(2, spec.hidden_size, generator=g),
            torch.randint(0, 8, (2,), generator=g),
            *(torch.randn(t.shape, generator=g) for t in cache.to_tensors()),
        )

    ep = torch.export.export(module, inputs(0), strict=False)
    for seed in range(1, 4):
        x = inputs(seed)
        for got, want in zip(ep.module()(*x), module(*x), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

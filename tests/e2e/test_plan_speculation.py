"""The planner's figures for speculating models equal what the engine allocates.

For a tiny fused model (an ordinary draft), an EAGLE model (an EAGLE draft and the hidden-state
cache) and a Medusa model, built the documented way and run eagerly (to_cpu()), `plan.plan_for`
(what `nxdi plan` prints) must give, byte for byte: the target's weights and KV cache (with fused
speculation its k slack slots per row), the draft's weights and KV cache, EAGLE's hidden-state
cache, the Medusa heads, and exactly the programs the engine holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import nxdi
from nxdi.core.planning import plan, speculation_memory
from nxdi.effects import engine, fused_engine
from nxdi.testing import medusa as testing_medusa
from tests.support.engine_fixtures import runtime_of
from tests.support.fused_models import K, eagle_config, fused_config, speculating_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LM = nxdi.NeuronLlamaForCausalLM


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cache(model: Any) -> tuple[torch.Tensor, ...]:
    return tuple(runtime_of(model).cache.to_tensors())


def _programs(model: Any) -> list[Any]:
    return sorted(runtime_of(model).programs)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny llama target, a one-layer draft, and an EAGLE draft of the target."""
    return speculating_checkpoints(tmp_path_factory.mktemp("plan-speculation"), medusa_heads=3)


@pytest.mark.parametrize("kind", ["fused", "eagle"])
def test_a_fused_plan_counts_what_the_engine_allocates(kind: str, pair: tuple[Path, Path, Path]) -> None:
    target, draft, eagle = pair
    make = fused_config if kind == "fused" else eagle_config
    model = LM(target, make(target, draft if kind == "fused" else eagle, batch_size=2, kv_cache_padding_size=1))
    model.to_cpu()
    fused = model._fused
    fc_bias = bool(getattr(fused.draft_config, "fc_bias", False))
    counted = speculation_memory.Draft(model=fused.draft_model, spec=fused.draft_spec, fc_bias=fc_bias)
    planned = plan.plan_for(model.model_spec, model.spec, draft=counted).unwrap()
    m = planned.memory

    em, source = fused.engine_model(), fused.source(str(target))
    tensors = fused_engine.read_weights(em, source).unwrap()
    names = em.weight_names(source)
    assert m.weights_bytes_per_core == _bytes(tensors[n] for n in names if n.startswith("target_model."))
    assert m.draft_weights_bytes_per_core == _bytes(tensors[n] for n in names if n.startswith("draft_model."))

    cache = _cache(model)
    lt, ld = 2 * model.model_spec.num_layers, 2 * fused.draft_model.num_layers
    assert cache[0].shape[2] == model.spec.max_length + K  # the k slack slots, planned too
    assert m.kv_cache_bytes_per_core == planned.kv_cache.bytes_per_rank == _bytes(cache[:lt])
    assert m.draft_kv_cache_bytes_per_core == _bytes(cache[lt : lt + ld])
    assert m.hidden_cache_bytes_per_core == _bytes(cache[lt + ld :])
    assert (m.hidden_cache_bytes_per_core > 0) == (kind == "eagle")
    assert _programs(model) == list(planned.programs)
    assert not any(speculation_memory.NOT_COUNTED in w for w in planned.warnings)

    uncounted = plan.plan_for(model.model_spec, model.spec).unwrap()
    assert speculation_memory.NOT_COUNTED in uncounted.warnings
    assert uncounted.memory.draft_weights_bytes_per_core == uncounted.memory.draft_kv_cache_bytes_per_core == 0


def test_a_medusa_plan_counts_the_heads_and_the_tree_programs(pair: tuple[Path, Path, Path]) -> None:
    target, _, _ = pair
    tree = [list(p) for p in testing_medusa.DEFAULT_TREE if len(p) <= 3]
    config = fused_config(target, target, batch_size=2)  # only for its NeuronConfig class and HF config
    cls = type(config.neuron_config)
    settings = {"torch_dtype": "float32", "seq_len": 64, "batch_size": 2, "is_medusa": True}
    medusa = {"num_medusa_heads": 3, "medusa_speculation_length": len(tree) + 1, "medusa_tree": tree}
    neuron_config = cls(**settings, **medusa, token_generation_buckets=[32, 64], context_encoding_buckets=[16, 64])
    model = LM(target, type(config)(neuron_config, load_config=_hf_config(target)))
    model.to_cpu()
    planned = plan.plan_for(model.model_spec, model.spec).unwrap()
    em, source = model._engine_model(), model._source(str(target))
    heads = engine.read_heads(em, source).unwrap()
    assert planned.memory.medusa_heads_bytes_per_core == _bytes(heads.values()) > 0
    assert planned.memory.kv_cache_bytes_per_core == _bytes(_cache(model))
    own = engine.read_weights(em, source).unwrap()
    names = [n for n in em.weight_names(source.plan) if n not in heads]
    assert planned.memory.weights_bytes_per_core == _bytes(own[n] for n in names)
    assert _programs(model) == list(planned.programs)
    assert any(k.phase.value == "speculation" and k.tokens == len(tree) + 1 for k in planned.programs)  # tree steps


def test_trace_tokengen_model_false_plans_no_token_generation_programs(pair: tuple[Path, Path, Path]) -> None:
    target, _, _ = pair
    config = fused_config(target, target, batch_size=1)
    cls = type(config.neuron_config)
    neuron_config = cls(
        torch_dtype="float32", seq_len=64, batch_size=1, speculation_length=3, trace_tokengen_model=False
    )
    model = LM(target, type(config)(neuron_config, load_config=_hf_config(target)))
    model.to_cpu()
    planned = plan.plan_for(model.model_spec, model.spec).unwrap()
    assert _programs(model) == list(planned.programs)
    assert {k.phase.value for k in planned.programs} == {"context_encoding", "speculation"}
    assert any("trace_tokengen_model=False" in w for w in planned.warnings)


def _hf_config(path: Path) -> Any:
    from nxdi.shell.inference_config import load_pretrained_config

    return load_pretrained_config(path)

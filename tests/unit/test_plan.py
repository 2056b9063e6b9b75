"""plan_for: one frozen Plan with the `nxdi plan --json` keys, problems instead of exceptions, and speed."""

from __future__ import annotations

import json
from typing import Any

from returns.result import Failure

from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.planning import plan
from nxdi.core.platform import Platform
from tests.support.planner_configs import LLAMA_3_8B, LLAMA_31_70B, LLAMA_31_405B, PLAN_JSON_KEYS, spec

KEYS = PLAN_JSON_KEYS


def _spec(platform: Platform = Platform.TRN1, **kwargs: Any) -> NeuronSpec:
    return parse_neuron_spec(kwargs, platform=platform).unwrap().spec


def test_plan_json_has_the_documented_keys() -> None:
    neuron = _spec(tp_degree=32, batch_size=4, seq_len=2048, enable_bucketing=True)
    p = plan.plan_for(spec(LLAMA_3_8B), neuron, instance="trn1.32xlarge").unwrap()
    doc = json.loads(json.dumps(p.to_dict()))
    for section, keys in KEYS.items():
        assert keys <= set(doc[section]), section
    assert doc["problems"] == [] and doc["platform"] == "trn1"
    assert doc["buckets"]["context_encoding"] == [128, 256, 512, 1024, 2048]
    assert doc["sharding"]["strategy"] == "replicate_to_tp_degree"
    assert (doc["sharding"]["q_heads_per_rank"], doc["sharding"]["kv_heads_per_rank"]) == (1, 1)
    assert doc["kv_cache"]["shape_per_rank"] == [4, 1, 2048, 128] and doc["kv_cache"]["bytes_per_rank"] == 128 << 20
    assert doc["memory"]["fits"] is True and doc["memory"]["min_tp_degree"] == 2  # batch 4 does not fit one 16 GiB core
    assert doc["lora"] == {"max_adapters": None}


def test_problems_are_reported_not_raised() -> None:
    neuron = _spec(
        tp_degree=4,
        seq_len=256,
        sequence_parallel_enabled=True,
        enable_bucketing=True,
        context_encoding_buckets=[90, 256],
    )
    p = plan.plan_for(spec(LLAMA_31_70B), neuron, instance="trn1.32xlarge").unwrap()
    fields = [x.field for x in p.problems]
    assert fields.count("tp_degree") == 2  # 4 is not a trn1 degree, and 70B does not fit 4 cores
    assert "sequence_parallel_enabled" in fields  # 90 is not divisible by 4
    assert p.memory.min_tp_degree == 16 and not p.memory.fits
    assert any("use tp_degree=16" in x.fix for x in p.problems)


def test_unplannable_parts_fail_with_every_problem() -> None:
    neuron = _spec(tp_degree=4, flash_decoding_enabled=True, lora_config={"target_modules": ["q_proj", "mlp"]})
    result = plan.plan_for(spec(LLAMA_3_8B), neuron)
    assert isinstance(result, Failure)
    assert {"flash_decoding_enabled", "target_modules"} <= result.failure().fields()


def test_speculation_table_and_lora_capacity() -> None:
    neuron = _spec(
        tp_degree=32,
        batch_size=1,
        seq_len=1024,
        enable_bucketing=True,
        speculation_length=4,
        lora_config={"max_loras": 8, "max_lora_rank": 16},
    )
    p = plan.plan_for(spec(LLAMA_3_8B), neuron, platform=Platform.TRN1).unwrap()
    assert p.speculation is not None and p.speculation.extra_tokens == 4
    assert p.lora is not None and p.lora.requested == 8 and p.lora.max_adapters > 8
    assert p.memory.lora_bytes_per_core == 8 * p.lora.bytes_per_core
    seeded = plan.plan_for(
        spec(LLAMA_3_8B),
        neuron,
        lora_request=plan.LoraRequest(adapter_bytes=170 * 10**6, reserved_bytes_per_core=2 * 10**9),
    ).unwrap()
    assert seeded.to_dict()["lora"]["max_adapters"] == 376


def test_planning_405b_on_trn2() -> None:
    """The planner's speed on this case is measured by `nxdi bench plan` (target: median < 50 ms), not here."""
    model = spec(LLAMA_31_405B)
    neuron = _spec(
        Platform.TRN2,
        tp_degree=64,
        batch_size=4,
        seq_len=16384,
        max_context_length=8192,
        enable_bucketing=True,
        lora_config={"max_loras": 4},
    )
    p = plan.plan_for(model, neuron, instance="trn2.48xlarge").unwrap()
    assert p.sharding.counts.q_padded == 128 and p.kv_cache.shape_per_rank == (4, 1, 16384, 128)


def test_lnc_mismatch_is_a_warning() -> None:
    trn1_spec = _spec(tp_degree=32)  # parsed for trn1: LNC 1
    p = plan.plan_for(spec(LLAMA_3_8B), trn1_spec, instance="trn2.48xlarge").unwrap()
    assert p.platform is Platform.TRN2 and p.memory.hbm_per_core_bytes == 12 << 30
    assert any("default LNC=2" in w for w in p.warnings)
    trn2_spec = _spec(Platform.TRN2, tp_degree=32)
    p2 = plan.plan_for(spec(LLAMA_3_8B), trn2_spec, instance="trn2.48xlarge").unwrap()
    assert p2.warnings == () and p2.memory.hbm_per_core_bytes == 24 << 30


def test_medusa_heads_and_eagle_hidden_states_are_counted_per_core() -> None:
    """Medusa: every head's ResBlock [E, E] + [E] and projection [V, E] in the dtype, whole on every
    core; EAGLE: the hidden-state cache layer [rows, max_length + k, E] and the k slack slots."""
    model = spec(LLAMA_3_8B)
    e, v = model.hidden_size, model.vocab_size
    tree = [[0], [0, 0], [1], [0, 0, 0]]
    medusa = _spec(
        tp_degree=8, seq_len=1024, is_medusa=True, num_medusa_heads=3, medusa_speculation_length=5, medusa_tree=tree
    )
    plain = plan.plan_for(model, _spec(tp_degree=8, seq_len=1024)).unwrap().memory
    m = plan.plan_for(model, medusa).unwrap().memory
    assert m.medusa_heads_bytes_per_core == 3 * (e * e + e + v * e) * 2
    assert m.per_core_bytes == plain.per_core_bytes + m.medusa_heads_bytes_per_core
    eagle = _spec(tp_degree=8, seq_len=1024, batch_size=2, speculation_length=4, enable_eagle_speculation=True)
    p = plan.plan_for(model, eagle).unwrap()
    assert p.memory.hidden_cache_bytes_per_core == 2 * (1024 + 4) * e * 2
    assert p.kv_cache.shape_per_rank[2] == 1024 + 4 and p.memory.kv_cache_bytes_per_core == p.kv_cache.bytes_per_rank
    assert p.speculation is not None and p.speculation.kind.value == "fused_speculation"

"""KV layout and memory against the worked examples of REFERENCE §6 and the seeds.

Seeds: nxdi-feature-guide.rst "Tensor-parallelism support" (Llama-3.1-8B about 16 GB and Llama-3.1-70B
about 148 GB at batch 1 in bfloat16, 70B on 16 trn1 cores) and transformers-neuronx-developer-guide.rst
(opt-13b ~29 GB and opt-30b ~66 GB in float16, gpt2-xl ~4 GB in bfloat16, batch 1). GB is 10**9 bytes.
The seeds give no sequence length; the models' own context (2048 for OPT, 1024 for GPT-2) and 2048 for
Llama are used.
"""

from __future__ import annotations

from typing import Any

import pytest

from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import gqa, kv_layout, memory
from nxdi.core.platform import Platform
from tests.support.planner_configs import GPT2_XL, LLAMA_3_8B, LLAMA_31_8B, LLAMA_31_70B, OPT_13B, OPT_30B, spec

GB = 10**9
MIB = 1 << 20


def test_llama_3_8b_kv_cache_worked_example() -> None:
    model = spec(LLAMA_3_8B)
    neuron = parse_neuron_spec({"tp_degree": 32, "batch_size": 4, "seq_len": 2048}).unwrap().spec
    layout = kv_layout.kv_layout_for(model, neuron).unwrap()
    assert layout.shape_per_rank == (4, 1, 2048, 128) and layout.dtype == "bfloat16"
    assert layout.layer_bytes_per_rank == 4 * MIB
    assert layout.bytes_per_rank == 128 * MIB


def test_kv_cache_variants() -> None:
    model = spec(LLAMA_3_8B)
    kwargs: dict[str, Any] = {"tp_degree": 32, "batch_size": 4, "seq_len": 2048}
    fp8 = kv_layout.kv_layout_for(model, parse_neuron_spec({**kwargs, "kv_cache_quant": True}).unwrap().spec)
    assert fp8.unwrap().dtype == "float8_e4m3fn" and fp8.unwrap().bytes_per_rank == 64 * MIB
    garbage = parse_neuron_spec({**kwargs, "is_continuous_batching": True, "kv_cache_padding_size": 1})
    assert kv_layout.kv_layout_for(model, garbage.unwrap().spec).unwrap().shape_per_rank == (5, 1, 2048, 128)
    fd = parse_neuron_spec({**kwargs, "flash_decoding_enabled": True}).unwrap().spec
    layout = kv_layout.kv_layout_for(model, fd).unwrap()
    assert layout.flash_decoding_group == 4 and layout.shape_per_rank == (4, 1, 2048 // 4 + 128, 128)
    assert kv_layout.cache_positions(1000, flash_decoding_group=3) == 334 + 128
    assert kv_layout.cache_positions(8192, sliding_window=4096) == 4096


def _total(config: dict[str, Any], tp: int, dtype: str, length: int) -> memory.MemoryPlan:
    req = memory.MemoryRequest(tp_degree=tp, torch_dtype=dtype, max_context_length=length, max_length=length)
    return memory.memory_plan(spec(config), req).unwrap()


@pytest.mark.parametrize(
    ("config", "tp", "dtype", "length", "seed_gb", "tolerance"),
    [
        (LLAMA_31_8B, 1, "bfloat16", 2048, 16, 0.10),
        (LLAMA_31_70B, 16, "bfloat16", 2048, 148, 0.10),
        (OPT_13B, 2, "float16", 2048, 29, 0.25),
        (OPT_30B, 8, "float16", 2048, 66, 0.25),
        (GPT2_XL, 1, "bfloat16", 1024, 4, 0.25),
    ],
)
def test_seed_memory_examples(
    config: dict[str, Any], tp: int, dtype: str, length: int, seed_gb: float, tolerance: float
) -> None:
    plan = _total(config, tp, dtype, length)
    assert abs(plan.total_bytes - seed_gb * GB) <= tolerance * seed_gb * GB, plan.total_bytes / GB


def test_seed_verdicts_on_trn1() -> None:
    """70B 'can run on 16 NeuronCores on one trn1.32xlarge'; 8B and opt-13b fit a trn1.2xlarge (2 cores)."""
    assert _total(LLAMA_31_70B, 16, "bfloat16", 2048).min_tp_degree == 16
    for config, dtype in ((LLAMA_31_8B, "bfloat16"), (OPT_13B, "float16")):
        req = memory.MemoryRequest(tp_degree=2, torch_dtype=dtype, max_length=2048, instance="trn1.2xlarge")
        plan = memory.memory_plan(spec(config), req).unwrap()
        assert plan.fits and plan.min_tp_degree is not None and plan.min_tp_degree <= 2
    assert _total(OPT_30B, 8, "float16", 2048).min_tp_degree == 8  # "run on 8 NeuronCores"


def test_mha_conversion_can_cost_more_kv_per_core_than_fewer_ranks() -> None:
    """Phi-3-medium-like heads (40 Q, 10 KV): tp=4 forces CONVERT_TO_MHA, so each rank caches 10 KV heads, not 5."""
    model = ModelSpec(
        model_type="llama",
        hidden_size=5120,
        num_attention_heads=40,
        num_kv_heads=10,
        head_dim=128,
        num_layers=40,
        vocab_size=32064,
        intermediate_size=17920,
        max_position_embeddings=4096,
    )
    assert gqa.determine_strategy(4, 10)[0] is gqa.GQAStrategy.CONVERT_TO_MHA
    per_core = {
        tp: memory.memory_plan(model, memory.MemoryRequest(tp_degree=tp, max_length=4096)).unwrap() for tp in (2, 4)
    }
    assert per_core[4].kv_cache_bytes_per_core == 2 * per_core[2].kv_cache_bytes_per_core


def test_int8_weights_and_trn2_hbm() -> None:
    model = spec(LLAMA_31_70B)
    bf16 = memory.memory_plan(model, memory.MemoryRequest(tp_degree=32, platform=Platform.TRN2)).unwrap()
    int8 = memory.memory_plan(
        model, memory.MemoryRequest(tp_degree=32, platform=Platform.TRN2, weight_quant_dtype="int8")
    ).unwrap()
    assert bf16.hbm_per_core_bytes == 24 * (1 << 30)
    assert 0.5 < int8.weights_bytes_per_core / bf16.weights_bytes_per_core < 0.6  # embeddings and lm_head stay bf16

"""Properties of the memory planner: monotone in batch and length, non-increasing in tp, honest verdicts."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.host.quant.weights import QuantScheme, QuantType, scale_shape_for
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import memory, sharding
from nxdi.core.platform import Platform
from nxdi.testing.strategies.plans import small_model_specs


@st.composite
def requests(draw: st.DrawFn) -> memory.MemoryRequest:
    batch = draw(st.integers(1, 8))
    length = draw(st.integers(1, 4096))
    return memory.MemoryRequest(
        tp_degree=draw(st.sampled_from([1, 2, 4, 8])),
        batch_size=batch,
        kv_cache_batch_size=batch,
        kv_cache_padding_size=draw(st.integers(0, 1)),
        max_context_length=draw(st.integers(1, length)),
        max_length=length,
        torch_dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        kv_cache_quant=draw(st.booleans()),
        weight_quant_dtype=draw(st.sampled_from([None, "int8"])),
        per_channel_scales=draw(st.booleans()),
        fused_qkv=draw(st.booleans()),
        vocab_parallel=draw(st.booleans()),
        platform=draw(st.sampled_from(list(Platform))),
    )


def _per_core(model: ModelSpec, req: memory.MemoryRequest) -> int:
    return memory.memory_plan(model, req).unwrap().per_core_bytes


@given(small_model_specs(), requests(), st.integers(1, 4))
def test_memory_grows_with_batch(model: ModelSpec, req: memory.MemoryRequest, more: int) -> None:
    bigger = attrs.evolve(req, batch_size=req.batch_size + more, kv_cache_batch_size=req.kv_cache_batch_size + more)
    assert _per_core(model, bigger) >= _per_core(model, req)


@given(small_model_specs(), requests(), st.integers(1, 2048), st.integers(0, 2048))
def test_memory_grows_with_sequence_length(model: ModelSpec, req: memory.MemoryRequest, more: int, ctx: int) -> None:
    longer = attrs.evolve(
        req,
        max_length=req.max_length + more,
        max_context_length=min(req.max_context_length + ctx, req.max_length + more),
    )
    assert _per_core(model, longer) >= _per_core(model, req)


def _no_mha_conversion(model: ModelSpec, tp: int) -> bool:
    """KV heads split or replicate evenly (REPLICATE_TO_TP_DEGREE applies, or nothing needs converting)."""
    q, kv = model.num_attention_heads, model.num_kv_heads
    return q == kv or kv % tp == 0 or tp % kv == 0


@given(small_model_specs(), requests(), st.sampled_from([1, 2, 3, 4, 8, 16, 24, 32]), st.sampled_from([2, 3, 4, 8, 16]))
def test_memory_per_core_does_not_grow_with_tp(model: ModelSpec, req: memory.MemoryRequest, tp: int, k: int) -> None:
    """More ranks never cost more per core, unless the larger tp forces CONVERT_TO_MHA (see the unit tests)."""
    small, large = tp, tp * k
    assume(_no_mha_conversion(model, small) and _no_mha_conversion(model, large))
    at_small = _per_core(model, attrs.evolve(req, tp_degree=small))
    assert _per_core(model, attrs.evolve(req, tp_degree=large)) <= at_small


@given(small_model_specs(), requests(), st.sampled_from([1, 64, 4096, 1 << 16, 1 << 20]))
def test_verdict_and_min_tp_are_consistent(model: ModelSpec, req: memory.MemoryRequest, scale: int) -> None:
    # tiny specs fit anywhere; scaling the batch up makes some plans fit only at larger tp and some never
    req = attrs.evolve(req, batch_size=req.batch_size * scale, kv_cache_batch_size=req.kv_cache_batch_size * scale)
    plan = memory.memory_plan(model, req).unwrap()
    assert plan.fits == (plan.per_core_bytes <= plan.hbm_per_core_bytes)
    assert plan.total_bytes == plan.per_core_bytes * req.tp_degree
    degrees = sharding.valid_tp_degrees(req.platform, req.lnc)
    fitting = [t for t in degrees if memory.memory_plan(model, attrs.evolve(req, tp_degree=t)).unwrap().fits]
    assert plan.min_tp_degree == (fitting[0] if fitting else None)


def test_quantized_weights_count_lm_head_and_honour_modules_to_not_convert() -> None:
    """int8 linears (lm_head included, as quantized=True stores it) take a byte per value plus a
    float32 scale per row; a linear modules_to_not_convert keeps stays in the dtype, per layer."""
    model = ModelSpec(
        model_type="llama", hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
        num_layers=2, vocab_size=10, intermediate_size=16, max_position_embeddings=64,
    )  # fmt: skip
    plan = sharding.shard_plan(model, tp=1, fused_qkv=True).unwrap()
    base = memory.MemoryRequest(tp_degree=1, torch_dtype="bfloat16", weight_quant_dtype="int8", per_channel_scales=True)

    def weights(*skip: str) -> int:
        return memory.weight_bytes_per_core(plan, attrs.evolve(base, quant_skip=skip))

    lm_head = 10 * 8  # vocab x hidden
    assert weights("lm_head") - weights() == 2 * lm_head - (lm_head + 10 * 4)
    up = 16 * 8  # one layer's up_proj
    assert weights("layers.0.mlp.up_proj") - weights() == 2 * up - (up + 16 * 4)


TINY_LLAMA = ModelSpec(
    model_type="llama", hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
    num_layers=2, vocab_size=16, intermediate_size=16, max_position_embeddings=64,
)  # fmt: skip
"""The blockwise tests' model: small enough to count every linear's scale grid by hand."""


@pytest.mark.parametrize(("axes", "sizes"), [((1,), (4,)), ((0, 1), (2, 4)), ((-2,), (8,))])
@pytest.mark.parametrize(("scale_dtype", "scale_bytes"), [("f32", 4), ("bf16", 2)])
def test_blockwise_scales_count_the_stored_block_grid(
    axes: tuple[int, ...], sizes: tuple[int, ...], scale_dtype: str, scale_bytes: int
) -> None:
    """Blockwise weights carry the scale grid the quantizer stores (`scale_shape_for`), not one scale
    per row, in `quantization_scale_dtype`: the planner's bytes are the values plus that grid, for
    every linear."""
    model = TINY_LLAMA
    plan = sharding.shard_plan(model, tp=1, fused_qkv=True).unwrap()
    spec = NeuronSpec(  # type: ignore[call-arg]
        tp_degree=1, quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="int8",
        quantization_block_axis=list(axes), quantization_block_size=list(sizes), quantization_scale_dtype=scale_dtype,
    )  # fmt: skip
    req = memory.memory_request_for(model, spec).unwrap()
    scheme = QuantScheme(type=QuantType.BLOCKWISE_SYMMETRIC, block_axis=axes, block_size=sizes)
    expected = 0
    for w in plan.weights:
        copies = model.num_layers if w.per_layer else 1
        if memory._is_linear(w):
            grid = scale_shape_for(scheme, w.rank_shape()).unwrap()
            expected += copies * (w.rank_numel() + math.prod(grid) * scale_bytes)
        else:
            expected += copies * w.rank_numel() * 2  # bf16
    assert req.scale_block is not None
    assert memory.weight_bytes_per_core(plan, req) == expected


@pytest.mark.parametrize(
    ("axes", "sizes", "block"),
    [((1, 0), (64,), (1, 64)), ((1,), (64, 8), (1, 64)), ((2,), (64,), (1, 1)), ((), (), (1, 1))],
)
def test_blockwise_settings_the_engine_refuses_still_plan(
    axes: tuple[int, ...], sizes: tuple[int, ...], block: tuple[int, int]
) -> None:
    """`nxdi plan` plans a Neuron config the CPU engine would refuse (`cpu_support`): block axes
    without a size, sizes without an axis or an axis no linear weight has are left out of the
    block, not a crash."""
    spec = NeuronSpec(  # type: ignore[call-arg]
        tp_degree=1, quantized=True, quantization_type="blockwise_symmetric", quantization_dtype="int8",
        quantization_block_axis=list(axes), quantization_block_size=list(sizes),
    )  # fmt: skip
    assert memory.memory_request_for(TINY_LLAMA, spec).unwrap().scale_block == block

"""Properties of nxdi.core.host.quant.weights: round-trip error bounds, scale shapes, refusals."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success
from torch import Tensor

from nxdi.core.host.quant import weights
from nxdi.core.host.quant.weights import QuantDtype, QuantScheme, QuantType, parse_quant_scheme
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs.linear import QuantizedWeight, dequantize
from nxdi.core.weight_plan import WeightQuant, scale_name
from nxdi.testing.strategies.decoders import dense_specs, program_of

DIVISORS = [1, 2, 4, 8, 16]


@st.composite
def weights_2d(draw: st.DrawFn) -> torch.Tensor:
    rows, cols = draw(st.sampled_from(DIVISORS)) * 2, draw(st.sampled_from(DIVISORS)) * 2
    seed = draw(st.integers(0, 2**16))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * magnitude
    if draw(st.booleans()):
        w[0] = 0.0  # an all-zero row: per-channel and row blocks must not divide by zero
    return w


@st.composite
def schemes_for(draw: st.DrawFn, shape: tuple[int, int], dtype: QuantDtype) -> QuantScheme:
    qtype = draw(st.sampled_from(QuantType))
    if qtype is not QuantType.BLOCKWISE_SYMMETRIC:
        return QuantScheme(type=qtype, dtype=dtype)
    axes = draw(st.sampled_from([(0,), (1,), (0, 1), (-1,)]))
    sizes = tuple(draw(st.sampled_from([d for d in DIVISORS if shape[a] % d == 0])) for a in axes)
    return QuantScheme(type=qtype, dtype=dtype, block_axis=axes, block_size=sizes)


def _ok(w: torch.Tensor, s: QuantScheme) -> weights.QuantizedTensor:
    result = weights.quantize(w, s)
    assert isinstance(result, Success), result
    return result.unwrap()


@settings(deadline=None)
@given(data=st.data(), w=weights_2d())
def test_int8_round_trip_within_half_a_scale(data: st.DataObject, w: torch.Tensor) -> None:
    s = data.draw(schemes_for(tuple(w.shape), QuantDtype.INT8))
    q = _ok(w, s)
    err = (weights.dequantize(q, s) - w).abs()
    scale = weights.scale_per_element(q)
    # Round to nearest: |x - round(x)| <= 1/2 in quantized units; the slack covers float32 rounding.
    assert torch.all(err <= scale * (0.5 + 1e-4))


@settings(deadline=None)
@given(data=st.data(), w=weights_2d(), dtype=st.sampled_from([QuantDtype.F8E4M3, QuantDtype.F8E5M2]))
def test_fp8_round_trip_within_derived_bound(data: st.DataObject, w: torch.Tensor, dtype: QuantDtype) -> None:
    s = data.draw(schemes_for(tuple(w.shape), dtype))
    q = _ok(w, s)
    err = (weights.dequantize(q, s) - w).abs()
    assert torch.all(err <= weights.fp8_error_bound(w, weights.scale_per_element(q), dtype))


@settings(deadline=None)
@given(data=st.data(), w=weights_2d(), dtype=st.sampled_from(QuantDtype))
def test_scale_shape_and_values_range(data: st.DataObject, w: torch.Tensor, dtype: QuantDtype) -> None:
    s = data.draw(schemes_for(tuple(w.shape), dtype))
    q = _ok(w, s)
    assert weights.scale_shape_for(s, w.shape) == Success(tuple(q.scale.shape))
    assert q.values.shape == w.shape and q.values.dtype == dtype.torch_dtype
    assert torch.all(q.scale > 0) and torch.all(torch.isfinite(q.scale))
    assert q.values.float().abs().max() <= max(128.0, s.divisor)
    # The largest element reaches the top of the range (the scale is tight), unless the scale floor
    # (fp8: 1e-5, as NxD) lifted the scale: then max|w| < divisor * 1e-5 maps below the top.
    if s.type is QuantType.PER_TENSOR_SYMMETRIC and w.abs().max() / s.divisor > 1e-5:
        assert q.values.float().abs().max() >= s.divisor - 1


@settings(deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    size=st.integers(2, 9),
    axis=st.sampled_from([0, 1]),
)
def test_non_dividing_block_refused(rows: int, cols: int, size: int, axis: int) -> None:
    s = QuantScheme(type=QuantType.BLOCKWISE_SYMMETRIC, dtype=QuantDtype.F8E4M3, block_axis=(axis,), block_size=(size,))
    result = weights.quantize(torch.ones(rows, cols), s, name="w.up_proj.weight")
    if (rows, cols)[axis] % size == 0:
        assert isinstance(result, Success)
    else:
        assert isinstance(result, Failure)
        assert [p.field for p in result.failure().problems] == ["w.up_proj.weight"]


@settings(deadline=None)
@given(data=st.data(), w=weights_2d(), dtype=st.sampled_from(QuantDtype))
def test_zero_tensor_is_exact(data: st.DataObject, w: torch.Tensor, dtype: QuantDtype) -> None:
    s = data.draw(schemes_for(tuple(w.shape), dtype))
    z = torch.zeros_like(w)
    assert torch.equal(weights.dequantize(_ok(z, s), s), z)


@settings(deadline=None)
@given(data=st.data(), w=weights_2d(), dtype=st.sampled_from(QuantDtype))
def test_quantize_is_idempotent_on_dequantized(data: st.DataObject, w: torch.Tensor, dtype: QuantDtype) -> None:
    s = data.draw(schemes_for(tuple(w.shape), dtype))
    once = weights.dequantize(_ok(w, s), s)
    twice = weights.dequantize(_ok(once, s), s)
    torch.testing.assert_close(twice, once, rtol=0.07, atol=1e-6)


# --- quantized weight plans: what a program (and each tensor-parallel rank) gets ------------------


@st.composite
def classic_specs(draw: st.DrawFn, family: str) -> ModelSpec:
    """The tiny spec of `family` (GPT-2's Conv1D [in, out] weights, BLOOM's and GPT-NeoX's fused QKV
    stored head by head, GPT-J's reordered rotary rows) with 2 to 8 heads and drawn sizes."""
    from nxdi.core import families
    from nxdi.testing import checkpoints

    spec = families.parse_model_spec(checkpoints.tiny_config(family).to_dict()).unwrap()
    heads = draw(st.sampled_from([2, 4, 8]))
    return attrs.evolve(
        spec,
        num_attention_heads=heads,
        num_kv_heads=heads,
        hidden_size=heads * spec.head_dim,
        num_layers=draw(st.integers(1, 2)),
        vocab_size=draw(st.integers(8, 48)),
        intermediate_size=draw(st.integers(4, 40)),
        tie_word_embeddings=draw(st.booleans()),
    )


QTYPES = st.sampled_from(["per_tensor_symmetric", "per_channel_symmetric"])


@given(spec=dense_specs(), tp=st.integers(1, 4), qtype=QTYPES, seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_quantized_rank_weights_dequantize_to_the_rank_slice_of_the_float_weights(
    spec: ModelSpec, tp: int, qtype: str, seed: int
) -> None:
    _check_rank_weights(spec, tp, qtype, seed)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bloom", "gptj", "gpt_neox"])
@given(data=st.data(), tp=st.integers(1, 4), qtype=QTYPES, seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None)
def test_other_stored_layouts_quantize_to_the_rank_slice_of_the_float_weights(
    family: str, data: st.DataObject, tp: int, qtype: str, seed: int
) -> None:
    """As above, for the families whose checkpoints store linears transposed or rows reordered."""
    _check_rank_weights(data.draw(classic_specs(family)), tp, qtype, seed)


BLOCKS = st.sampled_from([((1,), (2,)), ((1,), (4,)), ((0,), (2,)), ((0, 1), (2, 2))])
"""(quantization_block_axis, quantization_block_size) of the blockwise cases."""


@given(spec=dense_specs(), tp=st.integers(1, 4), block=BLOCKS, seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_blockwise_rank_weights_dequantize_to_the_rank_slice_or_name_the_block_size(
    spec: ModelSpec, tp: int, block: tuple[tuple[int, ...], tuple[int, ...]], seed: int
) -> None:
    """Blockwise scales follow their blocks through a rank's rows or columns; a rank whose share
    cuts a block is refused, naming quantization_block_size."""
    _check_rank_weights(spec, tp, "blockwise_symmetric", seed, block=block)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bloom", "gptj", "gpt_neox"])
@given(data=st.data(), tp=st.integers(1, 4), size=st.sampled_from([2, 4]), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None)
def test_other_stored_layouts_keep_their_column_blocks_on_every_rank(
    family: str, data: st.DataObject, tp: int, size: int, seed: int
) -> None:
    """Blocks along the input columns, for the families storing linears transposed or rows reordered."""
    _check_rank_weights(data.draw(classic_specs(family)), tp, "blockwise_symmetric", seed, block=((1,), (size,)))


def _check_rank_weights(
    spec: ModelSpec, tp: int, qtype: str, seed: int, *, block: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
) -> None:
    """A rank's quantized linear (values and scales read through the rank plan) dequantizes to
    exactly what the float rank plan reads from the dequantized checkpoint: scales follow their
    rows through fused Q/K/V, GQA replication, zero padding and row- or column-wise splits (and,
    blockwise, their blocks, or the rank plan names the block size its share cuts)."""
    from nxdi.core.host import weight_ops
    from nxdi.core.host.quant import layout
    from nxdi.core.planning import sharding
    from nxdi.core.planning.rank_weights import rank_plan
    from nxdi.testing.strategies.decoders import plan_of, random_state_dict

    axes, sizes = block
    blocks = {"quantization_block_axis": axes, "quantization_block_size": sizes} if axes else {}
    scheme = parse_quant_scheme(quantization_type=qtype, **blocks).unwrap()
    state = random_state_dict(spec, seed)
    table = program_of(spec).table
    saved = layout.quantize_state_dict(state, scheme, table=table, spec=spec)
    assume(isinstance(saved, Success))  # blocks that tile every linear
    quantized = saved.unwrap()
    keys = layout.table_keys(table, spec)
    assert all(quantized[k].dtype == torch.int8 for k in keys.quantized)
    restored = {
        k: dequantize_state(quantized, k, transposed=k in keys.transposed, blockwise=bool(axes))
        if k in keys.quantized
        else t
        for k, t in quantized.items()
        if not k.endswith(".scale")
    }
    shard = sharding.shard_plan(spec, tp=tp, fused_qkv=True, vocab_parallel=False)
    if not isinstance(shard, Success):
        return  # a head layout tp cannot split (checked elsewhere)
    # A quantized lm_head is read as its own weight even when tied; so is the float one compared.
    untied = attrs.evolve(spec, tie_word_embeddings=False)
    quant = WeightQuant(type=qtype, block_axis=axes, block_size=sizes)
    float_plan, quant_plan = plan_of(untied), plan_of(spec, quant=quant)
    for rank in range(tp):
        want = weight_ops.convert(rank_plan(float_plan, shard.unwrap(), rank).unwrap(), restored).unwrap()
        planned = rank_plan(quant_plan, shard.unwrap(), rank)
        if isinstance(planned, Failure):
            assert axes and {p.field for p in planned.failure().problems} == {"quantization_block_size"}
            continue
        got = weight_ops.convert(planned.unwrap(), quantized).unwrap()
        for step in quant_plan.steps:
            if step.quantized:
                values, scale = got[step.name], got[scale_name(step.name)]
                rows, cols = quant.block()
                want_scale = (values.shape[0] // rows, values.shape[1] // cols) if axes else (values.shape[0],)
                assert values.dtype == torch.int8 and scale.shape == want_scale
                weight = dequantize(QuantizedWeight(values=values, scale=scale), torch.float32)
                assert torch.equal(weight, want[step.name]), step.name


def dequantize_state(
    tensors: dict[str, Tensor], key: str, *, transposed: bool = False, blockwise: bool = False
) -> Tensor:
    """The float weight of quantized `key` (values times their scale, in float32); a transposed
    one's [out, 1] scale scales its columns; a blockwise one's scale is a block grid."""
    scale = tensors[scale_name(key)]
    if scale.numel() == 1:
        return tensors[key].float() * scale
    if blockwise:  # a block grid over the [out, in] weight
        values = tensors[key].T if transposed else tensors[key]
        weight = dequantize(QuantizedWeight(values=values, scale=scale), torch.float32)
        return weight.T if transposed else weight
    return tensors[key].float() * (scale.reshape(1, -1) if transposed else scale.reshape(-1, 1))

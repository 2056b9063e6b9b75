"""Unit tests for nxdi.core.host.quant: schemes, quantize/dequantize, checkpoint layout checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from returns.result import Failure, Success

from nxdi.core.host.quant import layout, weights
from nxdi.core.host.quant.weights import QuantDtype, QuantType
from nxdi.core.weight_plan import scale_name


def scheme(qtype: str = "per_tensor_symmetric", dtype: str = "int8", **kw: object) -> weights.QuantScheme:
    result = weights.parse_quant_scheme(quantization_type=qtype, quantization_dtype=dtype, **kw)  # type: ignore[arg-type]
    assert isinstance(result, Success), result
    return result.unwrap()


def quantize_ok(w: torch.Tensor, s: weights.QuantScheme) -> weights.QuantizedTensor:
    result = weights.quantize(w, s)
    assert isinstance(result, Success), result
    return result.unwrap()


# --- schemes -------------------------------------------------------------------------------------


def test_defaults_match_reference_neuron_config() -> None:
    s = scheme()
    assert (s.type, s.dtype, s.scale_dtype) == (QuantType.PER_TENSOR_SYMMETRIC, QuantDtype.INT8, weights.ScaleDtype.F32)


def test_reference_strings_and_fp8_alias() -> None:
    assert {t.value for t in QuantType} == {"per_tensor_symmetric", "per_channel_symmetric", "blockwise_symmetric"}
    assert scheme(dtype="F8E4M3FN").dtype is QuantDtype.F8E4M3
    assert QuantDtype.F8E4M3.torch_dtype is torch.float8_e4m3fn


def test_parse_lists_every_problem() -> None:
    result = weights.parse_quant_scheme(
        quantization_type="per_row", quantization_dtype="int4", quantization_scale_dtype="f8e8m0"
    )
    assert isinstance(result, Failure)
    assert result.failure().fields() == {
        "neuron_config.quantization_type",
        "neuron_config.quantization_dtype",
        "neuron_config.quantization_scale_dtype",
    }


def test_blockwise_needs_axis_and_size() -> None:
    result = weights.parse_quant_scheme(quantization_type="blockwise_symmetric")
    assert isinstance(result, Failure)
    assert result.failure().fields() == {
        "neuron_config.quantization_block_axis",
        "neuron_config.quantization_block_size",
    }
    bad = weights.parse_quant_scheme(
        quantization_type="blockwise_symmetric", quantization_block_axis=[0, 0], quantization_block_size=[0]
    )
    assert isinstance(bad, Failure)
    assert len(bad.failure().problems) == 3  # length mismatch, repeated axis, size < 1


def test_block_fields_ignored_for_other_types() -> None:
    s = scheme(quantization_block_axis=[1], quantization_block_size=[4])
    assert s.block_axis == () and s.block_size == ()


# --- scale shapes and values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "extra", "want"),
    [
        ("per_tensor_symmetric", {}, (1,)),
        ("per_channel_symmetric", {}, (8, 1)),
        ("blockwise_symmetric", {"quantization_block_axis": [1], "quantization_block_size": [4]}, (8, 4)),
        ("blockwise_symmetric", {"quantization_block_axis": [0], "quantization_block_size": [2]}, (4, 16)),
        ("blockwise_symmetric", {"quantization_block_axis": [0, -1], "quantization_block_size": [4, 8]}, (2, 2)),
    ],
)
@pytest.mark.parametrize("dtype", ["int8", "f8e4m3"])
def test_scale_shapes(qtype: str, extra: dict[str, list[int]], want: tuple[int, ...], dtype: str) -> None:
    s = scheme(qtype, dtype, **extra)
    q = quantize_ok(torch.randn(8, 16), s)
    assert tuple(q.scale.shape) == want
    assert q.scale.dtype == torch.float32
    assert q.values.shape == (8, 16) and q.values.dtype == s.dtype.torch_dtype


def test_int8_per_channel_matches_reference_formula() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.25, -0.125]])
    q = quantize_ok(w, scheme("per_channel_symmetric"))
    torch.testing.assert_close(q.scale, torch.tensor([[2.0 / 127], [0.25 / 127]]))
    assert q.values[0].tolist() == [64, -127, 32]  # 63.5 rounds to even


def test_int8_per_tensor_uses_torch_observer_range() -> None:
    w = torch.tensor([[-1.0, 1.0, 0.5]])
    q = quantize_ok(w, scheme())
    torch.testing.assert_close(q.scale, torch.tensor([1.0 / 127.5]))
    # |w| = max lands on +/-127.5 (up to float32 rounding of w / scale): +127.5 clamps to 127,
    # -127.5 may round to -128 (in int8 range) or -127; either is within scale / 2.
    assert q.values[0, 1] == 127 and q.values[0, 0] in (-127, -128) and q.values[0, 2] == 64


def test_f8e4m3_uses_neuron_range_240() -> None:
    w = torch.tensor([[3.0, -1.5]])
    q = quantize_ok(w, scheme("per_channel_symmetric", "f8e4m3"))
    torch.testing.assert_close(q.scale, torch.tensor([[3.0 / 240]]))
    assert q.values.float().abs().max().item() == 240.0


@pytest.mark.parametrize("qtype", ["per_tensor_symmetric", "per_channel_symmetric"])
@pytest.mark.parametrize("dtype", ["int8", "f8e4m3", "f8e5m2"])
def test_zero_tensor_round_trips_without_nan(qtype: str, dtype: str) -> None:
    s = scheme(qtype, dtype)
    q = quantize_ok(torch.zeros(4, 8), s)
    assert torch.all(q.scale > 0)
    out = weights.dequantize(q, s)
    assert torch.equal(out, torch.zeros(4, 8))


def test_dequantize_returns_requested_dtype() -> None:
    s = scheme("per_channel_symmetric")
    out = weights.dequantize(quantize_ok(torch.randn(4, 8), s), s, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 8)


def test_block_size_that_does_not_divide_is_refused_naming_tensor() -> None:
    s = scheme("blockwise_symmetric", "f8e4m3", quantization_block_axis=[0, 1], quantization_block_size=[3, 5])
    result = weights.quantize(torch.randn(8, 16), s, name="layers.0.mlp.up_proj.weight")
    assert isinstance(result, Failure)
    problems = result.failure().problems
    assert len(problems) == 2  # both axes reported
    assert all(p.field == "layers.0.mlp.up_proj.weight" and p.fix for p in problems)


def test_non_float_and_0d_refused() -> None:
    assert isinstance(weights.quantize(torch.ones(2, 2, dtype=torch.int32), scheme()), Failure)
    assert isinstance(weights.quantize(torch.tensor(1.0), scheme("per_channel_symmetric")), Failure)


@pytest.mark.parametrize(("src", "ratio"), [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("dtype", ["int8", "f8e4m3"])
def test_stored_bytes_shrink(src: torch.dtype, ratio: int, dtype: str) -> None:
    w = torch.randn(64, 128, dtype=src)
    q = quantize_ok(w, scheme("per_channel_symmetric", dtype))
    assert q.values.element_size() * ratio == w.element_size()
    assert q.values.numel() * q.values.element_size() * ratio == w.numel() * w.element_size()
    assert q.nbytes < w.numel() * w.element_size() / ratio + 64 * 4 + 1  # values + one f32 per row
    assert q.values.dtype != w.dtype  # a no-op "quantization" fails here and above


# --- checkpoint layout ---------------------------------------------------------------------------

NAMES = [
    "embed_tokens.weight",
    "norm.weight",
    "lm_head.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.1.mlp.up_proj.weight",
    "layers.10.mlp.up_proj.weight",
]
LINEAR = [k for k in NAMES if "_proj" in k or k.startswith("lm_head")]
"""The linear weights of NAMES (what `WeightTable.linear_sources` gives for a Llama checkpoint)."""


def test_default_quantized_keys() -> None:
    plan = layout.quantized_keys(LINEAR)
    assert plan.quantized == tuple(sorted(LINEAR)) and plan.excluded == () and plan.transposed == frozenset()


def test_a_familys_linear_weights_are_its_tables() -> None:
    """Which weights a checkpoint quantizes comes from the family's weight table: OPT's out_proj and
    fc1/fc2, GPT-2's Conv1D c_attn/c_proj/c_fc (stored [in, out]), never embeddings or norms."""
    from nxdi.core import families
    from nxdi.testing import checkpoints

    def keys(family: str) -> layout.QuantPlan:
        spec = families.parse_model_spec(checkpoints.tiny_config(family).to_dict()).unwrap()
        return layout.table_keys(families.record_for(family).unwrap().weights, spec)

    llama = keys("llama")
    assert "layers.0.mlp.gate_proj.weight" in llama.quantized and "lm_head.weight" in llama.quantized
    assert not any("norm" in k or "embed" in k for k in llama.quantized) and not llama.transposed
    opt = keys("opt")
    assert {"layers.1.self_attn.out_proj.weight", "layers.1.fc1.weight", "layers.1.fc2.weight"} <= set(opt.quantized)
    gpt2 = keys("gpt2")
    assert {"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight"} <= gpt2.transposed and "lm_head.weight" in gpt2.quantized
    assert "lm_head.weight" not in gpt2.transposed and not any(k.startswith(("wte", "wpe")) for k in gpt2.quantized)


def test_modules_to_not_convert_substring_semantics() -> None:
    plan = layout.quantized_keys(LINEAR, ["lm_head", "layers.0.self_attn", "layers.1."])
    assert set(plan.excluded) == {
        "lm_head.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.1.mlp.up_proj.weight",
    }
    assert "layers.10.mlp.up_proj.weight" in plan.quantized
    # The reference's plain substring match: "layers.1" also catches layers.10.
    assert "layers.10.mlp.up_proj.weight" in layout.quantized_keys(LINEAR, ["layers.1"]).excluded


def _state_dict(s: weights.QuantScheme, skip: list[str]) -> dict[str, torch.Tensor]:
    sd = {k: torch.randn(8, 16) for k in NAMES}
    for key in layout.quantized_keys(LINEAR, skip).quantized:
        q = quantize_ok(sd[key], s)
        sd[key], sd[scale_name(key)] = q.values, q.scale
    return sd


@pytest.mark.parametrize("qtype", ["per_tensor_symmetric", "per_channel_symmetric"])
def test_check_accepts_what_quantize_writes(qtype: str) -> None:
    s = scheme(qtype)
    plan = layout.quantized_keys(LINEAR, ["lm_head"])
    assert layout.check_quantized_checkpoint(layout.metas_of(_state_dict(s, ["lm_head"])), plan, s) == Success(plan)


def test_check_lists_every_problem_naming_tensors() -> None:
    s = scheme("per_channel_symmetric")
    sd = _state_dict(s, [])
    del sd["layers.0.mlp.up_proj.scale"]
    sd["layers.0.self_attn.q_proj.weight"] = sd["layers.0.self_attn.q_proj.weight"].float()
    sd["layers.0.self_attn.o_proj.scale"] = torch.ones(1)
    del sd["layers.1.mlp.up_proj.weight"]
    sd["lm_head.weight"] = sd["lm_head.weight"].float().to(torch.float8_e4m3fn)
    result = layout.check_quantized_checkpoint(layout.metas_of(sd), layout.quantized_keys(LINEAR), s)
    assert isinstance(result, Failure)
    by_field = {p.field: p for p in result.failure().problems}
    assert set(by_field) == {
        "layers.0.mlp.up_proj.scale",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.o_proj.scale",
        "layers.1.mlp.up_proj.weight",
        "lm_head.weight",
    }
    assert "per_tensor_symmetric" in by_field["layers.0.self_attn.o_proj.scale"].reason
    assert "quantization_type='per_tensor_symmetric'" in by_field["layers.0.self_attn.o_proj.scale"].fix
    assert "quantization_dtype='f8e4m3'" in by_field["lm_head.weight"].fix
    assert all(p.fix for p in by_field.values())


def test_check_flags_blockwise_scale_for_per_channel_config() -> None:
    meta = {
        "a.q_proj.weight": layout.TensorMeta(shape=(8, 16), dtype=torch.int8),
        "a.q_proj.scale": layout.TensorMeta(shape=(8, 4), dtype=torch.float32),
    }
    plan = layout.QuantPlan(quantized=["a.q_proj.weight"], excluded=[])
    result = layout.check_quantized_checkpoint(meta, plan, scheme("per_channel_symmetric"))
    assert isinstance(result, Failure)
    assert "blockwise_symmetric" in result.failure().problems[0].reason


def test_check_flags_quantized_excluded_module_and_bad_blocks() -> None:
    s = scheme("blockwise_symmetric", "f8e4m3", quantization_block_axis=[1], quantization_block_size=[5])
    meta = {
        "x.up_proj.weight": layout.TensorMeta(shape=(8, 16), dtype=torch.float8_e4m3fn),
        "x.up_proj.scale": layout.TensorMeta(shape=(8, 3), dtype=torch.float32),
        "lm_head.weight": layout.TensorMeta(shape=(8, 16), dtype=torch.float8_e4m3fn),
    }
    plan = layout.QuantPlan(quantized=["x.up_proj.weight"], excluded=["lm_head.weight"])
    result = layout.check_quantized_checkpoint(meta, plan, s)
    assert isinstance(result, Failure)
    assert result.failure().fields() == {"x.up_proj.weight", "lm_head.weight"}


def test_fp8_per_tensor_0d_scale_accepted() -> None:
    s = scheme(dtype="f8e4m3")
    meta = {
        "a.q_proj.weight": layout.TensorMeta(shape=(4, 4), dtype=torch.float8_e4m3fn),
        "a.q_proj.scale": layout.TensorMeta(shape=(), dtype=torch.float32),
    }
    plan = layout.QuantPlan(quantized=["a.q_proj.weight"], excluded=[])
    assert isinstance(layout.check_quantized_checkpoint(meta, plan, s), Success)


def test_a_transposed_weights_scale_is_that_of_the_out_in_weight() -> None:
    """A Conv1D weight stored [in, out] = [16, 8] is quantized per output column: its scale is [8, 1]."""
    table, spec = _gpt2()
    w = torch.randn(16, 8)
    sd = layout.quantize_state_dict(
        {"transformer.h.0.mlp.c_fc.weight": w}, scheme("per_channel_symmetric"), table=table, spec=spec
    ).unwrap()
    values, scale = sd["h.0.mlp.c_fc.weight"], sd["h.0.mlp.c_fc.scale"]
    assert values.shape == (16, 8) and values.dtype == torch.int8 and scale.shape == (8, 1)
    torch.testing.assert_close(values.float() * scale.T, w, atol=float(scale.max()) / 2 + 1e-6, rtol=0)
    plan = layout.QuantPlan(quantized=["h.0.mlp.c_fc.weight"], excluded=[], transposed={"h.0.mlp.c_fc.weight"})
    s = scheme("per_channel_symmetric")
    assert isinstance(layout.check_quantized_checkpoint(layout.metas_of(sd), plan, s), Success)
    wrong = sd | {"h.0.mlp.c_fc.scale": torch.ones(16, 1)}
    problems = layout.check_quantized_checkpoint(layout.metas_of(wrong), plan, s).failure().problems
    assert [p.field for p in problems] == ["h.0.mlp.c_fc.scale"] and "[8, 1]" in problems[0].reason


def _gpt2() -> tuple[Any, Any]:
    from nxdi.core import families
    from nxdi.testing import checkpoints

    spec = families.parse_model_spec(checkpoints.tiny_config("gpt2", n_inner=8, n_embd=16).to_dict()).unwrap()
    return families.record_for("gpt2").unwrap().weights, spec

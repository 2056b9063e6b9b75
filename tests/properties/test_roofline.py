"""The decode roofline's byte count: hand-computed cases and how it scales with batch, context and dtype."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import roofline
from nxdi.testing.strategies.plans import small_model_specs

# hidden 8, 2 query heads and 1 kv head of 4, 2 layers, vocab 10, ffn 16, SwiGLU, RMS norms, no biases.
TINY = ModelSpec(
    model_type="llama",
    hidden_size=8,
    num_attention_heads=2,
    num_kv_heads=1,
    head_dim=4,
    num_layers=2,
    vocab_size=10,
    intermediate_size=16,
    max_position_embeddings=64,
)
# Per layer: q 8x8 + k 4x8 + v 4x8 + o 8x8 = 192, gate/up/down 3x16x8 = 384, two norms 16; then lm_head
# 10x8 = 80 and the final norm 8. The embedding's 80 are gathered rows: not counted.
LINEAR_PER_LAYER, NORMS_PER_LAYER, LM_HEAD, FINAL_NORM = 192 + 384, 16, 80, 8
PARAMS = 2 * (LINEAR_PER_LAYER + NORMS_PER_LAYER) + LM_HEAD + FINAL_NORM
ROWS_PER_LAYER = 8 + 4 + 4 + 8 + 16 + 16 + 8  # output rows of q, k, v, o, gate, up, down
KV_PER_POSITION = 2 * 2 * 1 * 4  # layers x (K, V) x kv heads x head_dim, per sequence


def _bytes(
    model: ModelSpec = TINY, *, dtype: str = "bfloat16", batch: int = 1, context: int = 1, **kw: Any
) -> roofline.DecodeBytes:
    match roofline.decode_step_bytes(model, dtype=dtype, batch=batch, context=context, **kw):
        case Success(value):
            return value
    raise AssertionError(f"no byte count for {dtype}, batch {batch}, context {context}, {kw}")


def test_bf16_counts_every_weight_but_the_embedding_and_the_kv_cache_at_the_context() -> None:
    got = _bytes(batch=3, context=20)
    assert got.weight_bytes == 2 * PARAMS == 2544
    assert got.kv_read_bytes == 3 * 20 * KV_PER_POSITION * 2
    assert got.kv_write_bytes == 3 * KV_PER_POSITION * 2
    assert got.total_bytes == got.weight_bytes + got.kv_read_bytes + got.kv_write_bytes


def test_storage_dtypes_scale_weights_and_cache() -> None:
    assert _bytes(dtype="float32", context=5).weight_bytes == 4 * PARAMS
    assert _bytes(dtype="float16", context=5) == _bytes(context=5)
    assert _bytes(kv_dtype="float32", context=5).kv_read_bytes == 2 * _bytes(context=5).kv_read_bytes


def test_int8_weights_take_a_byte_per_linear_value_plus_float32_scales() -> None:
    norms = 2 * (2 * NORMS_PER_LAYER + FINAL_NORM)  # norms stay bf16; lm_head is a linear too (10 rows)
    per_channel = _bytes(weight_quant_dtype="int8")
    assert per_channel.weight_bytes == 2 * LINEAR_PER_LAYER + 2 * ROWS_PER_LAYER * 4 + LM_HEAD + 10 * 4 + norms == 1864
    per_tensor = _bytes(weight_quant_dtype="int8", per_channel_scales=False)
    assert per_tensor.weight_bytes == 2 * LINEAR_PER_LAYER + 2 * 7 * 4 + LM_HEAD + 4 + norms
    assert _bytes(weight_quant_dtype="f8e4m3") == per_channel
    assert per_channel.kv_read_bytes == _bytes().kv_read_bytes  # the cache keeps the dtype


def test_modules_kept_in_float_are_counted_in_the_dtype() -> None:
    quantized = _bytes(weight_quant_dtype="int8")
    kept = _bytes(weight_quant_dtype="int8", modules_to_not_convert=("lm_head",))
    assert kept.weight_bytes == quantized.weight_bytes - (LM_HEAD + 10 * 4) + 2 * LM_HEAD  # bf16, no scales
    layer0 = _bytes(weight_quant_dtype="int8", modules_to_not_convert=("layers.0.",))
    assert (
        layer0.weight_bytes == quantized.weight_bytes - (LINEAR_PER_LAYER + ROWS_PER_LAYER * 4) + 2 * LINEAR_PER_LAYER
    )
    assert _bytes(modules_to_not_convert=("lm_head",)) == _bytes()  # nothing is quantized anyway


def test_a_tied_lm_head_is_read_once_like_an_untied_one() -> None:
    tied = attrs.evolve(TINY, tie_word_embeddings=True)
    assert _bytes(tied, batch=2, context=7) == _bytes(batch=2, context=7)


def test_a_sliding_window_bounds_the_positions_read() -> None:
    windowed = attrs.evolve(TINY, sliding_window=3)
    assert _bytes(windowed, context=10).kv_read_bytes == _bytes(context=3).kv_read_bytes
    assert _bytes(windowed, context=2).kv_read_bytes == _bytes(context=2).kv_read_bytes


def test_moe_reads_the_experts_its_tokens_can_be_routed_to() -> None:
    moe = attrs.evolve(TINY, num_experts=4, num_experts_per_tok=2)
    experts = 2 * 3 * 4 * 16 * 8 * 2  # layers x (gate, up, down) x experts x F x E x bf16 bytes
    one, two, three = (_bytes(moe, batch=b).weight_bytes for b in (1, 2, 3))
    assert two - one == experts // 2  # 2 of 4 experts at batch 1, all 4 from batch 2
    assert three == two


def test_roofline_time_is_bytes_over_bandwidth() -> None:
    step = _bytes(batch=4, context=10)
    line = roofline.Roofline(step_bytes=step, bandwidth_bytes_per_s=1e9, batch=4)
    assert line.step_s == pytest.approx(step.total_bytes / 1e9)
    assert line.tokens_per_s == pytest.approx(4 / line.step_s)
    with pytest.raises(ValueError):
        roofline.Roofline(step_bytes=step, bandwidth_bytes_per_s=0.0, batch=1)


def test_every_bad_argument_is_listed() -> None:
    got = roofline.decode_step_bytes(TINY, dtype="bf16", batch=0, context=0, weight_quant_dtype="int4")
    assert isinstance(got, Failure)
    fields = [p.field for p in got.failure().problems]
    assert fields == ["batch", "context", "dtype", "weight_quant_dtype"]


@given(small_model_specs(), st.integers(1, 8), st.integers(1, 512), st.integers(1, 4), st.integers(1, 64))
def test_bytes_grow_with_batch_and_context(
    model: ModelSpec, batch: int, context: int, more_b: int, more_c: int
) -> None:
    base = _bytes(model, batch=batch, context=context)
    assert _bytes(model, batch=batch + more_b, context=context).total_bytes > base.total_bytes
    assert _bytes(model, batch=batch, context=context + more_c).total_bytes >= base.total_bytes


@given(small_model_specs(), st.integers(1, 8), st.integers(1, 512))
def test_weights_are_read_once_per_step_and_the_cache_per_sequence(model: ModelSpec, batch: int, context: int) -> None:
    one = _bytes(model, context=context)
    many = _bytes(model, batch=batch, context=context)
    if not model.is_moe:
        assert many.weight_bytes == one.weight_bytes
    assert many.kv_read_bytes == batch * one.kv_read_bytes
    assert many.kv_write_bytes == batch * one.kv_write_bytes
    assert one.kv_read_bytes == context * one.kv_write_bytes  # no window in these specs
    assert _bytes(model, dtype="float32", batch=batch, context=context).total_bytes == 2 * many.total_bytes


def test_prefill_flops_by_hand() -> None:
    # 3 tokens: linears 2 x 3 x 576 per layer; attention 2 x 2 x (1 + 2 + 3) positions x 2 heads x 4;
    # lm_head 2 x 8 x 10 for the last token only.
    per_layer = 2 * 3 * LINEAR_PER_LAYER + 2 * 2 * 6 * 2 * 4
    assert roofline.prefill_flops(TINY, batch=1, prompt_len=3) == 2 * per_layer + 2 * LM_HEAD
    assert roofline.prefill_flops(TINY, batch=4, prompt_len=3) == 4 * (2 * per_layer + 2 * LM_HEAD)


def test_prefill_flops_of_a_mixture_of_experts_count_the_routed_experts_and_the_router() -> None:
    moe = attrs.evolve(TINY, num_experts=4, num_experts_per_tok=2)
    mlp_per_token = 384 * 2 + 8 * 4
    dense_mlp_per_token = 384
    diff = roofline.prefill_flops(moe, batch=1, prompt_len=5) - roofline.prefill_flops(TINY, batch=1, prompt_len=5)
    assert diff == 2 * 2 * 5 * (mlp_per_token - dense_mlp_per_token)


@given(st.integers(1, 4), st.integers(1, 300))
def test_prefill_flops_grow_with_the_prompt_and_are_linear_in_the_batch(batch: int, prompt_len: int) -> None:
    one = roofline.prefill_flops(TINY, batch=1, prompt_len=prompt_len)
    assert roofline.prefill_flops(TINY, batch=batch, prompt_len=prompt_len) == batch * one
    assert roofline.prefill_flops(TINY, batch=1, prompt_len=prompt_len + 1) > one


def test_prefill_flops_refuse_an_empty_prefill() -> None:
    with pytest.raises(ValueError, match="prompt_len=0"):
        roofline.prefill_flops(TINY, batch=1, prompt_len=0)

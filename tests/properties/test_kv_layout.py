"""Properties of the per-rank KV-cache layout."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nxdi.core.config.neuron_spec import DTYPE_BYTES
from nxdi.core.planning import gqa, kv_layout
from nxdi.testing.strategies.plans import head_configs

DTYPES = ["float32", "float16", "bfloat16"]


@given(
    head_configs(),
    st.integers(1, 8),
    st.integers(0, 2),
    st.integers(1, 1 << 15),
    st.integers(1, 4),
    st.sampled_from(DTYPES),
    st.booleans(),
)
def test_shape_and_bytes(
    cfg: tuple[int, int, int], batch: int, pad: int, max_length: int, layers: int, dtype: str, quant: bool
) -> None:
    tp, q, kv = cfg
    strategy, _ = gqa.determine_strategy(tp, kv)
    counts = gqa.shardable_head_counts(tp, q, kv, strategy).unwrap()
    layout = kv_layout.kv_layout(
        tp=tp,
        num_layers=layers,
        kv_heads_per_rank=counts.kv_per_rank,
        head_dim=64,
        kv_cache_batch_size=batch,
        kv_cache_padding_size=pad,
        max_length=max_length,
        dtype=dtype,
        kv_cache_quant=quant,
    ).unwrap()
    b, h, t, d = layout.shape_per_rank
    assert (b, t, d) == (batch + pad, max_length, 64)
    assert h * tp == counts.kv_padded
    assert layout.dtype == ("float8_e4m3fn" if quant else dtype) and layout.compute_dtype == dtype
    assert layout.bytes_per_rank == layers * 2 * b * h * t * d * DTYPE_BYTES[layout.dtype]
    assert layout.total_bytes == tp * layout.bytes_per_rank


@given(st.integers(1, 1 << 17), st.sampled_from([1, 2, 4, 8, 16]), st.one_of(st.none(), st.integers(1, 1 << 16)))
def test_positions_cover_the_sequence(max_length: int, group: int, window: int | None) -> None:
    t = kv_layout.cache_positions(max_length, sliding_window=window, flash_decoding_group=group)
    seen = max_length if window is None else min(max_length, window)
    if group == 1:
        assert t == seen
    else:  # g cores each hold t - 128 positions: together at least the whole sequence, less than one extra row each
        assert (
            (t - kv_layout.FLASH_DECODING_RESERVED) * group
            >= seen
            > (t - 1 - kv_layout.FLASH_DECODING_RESERVED) * group
        )


@given(st.integers(-2, 3), st.integers(-1, 3), st.sampled_from(["bfloat16", "float64"]))
def test_bad_sizes_are_all_reported(batch: int, pad: int, dtype: str) -> None:
    result = kv_layout.kv_layout(
        tp=2,
        num_layers=1,
        kv_heads_per_rank=1,
        head_dim=8,
        kv_cache_batch_size=batch,
        kv_cache_padding_size=pad,
        max_length=16,
        dtype=dtype,
    )
    expected = {
        f
        for f, bad in (
            ("kv_cache_batch_size", batch < 1),
            ("kv_cache_padding_size", pad < 0),
            ("torch_dtype", dtype == "float64"),
        )
        if bad
    }
    fields = result.failure().fields() if expected else set()
    assert fields == expected
    assert bool(expected) != bool(result.value_or(None))

"""Prefix-caching and chunked-prefill bucket tables and selection against the reference's examples.

The selection cases are those of the reference's test/unit/models/test_prefix_caching_bucket_selection.py;
the table cases those of its test_autobucketing.py and of REFERENCE §3.
"""

from __future__ import annotations

import attrs
import pytest
from returns.result import Failure, Success

from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.config.sub_specs import ChunkedPrefillSpec
from nxdi.core.planning import block_buckets as bb

CTE = bb.PrefixTable(kind=Phase.CONTEXT, active=(8, 16, 32), prefix=(0, 8, 16), max_length=32)
TKG = bb.PrefixTable(kind=Phase.TOKEN, active=(1,), prefix=(8, 16, 32), max_length=32)


def _spec(**kwargs: object) -> NeuronSpec:
    return parse_neuron_spec(kwargs).unwrap().spec


@pytest.mark.parametrize(
    ("prefill", "prefix", "expected"),
    [
        # no prefix
        (7, 0, (8, 0)),
        (8, 0, (8, 0)),
        (9, 0, (16, 0)),
        (16, 0, (16, 0)),
        (17, 0, (32, 0)),
        (31, 0, (32, 0)),
        # the whole prefix moves into the prefill bucket's empty slots
        (4, 4, (8, 0)),
        (9, 4, (16, 0)),
        (17, 8, (32, 0)),
        # prefix bucket 8
        (7, 4, (8, 8)),
        (4, 12, (8, 8)),
        (10, 8, (16, 8)),
        (10, 12, (16, 8)),
        (17, 16, (32, 8)),
        (30, 4, (32, 8)),
        # prefix bucket 16
        (7, 12, (8, 16)),
        (4, 16, (8, 16)),
        (10, 16, (16, 16)),
        (10, 20, (16, 16)),
        (17, 24, (32, 16)),
        (30, 12, (32, 16)),
    ],
)
def test_context_selection_matches_the_reference(prefill: int, prefix: int, expected: tuple[int, int]) -> None:
    assert bb.select_prefix_bucket(CTE, prefill, prefix) == Success(expected)


@pytest.mark.parametrize(("prefix", "expected"), [(7, 8), (8, 16), (15, 16), (16, 32), (31, 32)])
def test_token_selection_matches_the_reference(prefix: int, expected: int) -> None:
    """The reference's strict `p > prefix` is nxdi's `prefix + 1 new token <= p`."""
    assert bb.select_prefix_bucket(TKG, 1, prefix) == Success((1, expected))


def test_a_prefix_too_long_for_the_smallest_prefill_bucket_moves_up() -> None:
    """The reference asserts here (its TODO); nxdi takes the next prefill bucket, whose slots hold the rest."""
    assert bb.select_prefix_bucket(CTE, 4, 24) == Success((16, 16))


def test_short_contexts_are_recomputed_in_the_512_bucket() -> None:
    t = bb.PrefixTable(kind=Phase.CONTEXT, active=(128, 512), prefix=(0, 256), max_length=512)
    assert bb.select_prefix_bucket(t, 100, 200) == Success((512, 0))  # 256 < 300 <= 512
    assert bb.select_prefix_bucket(t, 100, 200, recompute_short_contexts=False) == Success((128, 256))
    assert bb.select_prefix_bucket(t, 100, 100) == Success((128, 256))  # 200 <= 256: not a short context


def test_overflow_names_fields_values_and_fixes() -> None:
    err = bb.select_prefix_bucket(CTE, 40, 30).failure()
    assert err.fields() == {"prefill_length", "prefix_length"}
    assert {p.value for p in err.problems} == {"40", "30"}
    assert "largest prefill bucket (32)" in err.problems[0].reason
    (p,) = bb.select_prefix_bucket(TKG, 1, 32).failure().problems
    assert p.field == "prefix_length" and "token_generation_buckets" in p.fix and "33" in p.fix
    assert bb.select_prefix_bucket(TKG, 1, 32, allow_input_truncation=True) == Success((1, 32))
    assert bb.select_prefix_bucket(CTE, 40, 4, allow_input_truncation=True) == Success((32, 8))
    assert bb.select_prefix_bucket(CTE, 0, -1).failure().fields() == {"prefill_length", "prefix_length"}


def test_2d_prefix_tables_from_a_spec() -> None:
    auto = _spec(seq_len=2048, enable_bucketing=True, is_prefix_caching=True, is_block_kv_layout=True)
    assert bb.prefix_context_table_for(auto).unwrap().buckets()[:4] == ((512, 0), (512, 512), (512, 1024), (512, 2048))
    assert bb.prefix_token_table_for(auto).unwrap().buckets() == ((1, 256), (1, 512), (1, 1024), (1, 2048))
    off = _spec(seq_len=1024, is_prefix_caching=True, is_block_kv_layout=True)
    assert bb.prefix_context_table_for(off).unwrap().buckets() == ((1024, 0), (1024, 1024))
    assert bb.prefix_token_table_for(off).unwrap().buckets() == ((1, 1024),)
    given = _spec(
        seq_len=1024,
        enable_bucketing=True,
        is_prefix_caching=True,
        is_block_kv_layout=True,
        context_encoding_buckets=[256, 1024],
        prefix_buckets=[0, 512],
        token_generation_buckets=[512, 1024],
    )
    assert bb.prefix_context_table_for(given).unwrap().buckets() == ((256, 0), (256, 512), (1024, 0), (1024, 512))
    assert bb.prefix_token_table_for(given).unwrap().buckets() == ((1, 512), (1, 1024))
    # the reference crashes on explicit context_encoding_buckets without prefix_buckets
    no_prefix = _spec(seq_len=1024, enable_bucketing=True, is_prefix_caching=True, context_encoding_buckets=[1024])
    assert bb.prefix_context_table_for(no_prefix).unwrap().prefix == (0, 512, 1024)


def test_bad_prefix_buckets_are_all_reported() -> None:
    bad = bb.prefix_context_table(
        max_context_length=512, enable_bucketing=True, prefill_buckets=[1024], prefix_buckets=[256, 256, 600]
    )
    assert isinstance(bad, Failure) and bad.failure().fields() == {"context_encoding_buckets", "prefix_buckets"}
    assert bb.prefix_context_table(
        max_context_length=512, enable_bucketing=True, prefix_buckets=[0]
    ).unwrap().prefix == (0,)


@pytest.mark.parametrize(
    ("q_tile", "max_ctx", "expected"), [(128, 250, (128, 256)), (128, 1024, (128, 512, 1024)), (128, 64, (128,))]
)
def test_chunk_lengths(q_tile: int, max_ctx: int, expected: tuple[int, ...]) -> None:
    assert bb.chunk_lengths(q_tile, max_ctx) == expected


def test_chunked_prefill_tables() -> None:
    cfg = ChunkedPrefillSpec(kernel_q_tile_size=128, kernel_kv_tile_size=512, max_num_seqs=8)
    off = bb.chunked_prefill_table(max_context_length=1024, max_length=1024, enable_bucketing=False, config=cfg)
    assert off.unwrap().buckets() == ((1024, 128),)
    two = ChunkedPrefillSpec(kernel_q_tile_size=128, kernel_kv_tile_size=512, max_num_seqs=2)
    on = bb.chunked_prefill_table(max_context_length=1024, max_length=1024, enable_bucketing=True, config=two).unwrap()
    assert on.buckets() == tuple((q, t) for q in (128, 512, 1024) for t in (1, 16, 32))
    assert bb.tile_counts(3) == (3,) and bb.tile_counts(4) == (1, 2, 4)
    none = ChunkedPrefillSpec(max_num_seqs=0)
    bad = bb.chunked_prefill_table(max_context_length=64, max_length=64, enable_bucketing=True, config=none)
    assert bad.failure().fields() == {"chunked_prefill_config.max_num_seqs"}


def test_chunked_prefill_selection() -> None:
    cfg = ChunkedPrefillSpec(kernel_q_tile_size=128, kernel_kv_tile_size=512, max_num_seqs=2)
    t = bb.chunked_prefill_table(max_context_length=1024, max_length=1024, enable_bucketing=True, config=cfg).unwrap()
    assert bb.select_chunked_bucket(t, 128, 1) == Success((128, 1))  # equal to the bucket fits, as in the reference
    assert bb.select_chunked_bucket(t, 129, 17) == Success((512, 32))
    assert bb.select_chunked_bucket(t, 2000, 40).failure().fields() == {"chunk_length", "num_tiles"}


def test_block_tables_for_a_spec() -> None:
    assert bb.block_tables_for(_spec(seq_len=256)) == Success(None)
    chunked = _spec(
        seq_len=1024,
        is_block_kv_layout=True,
        enable_bucketing=True,
        chunked_prefill_config={"max_num_seqs": 2, "kernel_kv_tile_size": 512},
    )
    tables = bb.block_tables_for(chunked).unwrap()
    assert tables is not None and tables.prefix_context is None and tables.chunked_prefill is not None
    assert tables.chunked_prefill.chunks == (128, 512, 1024)
    batches = _spec(seq_len=256, is_prefix_caching=True, tkg_batch_size=2, batch_size=2)
    clash = bb.prefix_token_table_for(attrs.evolve(batches, token_generation_batches=(1,)))
    assert clash.failure().fields() == {"token_generation_batches"}

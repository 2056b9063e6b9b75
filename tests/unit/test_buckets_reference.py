"""Bucket tables, selection and padding against the reference's documented examples (and our §15 changes)."""

from __future__ import annotations

import pytest
from returns.result import Failure, Success

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.planning import buckets, padding


@pytest.mark.parametrize(
    ("max_length", "expected"),
    [
        (1000, (128, 256, 512, 1000)),
        (700, (128, 256, 512, 700)),  # the reference skips 512 here
        (2048, (128, 256, 512, 1024, 2048)),
        (100, (100,)),
        (64, (64,)),
        (128, (128,)),
        (181, (128, 181)),  # the reference gives (181,)
        (182, (128, 182)),
    ],
)
def test_automatic_tables(max_length: int, expected: tuple[int, ...]) -> None:
    assert buckets.auto_lengths(max_length) == expected


def test_bucketing_off_gives_the_maximum_only() -> None:
    t = buckets.context_encoding_table(max_context_length=1000, batch_size=2, enable_bucketing=False).unwrap()
    assert t.lengths == (1000,) and t.batch_sizes == (2,)


def test_explicit_tables_are_sorted_and_checked() -> None:
    ok = buckets.context_encoding_table(
        max_context_length=4096, batch_size=1, enable_bucketing=True, buckets=[4096, 1024, 2048]
    )
    assert ok.unwrap().lengths == (1024, 2048, 4096)
    bad = buckets.token_generation_table(
        max_length=1024, batch_size=1, enable_bucketing=True, buckets=[512, 512, 2048, 0]
    ).failure()
    assert bad.fields() == {"token_generation_buckets"}
    reasons = " | ".join(p.reason for p in bad.problems)
    assert "duplicates [512]" in reasons and "[2048] exceed max_length=1024" in reasons and "[0]" in reasons


def test_reference_selection_examples_with_smallest_fit() -> None:
    t = buckets.BucketTable(kind=Phase.CONTEXT, lengths=(128, 256, 512), batch_sizes=(1,), max_length=512)
    assert buckets.select_bucket(t, 100) == Success(128)
    assert buckets.select_bucket(t, 255) == Success(256)
    assert buckets.select_bucket(t, 128) == Success(128)  # the reference's strict `<` picks 256
    assert buckets.select_bucket(t, 256) == Success(256)
    assert buckets.select_bucket(t, 512) == Success(512)


def test_overflow_says_length_largest_bucket_and_fix() -> None:
    t = buckets.context_encoding_table(max_context_length=512, batch_size=1, enable_bucketing=True).unwrap()
    err = buckets.select_bucket(t, 600).failure()
    (p,) = err.problems
    assert p.field == "input_length" and p.value == "600"
    assert "600" in p.reason and "(512)" in p.reason and "context_encoding" in p.reason
    assert "max_context_length" in p.fix and "allow_input_truncation=True" in p.fix
    assert buckets.select_bucket(t, 600, allow_input_truncation=True) == Success(512)


def test_overflow_of_an_explicit_table_suggests_a_bucket() -> None:
    t = buckets.context_encoding_table(
        max_context_length=4096, batch_size=1, enable_bucketing=True, buckets=[1024]
    ).unwrap()
    (p,) = buckets.select_bucket(t, 2000).failure().problems
    assert "add a bucket >= 2000 to context_encoding_buckets" in p.fix


def test_speculation_adds_its_length() -> None:
    t = buckets.speculation_table(max_length=512, batch_size=1, enable_bucketing=True, speculation_length=5).unwrap()
    assert t.lengths == (128, 256, 512)
    assert buckets.select_bucket(t, 123) == Success(128)
    assert buckets.select_bucket(t, 124) == Success(256)
    assert "speculation_length=5" in buckets.select_bucket(t, 508).failure().problems[0].reason


def test_batch_buckets_are_ordered_and_selected() -> None:
    off = buckets.token_generation_table(max_length=1024, batch_size=4, enable_bucketing=False, batches=[2])
    assert off.unwrap().buckets_2d() == ((4, 1024), (2, 1024))
    t = buckets.token_generation_table(max_length=512, batch_size=8, enable_bucketing=True, batches=[1, 4]).unwrap()
    assert t.buckets_2d()[:4] == ((8, 128), (8, 256), (8, 512), (4, 128))
    assert buckets.select_batch_bucket(t, 3, 200) == Success((4, 256))
    assert buckets.select_batch_bucket(t, 1, 1) == Success((1, 128))
    err = buckets.select_batch_bucket(t, 9, 600).failure()
    assert err.fields() == {"batch_size", "input_length"}
    bad = buckets.token_generation_table(max_length=512, batch_size=2, enable_bucketing=True, batches=[4])
    assert isinstance(bad, Failure) and bad.failure().fields() == {"token_generation_batches"}


def test_one_token_prompt_reads_its_own_position() -> None:
    """The reference gathers argmax(position_ids) = 1 here, a padding slot; the plan records slot 0."""
    plan = padding.padding_plan([1], input_width=1, bucket=128).unwrap()
    positions = plan.pad_positions([0])
    assert positions[:3] == (0, 1, 1) and plan.last_token_index == (0,) and plan.last_position == (0,)
    assert plan.pad_ids([42])[:2] == (42, 0) and plan.pad_mask([1])[:2] == (1, 0)


def test_too_long_input_needs_truncation() -> None:
    assert padding.padding_plan([5], input_width=5, bucket=4).failure().fields() == {"input_ids"}
    cut = padding.padding_plan([5], input_width=5, bucket=4, allow_input_truncation=True).unwrap()
    assert cut.pad_ids([1, 2, 3, 4, 5]) == (1, 2, 3, 4) and cut.truncated == 1
    left = padding.padding_plan(
        [5], input_width=5, bucket=4, side=padding.PaddingSide.LEFT, allow_input_truncation=True
    )
    assert left.unwrap().pad_ids([1, 2, 3, 4, 5]) == (2, 3, 4, 5)


def test_smaller_batch_is_padded_sorted_and_reordered_back() -> None:
    (chunk,) = padding.batch_plan([2, 0], compiled_batch=4).unwrap().chunks
    assert chunk.seq_ids == (0, 1, 2, 3)
    assert chunk.source_rows == (1, 0, 0, 0)  # seq 0 <- row 1; pads repeat the first row
    assert chunk.is_pad == (False, True, False, True)
    assert chunk.output_rows == (2, 0)  # row 0 (seq 2) reads run row 2


def test_larger_batch_is_split_into_compiled_chunks() -> None:
    plan = padding.batch_plan([0, 1, 2, 3, 4], compiled_batch=2).unwrap()
    assert [c.user_rows for c in plan.chunks] == [(0, 1), (2, 3), (4,)]
    assert plan.chunks[-1].seq_ids == (4, 5) and plan.chunks[-1].is_pad == (False, True)

"""Properties of program keys and their names, and of fitting a batch to compiled batch sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.host import batching, forward_inputs
from nxdi.core.planning import buckets
from nxdi.core.planning.program_key import ProgramKey, program_keys, program_names

_keys = st.builds(
    ProgramKey,
    phase=st.sampled_from([Phase.CONTEXT, Phase.TOKEN]),
    length=st.integers(1, 4096),
    batch=st.integers(1, 8),
    tokens=st.integers(1, 4096),
)


@given(st.sets(_keys, max_size=12))
def test_names_are_unique_and_the_largest_batch_keeps_the_plain_name(keys: set[ProgramKey]) -> None:
    names = program_names(keys)
    assert set(names) == keys and len(set(names.values())) == len(keys)
    for key, name in names.items():
        largest = max(k.batch for k in keys if k.phase is key.phase)
        assert name.startswith(f"{key.phase.value}_{key.length}")
        assert name.endswith(f"_b{key.batch}") == (key.batch != largest)
        assert ("_t" in name) == (not key.default_tokens)


def test_names_of_a_model_without_batch_buckets_are_the_names_before_keys() -> None:
    keys = [ProgramKey.context(128, 4), ProgramKey.token(128, 4), ProgramKey.token(256, 4)]
    assert list(program_names(keys).values()) == [
        "context_encoding_128",
        "token_generation_128",
        "token_generation_256",
    ]
    block = ProgramKey(phase=Phase.CONTEXT, length=256, batch=1, tokens=128)  # new tokens over a prefix
    assert program_names([block, ProgramKey.context(256, 1)])[block] == "context_encoding_256_t128"


def test_keys_order_by_phase_then_length_batch_and_tokens() -> None:
    keys = [ProgramKey.token(64, 1), ProgramKey.token(64, 4), ProgramKey.context(128, 1), ProgramKey.token(32, 4)]
    assert sorted(keys) == [keys[2], keys[3], keys[0], keys[1]]
    with pytest.raises(ValueError, match="must be > 0"):
        ProgramKey.token(64, 0)


@given(st.sets(st.integers(1, 8), max_size=3), st.integers(1, 8), st.booleans())
def test_a_model_compiles_one_token_program_per_batch_and_length_bucket(
    batches: set[int], tkg: int, bucketing: bool
) -> None:
    given_batches = sorted(b for b in batches if b <= tkg) or None
    context = buckets.context_encoding_table(max_context_length=256, batch_size=2, enable_bucketing=bucketing)
    token = buckets.token_generation_table(
        max_length=512, batch_size=tkg, enable_bucketing=bucketing, batches=given_batches
    )
    keys = program_keys(context.unwrap(), token.unwrap())
    assert list(keys) == sorted(set(keys))
    table = token.unwrap()
    assert {(k.batch, k.length) for k in keys if k.phase is Phase.TOKEN} == set(table.buckets_2d())
    assert {k.batch for k in keys if k.phase is Phase.TOKEN} == {tkg, *(given_batches or ())}
    assert all(k.tokens == 1 for k in keys if k.phase is Phase.TOKEN)
    assert all(k.tokens == k.length and k.batch == 2 for k in keys if k.phase is Phase.CONTEXT)


# --- fitting a batch to the compiled batch sizes ---------------------------------------------------


@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=11, unique=True),
    st.sets(st.integers(1, 5), min_size=1, max_size=3),
    st.sets(st.integers(0, 10), max_size=4),
)
def test_plan_runs_covers_every_row_once_on_the_smallest_batch_that_holds_it(
    rows: list[int], sizes: set[int], repeated: set[int]
) -> None:
    """Some rows are masked (-1) or share a garbage row (10); every caller row runs once, its
    outputs come from a run row fed its inputs, and padding rows write nothing."""
    cache_rows = [-1 if i in repeated and i % 2 else 10 if i in repeated else r for i, r in enumerate(rows)]
    chunks = batching.plan_runs(cache_rows, sorted(sizes))
    largest = max(sizes)
    assert [r for c in chunks for r in c.user_rows] == list(range(len(rows)))
    for c in chunks:
        assert c.batch == min(b for b in sizes if b >= len(c.user_rows)) and len(c.user_rows) <= largest
        assert len(c.cache_rows) == len(c.source_rows) == c.batch
        for user, run in zip(c.user_rows, c.output_rows, strict=True):
            assert c.source_rows[run] == user and c.cache_rows[run] == cache_rows[user]
        pads = set(range(c.batch)) - set(c.output_rows)
        assert all(c.cache_rows[j] == -1 and c.source_rows[j] == c.user_rows[0] for j in pads)
        real = [r for r in c.cache_rows if r not in (-1, 10)]
        assert real == sorted(real), "seq_ids run sorted"
        assert c.in_order == (c.cache_rows == tuple(range(c.batch)))


# --- routing seq_ids (REFERENCE §6) -----------------------------------------------------------------


def _route(ids: list[int], *, garbage: int = 0, mask: bool = False) -> tuple[list[int], list[bool], list[str]]:
    limits = forward_inputs.Limits(vocab_size=10, cache_rows=4, max_length=8, garbage_rows=garbage, mask_seq_ids=mask)
    rows, routed, problems = forward_inputs.route_rows(torch.tensor(ids), limits, given=True)
    return rows.tolist(), routed.tolist(), [p.render() for p in problems]


def test_out_of_range_and_duplicate_seq_ids_go_to_the_garbage_rows_in_turn() -> None:
    rows, routed, problems = _route([0, 7, 2, 2, -3, 1], garbage=2)
    assert problems == []
    assert rows == [0, 4, 5, 4, 5, 1] and routed == [False, True, True, True, True, False]


def test_without_garbage_rows_the_problems_name_the_ids() -> None:
    _, _, problems = _route([0, 7, 2, 2, -3, 1])
    text = " ".join(problems)
    assert "[7]" in text and "[-3]" in text and "duplicate ids [2]" in text and "kv_cache_padding_size" in text


def test_a_masked_seq_id_writes_nowhere_and_other_negatives_still_count() -> None:
    rows, routed, problems = _route([-1, 3, -1], mask=True)
    assert problems == [] and rows == [-1, 3, -1] and routed == [True, False, True]
    _, _, problems = _route([-1, -2], mask=True)
    assert len(problems) == 1 and "[-2]" in problems[0]
    rows, routed, _ = _route([-1, -2, 0], mask=True, garbage=1)
    assert rows == [-1, 4, 0] and routed == [True, True, False]

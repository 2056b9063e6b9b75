"""Properties of GQA head counts and layouts and of the per-rank weight slices (plain Python lists, no torch)."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import gqa, sharding
from nxdi.testing.strategies.plans import head_configs, small_model_specs


def _counts(tp: int, q: int, kv: int, desired: gqa.GQAStrategy | None = None) -> gqa.HeadCounts:
    strategy, _ = gqa.determine_strategy(tp, kv, desired)
    return gqa.shardable_head_counts(tp, q, kv, strategy).unwrap()


@given(head_configs(), st.sampled_from([None, *gqa.GQAStrategy]))
def test_heads_per_rank_times_tp_is_the_padded_count(
    cfg: tuple[int, int, int], desired: gqa.GQAStrategy | None
) -> None:
    tp, q, kv = cfg
    c = _counts(tp, q, kv, desired)
    assert c.q_per_rank * tp == c.q_padded >= q and c.kv_per_rank * tp == c.kv_padded >= kv
    assert c.q_padded - q < tp and c.q_per_rank % c.kv_per_rank == 0


@given(head_configs(), st.sampled_from([None, *gqa.GQAStrategy]))
def test_layout_removes_to_the_original_heads(cfg: tuple[int, int, int], desired: gqa.GQAStrategy | None) -> None:
    tp, q, kv = cfg
    layout = gqa.head_layout(_counts(tp, q, kv, desired))
    assert [h for h in layout.q_sources if h is not None] == list(range(q))
    real_kv = [h for h in layout.kv_sources if h is not None]
    assert list(dict.fromkeys(real_kv)) == list(range(kv))  # replicas are adjacent copies, in order
    assert len(set(Counter(real_kv).values())) == 1  # every KV head is replicated equally often


@given(head_configs(), st.sampled_from([None, *gqa.GQAStrategy]))
def test_every_q_head_sits_with_its_kv_head(cfg: tuple[int, int, int], desired: gqa.GQAStrategy | None) -> None:
    tp, q, kv = cfg
    layout = gqa.head_layout(_counts(tp, q, kv, desired))
    c = layout.counts
    for rank in range(tp):
        qs, kvs = layout.rank_q_heads(rank), layout.rank_kv_heads(rank)
        for i, h in enumerate(qs):
            if h is not None:
                assert kvs[i // c.kv_groups] == h // (q // kv)


@given(head_configs())
def test_replicate_is_refused_only_when_tp_is_not_a_multiple_of_kv(cfg: tuple[int, int, int]) -> None:
    tp, q, kv = cfg
    result = gqa.shardable_head_counts(tp, q, kv, gqa.GQAStrategy.REPLICATE_TO_TP_DEGREE)
    needs_copies = kv < tp or kv % tp != 0 or (q == kv and q % tp != 0)
    assert isinstance(result, Failure) == (needs_copies and tp % kv != 0)


def _padded_layout(w: sharding.WeightShard) -> list[int | None]:
    assert w.dim is not None
    if w.remap is None:
        return list(range(w.shape[w.dim]))
    assert w.remap.dim == w.dim
    return list(w.remap.indices())


def _check_partition(w: sharding.WeightShard, tp: int, q_rows: int) -> None:
    if w.dim is None:
        assert w.rule is sharding.ShardRule.REPLICATED and w.padded_shape == w.shape
        assert all(spans == ((0, w.shape[0]),) for spans in w.rank_spans)
        return
    padded = _padded_layout(w)
    assert len(padded) == w.padded_shape[w.dim]
    pieces = sorted(span for spans in w.rank_spans for span in spans)
    assert pieces[0][0] == 0 and pieces[-1][1] == len(padded)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # tiles exactly, no overlap
    gathered = [i for a, b in pieces for i in padded[a:b]]
    assert gathered == padded
    if len(w.rank_spans[0]) == 1:  # not fused: rank order is layout order
        assert [i for spans in w.rank_spans for a, b in spans for i in padded[a:b]] == padded
    assert len({w.rank_numel(r) for r in range(tp)}) == 1
    if w.remap is None or w.remap.block == 1:  # plain zero padding: removing pads gives the original
        assert [i for i in padded if i is not None] == list(range(w.shape[w.dim]))
    else:  # head remaps: every original index appears; within Q, K and V, replicas equally often
        real = [i for i in padded if i is not None]
        assert sorted(set(real)) == list(range(w.shape[w.dim]))
        copies = Counter(real)
        for segment in _segments(w, q_rows):
            assert len({copies[i] for i in segment}) == 1


def _segments(w: sharding.WeightShard, q_rows: int) -> list[range]:
    """Index ranges of the checkpoint tensor replicated alike: Q, K and V of a fused QKV, else all of it."""
    assert w.dim is not None
    size = w.shape[w.dim]
    if ".Wqkv." not in w.name:
        return [range(size)]
    kv_rows = (size - q_rows) // 2
    return [range(q_rows), range(q_rows, q_rows + kv_rows), range(q_rows + kv_rows, size)]


@given(small_model_specs(), st.sampled_from([1, 2, 3, 4, 8, 16, 32]), st.booleans(), st.booleans())
def test_per_rank_slices_partition_every_weight(model: ModelSpec, tp: int, fused: bool, vocab_parallel: bool) -> None:
    plan = sharding.shard_plan(model, tp=tp, fused_qkv=fused, vocab_parallel=vocab_parallel).unwrap()
    names = [w.name for w in plan.weights]
    assert len(names) == len(set(names))
    assert "lm_head.weight" in names and "embed_tokens.weight" in names
    for w in plan.weights:
        _check_partition(w, tp, model.q_size)


@given(small_model_specs(), st.sampled_from([1, 2, 4, 8]))
def test_unpadded_plan_holds_the_checkpoint_once(model: ModelSpec, tp: int) -> None:
    """At tp=1 nothing is padded or replicated: ranks hold exactly the checkpoint (lm_head kept separately)."""
    plan = sharding.shard_plan(model, tp=1).unwrap()
    lm_head = model.vocab_size * model.hidden_size if model.tie_word_embeddings else 0
    assert plan.rank_params() == model.num_params() + lm_head
    bigger = sharding.shard_plan(model, tp=tp).unwrap()
    assert bigger.rank_params() * tp >= plan.rank_params()


@given(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 3, 24]), st.lists(st.integers(1, 4096), min_size=1, max_size=6))
def test_sequence_parallel_needs_every_bucket_divisible(tp: int, lengths: list[int]) -> None:
    result = sharding.check_sequence_parallel(tp, lengths)
    assert isinstance(result, Success) == all(b % tp == 0 for b in lengths)

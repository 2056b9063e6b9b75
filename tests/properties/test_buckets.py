"""Properties of bucket tables, bucket selection, padding plans and batch plans."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.config.sub_specs import ChunkedPrefillSpec
from nxdi.core.planning import block_buckets, buckets, padding
from nxdi.testing.strategies.plans import bucket_tables


@given(st.integers(min_value=1, max_value=1 << 20))
def test_auto_tables_are_sorted_unique_and_cover_the_max(max_length: int) -> None:
    lengths = buckets.auto_lengths(max_length)
    assert list(lengths) == sorted(set(lengths))
    assert lengths[-1] == max_length
    # no power of two from 128 up to (excluding) the maximum is skipped
    powers = [1 << i for i in range(7, 21) if 128 <= 1 << i < max_length]
    assert [b for b in lengths[:-1]] == powers


@given(st.integers(min_value=1, max_value=1 << 16), st.booleans(), st.integers(min_value=1, max_value=16))
def test_tables_for_every_kind_cover_their_max(limit: int, bucketing: bool, batch: int) -> None:
    for table in (
        buckets.context_encoding_table(max_context_length=limit, batch_size=batch, enable_bucketing=bucketing),
        buckets.token_generation_table(max_length=limit, batch_size=batch, enable_bucketing=bucketing),
        buckets.speculation_table(max_length=limit, batch_size=batch, enable_bucketing=bucketing, speculation_length=3),
    ):
        t = table.unwrap()
        assert t.largest == limit and list(t.lengths) == sorted(set(t.lengths))


@given(st.lists(st.integers(min_value=-5, max_value=5000), max_size=8), st.integers(min_value=1, max_value=4096))
def test_explicit_tables_are_sorted_or_fail_naming_the_field(values: list[int], limit: int) -> None:
    result = buckets.check_lengths(values, limit=limit, field="context_encoding_buckets", limit_field="max")
    valid = bool(values) and len(set(values)) == len(values) and all(0 < v <= limit for v in values)
    match result:
        case Success(lengths):
            assert valid and list(lengths) == sorted(values)
        case Failure(err):
            assert not valid and err.fields() == {"context_encoding_buckets"}


@given(bucket_tables(), st.integers(min_value=1, max_value=1 << 17))
def test_select_bucket_returns_the_smallest_fit_or_a_failure(table: buckets.BucketTable, n: int) -> None:
    required = n + table.extra_tokens
    match buckets.select_bucket(table, n):
        case Success(b):
            assert required <= b and b in table.lengths
            assert all(x < required for x in table.lengths if x < b)
        case Failure(err):
            assert required > table.largest
            (problem,) = err.problems
            assert problem.field == "input_length" and str(table.largest) in problem.reason
            assert "allow_input_truncation" in problem.fix


@given(bucket_tables(), st.integers(min_value=1, max_value=1 << 17))
def test_truncation_always_selects_a_bucket(table: buckets.BucketTable, n: int) -> None:
    b = buckets.select_bucket(table, n, allow_input_truncation=True).unwrap()
    assert b == min((x for x in table.lengths if n + table.extra_tokens <= x), default=table.largest)


@given(bucket_tables(), st.integers(min_value=1, max_value=80), st.integers(min_value=1, max_value=1 << 17))
def test_2d_selection_takes_the_smallest_batch_then_the_smallest_length(
    table: buckets.BucketTable, batch: int, n: int
) -> None:
    pairs = table.buckets_2d()
    assert [b for b, _ in pairs] == sorted((b for b, _ in pairs), reverse=True)
    match buckets.select_batch_bucket(table, batch, n):
        case Success((b, s)):
            fitting = [(bb, ss) for bb, ss in pairs if batch <= bb and n + table.extra_tokens <= ss]
            assert (b, s) == min(fitting)
        case Failure(err):
            assert batch > table.batch_sizes[0] or n + table.extra_tokens > table.largest
            assert err.fields() <= {"batch_size", "input_length"}


@st.composite
def padded_inputs(draw: st.DrawFn) -> tuple[list[int], int, int, padding.PaddingSide]:
    width = draw(st.integers(min_value=1, max_value=40))
    lengths = draw(st.lists(st.integers(min_value=1, max_value=width), min_size=1, max_size=5))
    bucket = draw(st.integers(min_value=width, max_value=width + 40))
    return lengths, width, bucket, draw(st.sampled_from(list(padding.PaddingSide)))


@given(padded_inputs())
def test_padding_keeps_real_tokens_and_finds_the_last_one(
    case: tuple[list[int], int, int, padding.PaddingSide],
) -> None:
    lengths, width, bucket, side = case
    plan = padding.padding_plan(lengths, input_width=width, bucket=bucket, side=side, pad_token_id=7).unwrap()
    for i, n in enumerate(lengths):
        pads = width - n
        real = [100 + j for j in range(n)]
        ids = real + [7] * pads if side is padding.PaddingSide.RIGHT else [7] * pads + real
        mask = [int(t != 7) for t in ids]
        positions = list(range(n)) + [1] * pads if side is padding.PaddingSide.RIGHT else [1] * pads + list(range(n))
        out_ids, out_mask = plan.pad_ids(ids), plan.pad_mask(mask)
        out_pos = plan.pad_positions(positions)
        assert len(out_ids) == len(out_mask) == len(out_pos) == bucket
        assert [t for t in out_ids if t != 7] == real and sum(out_mask) == n
        last = plan.last_token_index[i]
        assert out_ids[last] == real[-1] and out_mask[last] == 1
        assert out_pos[last] == plan.last_position[i] == n - 1


@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12, unique=True), st.integers(1, 6))
def test_batch_plans_cover_every_row_once_and_restore_the_order(seq_ids: list[int], compiled: int) -> None:
    plan = padding.batch_plan(seq_ids, compiled_batch=compiled).unwrap()
    covered = [r for c in plan.chunks for r in c.user_rows]
    assert covered == list(range(len(seq_ids)))
    for c in plan.chunks:
        assert len(c.seq_ids) == compiled and list(c.seq_ids) == sorted(set(c.seq_ids))
        pad_ids = {s for s, p in zip(c.seq_ids, c.is_pad, strict=True) if p}
        assert not pad_ids & set(seq_ids)
        for user_row, run_row in zip(c.user_rows, c.output_rows, strict=True):
            assert c.seq_ids[run_row] == seq_ids[user_row] and c.source_rows[run_row] == user_row
            assert not c.is_pad[run_row]
        assert all(c.source_rows[j] == c.user_rows[0] for j, p in enumerate(c.is_pad) if p)


@given(st.lists(st.integers(min_value=-3, max_value=5), min_size=1, max_size=8))
def test_batch_plans_reject_duplicate_or_negative_ids(seq_ids: list[int]) -> None:
    ok = len(set(seq_ids)) == len(seq_ids) and min(seq_ids) >= 0
    assert isinstance(padding.batch_plan(seq_ids, compiled_batch=4), Success) == ok


# --- block KV: prefix caching and chunked prefill (block_buckets) -------------------------------

_sizes = st.sets(st.integers(min_value=1, max_value=4096), min_size=1, max_size=6).map(lambda s: tuple(sorted(s)))


@st.composite
def prefix_tables(draw: st.DrawFn) -> block_buckets.PrefixTable:
    """Valid prefix-caching tables: CTE (prefix starting at 0, sometimes with a (512, 0) bucket) or TKG."""
    kind = draw(st.sampled_from([Phase.CONTEXT, Phase.TOKEN]))
    active = (1,) if kind is Phase.TOKEN else tuple(sorted({*draw(_sizes), *draw(st.sampled_from([(), (512,)]))}))
    prefix = draw(_sizes)
    if kind is Phase.CONTEXT:
        prefix = (0, *prefix)
    return block_buckets.PrefixTable(kind=kind, active=active, prefix=prefix, max_length=max(*active, *prefix))


def _fits(table: block_buckets.PrefixTable, active: int, prefix: int) -> list[tuple[int, int]]:
    if table.kind is Phase.CONTEXT:  # cached tokens beyond the prefix bucket are recomputed in the prefill
        return [(a, p) for a, p in table.buckets() if active <= a and active + prefix <= a + p]
    return [(a, p) for a, p in table.buckets() if active <= a and prefix + active <= p]


_active = st.integers(min_value=1, max_value=5000)
_prefix = st.integers(min_value=0, max_value=9000)


@given(prefix_tables(), _active, _prefix)
def test_prefix_selection_returns_the_smallest_fit_or_a_failure(
    table: block_buckets.PrefixTable, active: int, prefix: int
) -> None:
    fits = _fits(table, active, prefix)
    match block_buckets.select_prefix_bucket(table, active, prefix, recompute_short_contexts=False):
        case Success(bucket):
            assert bucket == min(fits) and bucket in table.buckets()
        case Failure(err):
            assert not fits and err.problems
            assert err.fields() <= {"prefill_length", "active_length", "prefix_length"}
            assert all(p.fix for p in err.problems)


@given(prefix_tables(), _active, _prefix)
def test_short_contexts_take_the_512_bucket_else_the_smallest_fit(
    table: block_buckets.PrefixTable, active: int, prefix: int
) -> None:
    plain = block_buckets.select_prefix_bucket(table, active, prefix, recompute_short_contexts=False)
    chosen = block_buckets.select_prefix_bucket(table, active, prefix)
    short = table.kind is Phase.CONTEXT and 256 < active + prefix <= 512 and (512, 0) in table.buckets()
    assert chosen == (Success((512, 0)) if short else plain)


@given(prefix_tables(), _active, _prefix)
def test_prefix_truncation_always_selects_a_compiled_bucket(
    table: block_buckets.PrefixTable, active: int, prefix: int
) -> None:
    bucket = block_buckets.select_prefix_bucket(table, active, prefix, allow_input_truncation=True).unwrap()
    assert bucket in table.buckets()


_bucket_lists = st.none() | st.lists(st.integers(min_value=-2, max_value=5000), max_size=5)


@given(st.integers(min_value=1, max_value=1 << 14), st.booleans(), _bucket_lists, _bucket_lists, _bucket_lists)
def test_prefix_tables_respect_their_limits_or_name_the_field(
    limit: int, bucketing: bool, prefill: list[int] | None, prefixes: list[int] | None, tokens: list[int] | None
) -> None:
    ctx = block_buckets.prefix_context_table(
        max_context_length=limit, enable_bucketing=bucketing, prefill_buckets=prefill, prefix_buckets=prefixes
    )
    match ctx:
        case Success(t):
            assert t.prefix[0] == 0 and max(*t.active, *t.prefix) <= limit
            if not bucketing or prefill is None:
                assert t.active[-1] == limit
        case Failure(err):
            assert bucketing and err.fields() <= {"context_encoding_buckets", "prefix_buckets"}
    match block_buckets.prefix_token_table(max_length=limit, enable_bucketing=bucketing, token_buckets=tokens):
        case Success(t):
            assert t.active == (1,) and t.prefix[-1] <= limit
            if not bucketing or tokens is None:
                assert t.prefix[-1] == limit and (not bucketing or t.prefix[0] == min(256, limit))
        case Failure(err):
            assert bucketing and err.fields() == {"token_generation_buckets"}


@st.composite
def chunked_tables(draw: st.DrawFn) -> block_buckets.ChunkedPrefillTable:
    q = draw(st.sampled_from([1, 16, 128, 256]))
    config = ChunkedPrefillSpec(
        max_num_seqs=draw(st.integers(min_value=1, max_value=16)),
        kernel_q_tile_size=q,
        kernel_kv_tile_size=draw(st.sampled_from([128, 512, 1024])),
    )
    max_ctx = draw(st.integers(min_value=1, max_value=8192))
    max_len = draw(st.integers(min_value=max_ctx, max_value=16384))
    table = block_buckets.chunked_prefill_table(
        max_context_length=max_ctx, max_length=max_len, enable_bucketing=draw(st.booleans()), config=config
    ).unwrap()
    # every bucket stays inside its limits: chunks are q-tile multiples up to max_ctx rounded up
    # to a tile (or max_ctx itself without bucketing), tiles at most the whole tile grid
    assert table.tiles[-1] == table.max_num_tiles
    assert all(c % q == 0 or c == max_ctx for c in table.chunks)
    assert table.chunks[-1] in (max_ctx, -(-max_ctx // q) * q)
    return table


@given(chunked_tables(), st.integers(min_value=1, max_value=10000), st.integers(min_value=0, max_value=3000))
def test_chunked_selection_returns_the_smallest_fit_or_a_failure(
    table: block_buckets.ChunkedPrefillTable, chunk: int, tiles: int
) -> None:
    fits = [(c, t) for c, t in table.buckets() if chunk <= c and tiles <= t]
    match block_buckets.select_chunked_bucket(table, chunk, tiles):
        case Success(bucket):
            assert bucket == min(fits)
        case Failure(err):
            assert not fits and err.fields() <= {"chunk_length", "num_tiles"}

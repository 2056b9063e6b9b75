"""Host-side batching (`nxdi.core.host.batching`): per-token outputs go back to the caller's columns
and chunk outputs back to the caller's rows."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from nxdi.core.host import batching


@st.composite
def masked_ids(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, W] (1..99) and a 0/1 mask of any padding pattern."""
    b, w = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    ids = draw(st.lists(st.integers(1, 99), min_size=b * w, max_size=b * w))
    mask = draw(st.lists(st.integers(0, 1), min_size=b * w, max_size=b * w))
    return torch.tensor(ids).view(b, w), torch.tensor(mask).view(b, w)


@given(given_ids=masked_ids(), bucket=st.integers(1, 10))
def test_uncompact_returns_each_real_tokens_value_to_its_column(
    given_ids: tuple[torch.Tensor, torch.Tensor], bucket: int
) -> None:
    """A per-token output of the compacted rows (here the token id itself, in a bucket that may cut
    rows short) comes back at the token's own column; padding and cut tokens read the fill."""
    ids, mask = given_ids
    compacted, lengths = batching.compact(ids, mask)
    x = batching.context_inputs(compacted, lengths, bucket=bucket)
    per_token = torch.stack((x.input_ids, -x.input_ids))[..., None]  # [L=2, B, S, 1]
    got = batching.uncompact(per_token, mask, fill=0)
    kept = mask.bool() & (mask.cumsum(1) <= bucket)
    want = torch.where(kept, ids, 0)
    assert got.shape == (2, *ids.shape, 1)
    assert torch.equal(got[0, ..., 0], want) and torch.equal(got[1, ..., 0], -want)


@given(rows=st.permutations(range(5)), split=st.integers(0, 5))
def test_gather_rows_puts_every_chunks_rows_back_in_the_callers_order(rows: list[int], split: int) -> None:
    values = torch.arange(5)[:, None] * 10 + torch.arange(3)  # [B, 3]: row r holds r*10 + j
    parts = [(rows[:split], values[rows[:split]]), (rows[split:], values[rows[split:]])]
    assert torch.equal(batching.gather_rows([p for p in parts if p[0]], 5), values)
    transposed = [(r, v.T) for r, v in parts if r]  # the rows along dim 1
    assert torch.equal(batching.gather_rows(transposed, 5, dim=1), values.T)


@given(
    rows=st.lists(st.integers(-1, 6), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
)
def test_a_chunk_carrying_the_whole_batch_maps_every_row_to_itself(rows: list[int], sizes: list[int]) -> None:
    """`carries_all` (the caller then skips every gather) only where the chunk's rows are the
    caller's, in order and unpadded; the remembered plan is the plan."""
    chunks = batching.plan_runs(rows, sizes)
    assert chunks == batching._plan_runs.__wrapped__(tuple(rows), tuple(sizes))
    for chunk in chunks:
        if chunk.carries_all(len(rows)):
            assert len(chunks) == 1 and chunk.batch == len(rows)
            same = tuple(range(len(rows)))
            assert chunk.source_rows == chunk.output_rows == chunk.user_rows == same
    values = torch.arange(len(rows) * 2).view(len(rows), 2)
    assert batching.gather_rows([(range(len(rows)), values)], len(rows)) is values

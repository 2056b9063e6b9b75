"""The host checks and layout of a serving client's block-KV arguments (nxdi.core.host.block_inputs)."""

from __future__ import annotations

import torch
from returns.result import Failure, Success

from nxdi.core.host import block_inputs
from nxdi.core.host.block_inputs import BlockLimits

LIMITS = BlockLimits(num_blocks=8, block_size=4, max_length=32, vocab_size=100)


def _problems(result: object) -> str:
    assert isinstance(result, Failure), result
    return str(result.failure())


def test_a_prefix_cache_hit_computes_only_the_new_tokens() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    got = block_inputs.row_segments(
        ids,
        torch.arange(6)[None],
        slot_mapping=torch.tensor([[13, 16, -1, -1]]),
        block_table=torch.tensor([[2, 4, 0, 0]]),
        full_context_lens=torch.tensor([[6]]),
        computed_context_lens=torch.tensor([[4]]),
        limits=LIMITS,
    )
    # positions 4 and 5 live in block 4 (the table's second entry): slots 16 and 17
    assert "slot_mapping[0]" in _problems(got) and "position 5: 16 (its block table says 17)" in _problems(got)
    good = block_inputs.row_segments(
        ids,
        torch.arange(6)[None],
        slot_mapping=torch.tensor([[16, 17, -1, -1]]),
        block_table=torch.tensor([[2, 4, 0, 0]]),
        full_context_lens=torch.tensor([[6]]),
        computed_context_lens=torch.tensor([[4]]),
        limits=LIMITS,
    )
    assert isinstance(good, Success)
    seg = good.unwrap()
    assert seg.tokens == ((9, 10),) and seg.computed == (4,) and seg.slots == ((16, 17),)
    assert seg.first_column == (4,), "a prefill row's columns are its positions"
    x, b = block_inputs.as_rows(seg, batch=2, tokens=4, blocks=2)
    assert x.input_ids.tolist() == [[9, 10, 0, 0], [0, 0, 0, 0]]
    assert x.position_ids[0, :2].tolist() == [4, 5]
    assert b.slot_mapping.tolist() == [[16, 17, -1, -1], [-1, -1, -1, -1]]
    assert b.segment.tolist() == [[0, 0, -1, -1], [-1, -1, -1, -1]]
    assert b.out_index.tolist() == [[1], [0]] and b.computed.tolist() == [[4], [0]]


def test_every_problem_is_listed() -> None:
    got = block_inputs.row_segments(
        torch.tensor([[1], [2]]),
        torch.tensor([[5], [40]]),
        slot_mapping=torch.tensor([[21], [0]]),
        block_table=torch.tensor([[0, 9], [1, 2]]),
        full_context_lens=None,
        computed_context_lens=None,
        limits=LIMITS,
    )
    text = _problems(got)
    assert "block_table[0]" in text and "outside 0..7 (pa_num_blocks)" in text
    assert "full_context_lens[1]" in text and "past max_length=32" in text


def test_chunked_prefill_splits_the_row_by_request() -> None:
    seg = block_inputs.chunked_segments(
        torch.tensor([[1, 2, 3, 4, 5]]),
        slot_mapping=torch.tensor([8, 9, 10, 4, 5]),
        block_table=torch.tensor([[2, 0], [1, 0]]),
        full_context_lens=torch.tensor([3, 2]),
        computed_context_lens=torch.tensor([0, 0]),
        limits=LIMITS,
    ).unwrap()
    assert seg.tokens == ((1, 2, 3), (4, 5))
    assert seg.first_column == (0, 3)
    x, b = block_inputs.as_chunks(seg, segments=3, tokens=8, blocks=1)
    assert b.segment.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
    assert b.out_index.tolist() == [[2, 4, 0]]
    assert x.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    bad = block_inputs.chunked_segments(
        torch.tensor([[1, 2, 3]]),
        slot_mapping=torch.tensor([8, 9, 10]),
        block_table=torch.tensor([[2, 0], [1, 0]]),
        full_context_lens=torch.tensor([3, 2]),
        computed_context_lens=torch.tensor([0, 0]),
        limits=LIMITS,
    )
    assert "add up to 5" in _problems(bad)


def test_per_token_outputs_go_back_to_the_callers_columns() -> None:
    """Row 0 is a prefill whose client cached 3 tokens, run from position 1 (2 computed again:
    not reported); row 1 a one-token prompt. Every other column holds the fill."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]])
    table = torch.tensor([[2, 4], [3, 0]])

    def segments(max_prefix: int | None) -> block_inputs.Segments:
        return block_inputs.row_segments(
            ids,
            torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]),
            slot_mapping=torch.tensor([[11, 16], [12, -1]]),
            block_table=table,
            full_context_lens=torch.tensor([5, 1]),
            computed_context_lens=torch.tensor([3, 0]),
            limits=LIMITS,
            max_prefix=max_prefix,
        ).unwrap()

    asked, ran = segments(None), segments(1)
    assert asked.first_column == (3, 0) and ran.first_column == (1, 0)
    assert ran.tokens == ((6, 7, 8, 9), (4,))
    t = torch.arange(1, 1 + 2 * 4, dtype=torch.float32).reshape(1, 2, 4, 1)  # [L, B, S, 1]
    out = block_inputs.in_caller_columns(t, ran, asked=asked, width=5, fill=-1.0)
    assert out.shape == (1, 2, 5, 1)
    assert out[0, :, :, 0].tolist() == [[-1, -1, -1, 3, 4], [5, -1, -1, -1, -1]]
    same = block_inputs.in_caller_columns(t, ran, asked=ran, width=5, fill=0.0)
    assert same[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]

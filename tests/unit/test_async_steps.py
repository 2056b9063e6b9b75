"""async_mode's prediction of the next decode call (nxdi.core.host.async_steps)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from nxdi.core.host.async_steps import next_decode, same_call

T = torch.tensor


def _decode(**extra: Any) -> dict[str, Any]:
    return {"input_ids": T([[5], [6]]), "position_ids": T([[3], [7]]), "seq_ids": T([2, 0]), **extra}


def test_a_decode_predicts_its_tokens_one_position_further_on_the_same_rows() -> None:
    params = T([[1.0, 1.0, 1.0]] * 2)
    call = _decode(sampling_params=params, attention_mask=T([[1, 1, 1, 1], [1, 1, 1, 1]]))
    nxt = next_decode(call, T([9, 4]), max_length=64, block_size=None)
    assert nxt is not None
    assert nxt["input_ids"].tolist() == [[9], [4]] and nxt["input_ids"].dtype == torch.int64
    assert nxt["position_ids"].tolist() == [[4], [8]]
    assert nxt["attention_mask"].shape == (2, 5) and bool(nxt["attention_mask"][:, -1].eq(1).all())
    assert torch.equal(nxt["seq_ids"], call["seq_ids"]) and torch.equal(nxt["sampling_params"], params)
    assert nxt["seq_ids"] is not call["seq_ids"], "a copy: the caller may reuse its buffers"


def test_calls_that_are_not_one_token_decodes_are_not_predicted() -> None:
    tokens = T([9, 4])
    assert next_decode(_decode(), None, max_length=64, block_size=None) is None, "no on-device tokens"
    assert next_decode(_decode(position_ids=None), tokens, max_length=64, block_size=None) is None
    assert next_decode(_decode(position_ids=T([[0], [7]])), tokens, max_length=64, block_size=None) is None
    prompt = _decode(input_ids=T([[5, 6], [6, 7]]), position_ids=T([[3, 4], [7, 8]]))
    assert next_decode(prompt, tokens, max_length=64, block_size=None) is None, "several tokens per row"
    assert next_decode(_decode(), tokens, max_length=8, block_size=None) is None, "position 8 does not exist"
    assert next_decode(_decode(), tokens, max_length=9, block_size=None) is not None
    floats = _decode(input_ids=T([[5.0], [6.0]]))
    assert next_decode(floats, tokens, max_length=64, block_size=None) is None


def test_block_slots_move_to_the_next_slot_of_the_same_block_only() -> None:
    call = _decode(slot_mapping=T([[13], [-1]]), block_table=T([[3, 1], [0, 0]]), full_context_lens=T([[4], [8]]))
    nxt = next_decode(call, T([9, 4]), max_length=64, block_size=4)
    assert nxt is not None
    assert nxt["slot_mapping"].tolist() == [[14], [-1]], "padding (-1) stays"
    assert nxt["full_context_lens"].tolist() == [[5], [9]] and torch.equal(nxt["block_table"], call["block_table"])
    at_block_end = _decode(slot_mapping=T([[15], [2]]), block_table=T([[3, 1], [0, 0]]))
    assert next_decode(at_block_end, T([9, 4]), max_length=64, block_size=4) is None


def test_chunked_calls_are_predicted_only_when_every_request_decodes() -> None:
    call = {
        "input_ids": T([[5, 6]]),
        "position_ids": T([[3, 9]]),
        "slot_mapping": T([13, 21]),
        "block_table": T([[3], [5]]),
        "full_context_lens": T([4, 10]),
        "computed_context_lens": T([3, 9]),
    }
    nxt = next_decode(call, T([7, 8]), max_length=64, block_size=4, chunked=True)
    assert nxt is not None and nxt["input_ids"].tolist() == [[7, 8]] and nxt["slot_mapping"].tolist() == [14, 22]
    chunk = {**call, "computed_context_lens": T([3, 8])}
    assert next_decode(chunk, T([7, 8]), max_length=64, block_size=4, chunked=True) is None


def test_same_call_compares_values_not_objects() -> None:
    assert same_call(_decode(), _decode())
    assert same_call(_decode(seq_ids=T([2, 0], dtype=torch.int32)), _decode())
    assert same_call(_decode(seq_ids=[2, 0]), _decode())
    assert not same_call(_decode(seq_ids=None), _decode())
    assert not same_call(_decode(input_ids=T([[5], [7]])), _decode())
    assert not same_call(_decode(input_ids=T([5, 6])), _decode()), "another shape"
    assert not same_call(_decode(sampling_params=T([[1.0, 1.0, 0.5]])), _decode(sampling_params=T([[1.0, 1.0, 1.0]])))
    assert not same_call(_decode(seq_ids=T([2.0, 0.0])), _decode()), "float is not the integer call"


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 99)), min_size=1, max_size=6),
    st.integers(0, 1),
)
def test_a_prediction_is_the_decode_a_loop_makes_next(rows: list[tuple[int, int]], block: int) -> None:
    """Fed its tokens at the next positions, a loop's next call is the prediction (a block client's
    slots advance by one); changing any one value makes it another call."""
    positions = T([[p] for p, _ in rows])
    tokens = T([t for _, t in rows])
    call: dict[str, Any] = {
        "input_ids": tokens[:, None] + 1,
        "position_ids": positions,
        "seq_ids": torch.arange(len(rows)),
    }
    if block:
        call["slot_mapping"] = positions + 128  # block 2 of 64 slots: the next slot stays in it
    nxt = next_decode(call, tokens, max_length=42, block_size=64 if block else None)
    assert nxt is not None
    loop = {"input_ids": tokens[:, None], "position_ids": positions + 1, "seq_ids": torch.arange(len(rows))}
    if block:
        loop["slot_mapping"] = positions + 129
    assert same_call(nxt, loop)
    other = dict(loop, input_ids=loop["input_ids"] + 1)
    assert not same_call(nxt, other)

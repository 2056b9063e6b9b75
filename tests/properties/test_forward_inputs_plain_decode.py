"""`check_forward_inputs`' plain-decode path (Python ints, for a decode loop's steps) gives exactly
what the full check gives, and steps aside for everything else."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Success

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.host import forward_inputs as fi

LIMITS = fi.Limits(vocab_size=50, cache_rows=4, max_length=16, garbage_rows=1, mask_seq_ids=True)


@st.composite
def decode_calls(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """ids and positions [B, 1], seq_ids or None, and the tokens each cache row holds: mostly
    valid decode steps, with every kind of bad value mixed in (out of vocabulary, position 0, a
    gap, past max_length, rows out of range, repeated or -1, an empty row)."""
    b = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(-2, 52), min_size=b, max_size=b))
    cached = draw(st.lists(st.integers(0, 17), min_size=4, max_size=4))
    rows = draw(st.none() | st.lists(st.integers(-1, 5), min_size=b, max_size=b))
    positions = draw(st.lists(st.integers(0, 18), min_size=b, max_size=b))
    seq = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    return torch.tensor(ids).view(b, 1), torch.tensor(positions).view(b, 1), seq, cached


def _same(a: fi.ForwardInputs, b: fi.ForwardInputs) -> bool:
    fields = ("input_ids", "attention_mask", "position_ids", "seq_ids", "cache_rows", "routed")
    tensors = all(
        getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f)) for f in fields
    )
    return tensors and a.phase is b.phase


@given(call=decode_calls())
def test_the_plain_path_gives_the_full_checks_result_wherever_it_answers(
    call: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]],
) -> None:
    ids, positions, seq, cached = call
    plain = fi._plain_decode(ids, None, positions, seq, LIMITS, cached)
    with mock.patch.object(fi, "_plain_decode", return_value=None):  # the full check alone
        full = fi.check_forward_inputs(ids, None, positions, seq, limits=LIMITS, cached=cached)
    if plain is not None:
        assert isinstance(full, Success), f"the plain path accepted a call the full check refuses: {full}"
        assert _same(plain, full.unwrap())
    checked = fi.check_forward_inputs(ids, None, positions, seq, limits=LIMITS, cached=cached)
    assert type(checked) is type(full)
    if isinstance(full, Success):
        assert _same(checked.unwrap(), full.unwrap())
    else:
        assert checked.failure() == full.failure()  # the same problems, worded the same


def test_a_decode_loops_step_takes_the_plain_path_and_other_calls_do_not() -> None:
    ids, positions, cached = torch.tensor([[3], [7]]), torch.tensor([[5], [2]]), [5, 2, 0, 0]
    plain = fi._plain_decode(ids, None, positions, None, LIMITS, cached)
    assert plain is not None and plain.phase is Phase.TOKEN
    assert plain.cache_rows.tolist() == [0, 1] and plain.attention_mask.tolist() == [[1], [1]]
    seq = torch.tensor([2, 0])
    assert fi._plain_decode(ids, None, torch.tensor([[1], [5]]), seq, LIMITS, [5, 0, 1, 0]) is not None
    # A mask, a prefill, two tokens per row, int32 ids, a row holding nothing: the full check's.
    assert fi._plain_decode(ids, torch.ones(2, 6), positions, None, LIMITS, cached) is None
    assert fi._plain_decode(ids, None, torch.tensor([[0], [2]]), None, LIMITS, cached) is None
    assert fi._plain_decode(torch.tensor([[3, 4]]), None, torch.tensor([[5, 6]]), None, LIMITS, cached) is None
    assert fi._plain_decode(ids.to(torch.int32), None, positions, None, LIMITS, cached) is None
    assert fi._plain_decode(ids, None, positions, None, LIMITS, [5, 0, 0, 0]) is None

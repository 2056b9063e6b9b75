"""What forward() accepts, as a serving client calls it: every input either means what it says (and
matches transformers) or is refused before any work with IncompatibleConfigError (a ValueError)
naming the argument, the row and the value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.engine_fixtures import PROMPTS, hf_logits, padded, program_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 160
"""The tiny checkpoints' vocabulary."""


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return bool((ours - theirs).abs().max() <= 1e-4 * theirs.abs().max())


@pytest.fixture
def model(loaded_model: Callable[..., Any]) -> Any:
    m = loaded_model("llama", batch_size=2)
    m.reset()
    return m


def refused(model: Any, match: str, *args: Any, **kwargs: Any) -> IncompatibleConfigError:
    """The call raises IncompatibleConfigError matching `match`, and runs nothing."""
    with program_calls(model) as calls, pytest.raises(IncompatibleConfigError, match=match) as caught:
        model.forward(*args, **kwargs)
    assert calls == []
    return caught.value


# --- positions are honoured or refused ---------------------------------------------------------


def test_a_prefill_with_positions_that_skip_is_refused_naming_row_expected_and_given(model: Any) -> None:
    ids = torch.tensor([PROMPTS[0]])
    skipping = torch.tensor([[0, *range(100, 109)]])
    refused(model, r"position_ids\[0\].*positions 0..9, not \[0, 100, 101", ids, position_ids=skipping)
    mixed = torch.tensor([[0, 1, 2], [5, 6, 7]])  # row 1 is not a prefill, in a prefill call
    error = refused(model, r"position_ids\[1\]", torch.tensor([[3, 4, 5], [6, 7, 8]]), position_ids=mixed)
    assert "position_ids[0]" not in str(error)


def test_a_decode_that_leaves_a_gap_is_refused_and_one_that_rewinds_is_honoured(
    model: Any, tiny_model: Callable[[str], Any]
) -> None:
    prompt = list(PROMPTS[0][:8])
    model.forward(torch.tensor([prompt]))
    refused(
        model,
        r"position_ids\[0\]=18: row 0 decodes at position 18, but cache row seq_id=0 holds 8 tokens.*expected position is 8",
        torch.tensor([[5]]),
        position_ids=torch.tensor([[18]]),
    )
    hf = tiny_model("llama")
    at_8 = model.forward(torch.tensor([[5]]), position_ids=torch.tensor([[8]])).logits[0, -1]
    assert close(at_8, hf_logits(hf, [*prompt, 5])[-1])
    # Position 5 rewinds the row: the token replaces what was at 5, later entries are not attended.
    at_5 = model.forward(torch.tensor([[6]]), position_ids=torch.tensor([[5]])).logits[0, -1]
    assert close(at_5, hf_logits(hf, [*prompt[:5], 6])[-1])
    refused(model, r"holds 6 tokens", torch.tensor([[5]]), position_ids=torch.tensor([[7]]))


def test_a_decode_on_a_row_with_nothing_cached_is_refused(loaded_model: Callable[..., Any]) -> None:
    fresh = loaded_model("llama", batch_size=2, fresh=True)
    refused(fresh, r"seq_id=0, which holds nothing", torch.tensor([[5]]), position_ids=torch.tensor([[4]]))
    fresh.forward(torch.tensor([PROMPTS[0]]), seq_ids=torch.tensor([1]))
    refused(
        fresh,
        r"seq_id=0, which holds nothing",
        torch.tensor([[5], [6]]),
        position_ids=torch.tensor([[3], [10]]),
        seq_ids=torch.tensor([0, 1]),
    )
    fresh.forward(torch.tensor([[6]]), position_ids=torch.tensor([[10]]), seq_ids=torch.tensor([1]))


# --- ids, shapes and dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([[1.0, 5.0, 7.5]]),
        torch.tensor([[True, False, True]]),
        torch.tensor([[1 + 0j, 5 + 0j]]),
        [[1.5, 2.0]],
    ],
    ids=["float", "bool", "complex", "float-list"],
)
def test_non_integer_input_ids_are_refused_not_truncated(model: Any, ids: Any) -> None:
    refused(model, r"input_ids=.*must hold integers \(it would be truncated silently\)", ids)


def test_float_seq_ids_are_refused(model: Any) -> None:
    refused(
        model, r"seq_ids='torch.float32': must hold integers", torch.tensor([PROMPTS[0]]), seq_ids=torch.tensor([0.7])
    )


def test_ids_outside_the_vocabulary_are_refused_but_padding_columns_may_hold_anything(
    model: Any, tiny_model: Callable[[str], Any]
) -> None:
    refused(
        model, rf"ids \[{VOCAB}, 999999\].*outside the vocabulary 0..{VOCAB - 1}", torch.tensor([[1, VOCAB, 999999]])
    )
    refused(model, r"ids \[-3\]", torch.tensor([[1, -3, 4]]))
    # A left-padded prompt whose padding columns hold -1 (some tokenizers' pad): only real tokens count.
    logits = model.forward(torch.tensor([[-1, -1, 4, 5]]), attention_mask=torch.tensor([[0, 0, 1, 1]])).logits
    assert close(logits[0, -1], hf_logits(tiny_model("llama"), [4, 5])[-1])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.zeros(0, dtype=torch.long), r"input_ids=\(1, 0\).*at least one token"),
        (torch.zeros(0, 4, dtype=torch.long), r"input_ids=\(0, 4\).*at least one token and one row"),
        (torch.tensor(5), r"input_ids=\(\): has shape \(\)"),
        (torch.ones(1, 2, 3, dtype=torch.long), r"input_ids=\(1, 2, 3\)"),
        ([[1, 2], [3]], r"input_ids='list': is not a tensor of integers"),
    ],
    ids=["empty", "empty-batch", "0-d", "3-d", "ragged"],
)
def test_empty_and_misshapen_input_ids_are_refused(model: Any, ids: Any, match: str) -> None:
    refused(model, match, ids)


def test_mask_and_positions_of_the_wrong_shape_or_values_are_refused(model: Any) -> None:
    ids, mask = padded(PROMPTS[:2], "right")  # [2, 10]
    refused(model, r"attention_mask=\(2, 4\): has shape \(2, 4\).*must be \[2, 10\]", ids, attention_mask=mask[:, :4])
    refused(model, r"attention_mask=\(1, 10\)", ids, attention_mask=mask[:1])
    refused(model, r"position_ids=\(2, 3\)", ids, position_ids=torch.zeros(2, 3, dtype=torch.long))
    refused(model, r"attention_mask=\[2\]: holds values other than 0 and 1", ids, attention_mask=mask * 2)
    refused(model, r"attention_mask\[1\].*has no real token", ids, attention_mask=torch.stack([mask[0], mask[1] * 0]))
    refused(model, r"position_ids=.*holds negative positions", ids[:1, :1], position_ids=torch.tensor([[-4]]))


def test_seq_ids_that_do_not_match_the_batch_are_named_as_such(model: Any) -> None:
    ids, mask = padded(PROMPTS[:2], "right")
    refused(
        model,
        r"seq_ids=\[0, 1, 0\]: names 3 cache rows for a batch of 2",
        ids,
        attention_mask=mask,
        seq_ids=torch.tensor([0, 1, 0]),
    )
    ids, mask = padded(PROMPTS[:3])
    refused(model, r"input_ids=3: a batch of 3 rows needs 3 KV cache rows; the model has 2", ids, attention_mask=mask)


def test_every_problem_of_a_call_is_listed_at_once(model: Any) -> None:
    error = refused(
        model,
        r"3 problems",
        torch.tensor([[1, VOCAB], [2, 3]]),
        seq_ids=torch.tensor([5, 5]),
    )
    assert error.error is not None
    assert [p.field for p in error.error.problems] == ["input_ids", "seq_ids", "seq_ids"]


# --- the property: any input either matches transformers or is refused --------------------------


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    """A forward() call as a client might make it, often wrong."""
    rows = draw(st.integers(1, 3))
    decode = draw(st.booleans())  # tokens continuing each row from a drawn position, else anything
    width = draw(st.integers(1, 3)) if decode else draw(st.integers(1, 6))
    ids = draw(
        st.lists(
            st.lists(st.integers(-2, VOCAB + 1) | st.integers(3, 40), min_size=width, max_size=width),
            min_size=rows,
            max_size=rows,
        )
    )
    call: dict[str, Any] = {"input_ids": torch.tensor(ids)}
    if draw(st.booleans()):
        mask = draw(
            st.lists(
                st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=width, max_size=width), min_size=rows, max_size=rows
            )
        )
        call["attention_mask"] = torch.tensor(mask)
    if decode:
        starts = torch.tensor(draw(st.lists(st.integers(0, 14), min_size=rows, max_size=rows)))[:, None]
        call["position_ids"] = starts + torch.arange(width) * draw(st.sampled_from([1, 1, 1, 2]))
    elif draw(st.booleans()):
        start = draw(st.sampled_from([0, 0, 1, 3, 8, 12]))
        step = draw(st.sampled_from([1, 1, 1, 0, 2]))
        call["position_ids"] = torch.tensor([[start + step * c for c in range(width)] for _ in range(rows)])
    if draw(st.booleans()):
        call["seq_ids"] = torch.tensor(draw(st.lists(st.integers(-1, 2), min_size=rows, max_size=rows)))
    return call


def expected_sequences(call: dict[str, Any], held: dict[int, list[int]]) -> list[list[int]] | None:
    """What each row's call means (the sequence transformers should see), or None when it means nothing."""
    ids = call["input_ids"]
    rows, width = ids.shape
    mask = call.get("attention_mask", torch.ones_like(ids))
    if "attention_mask" not in call and "position_ids" in call and width > 1:
        # NxDI infers the mask from the positions: a column whose position falls behind it is padding.
        mask = (call["position_ids"] >= torch.arange(width)).to(ids.dtype)
    if not bool(((mask == 0) | (mask == 1)).all()):
        return None
    seq_ids = call.get("seq_ids", torch.arange(rows)).tolist()
    if len(set(seq_ids)) != rows or not all(0 <= s < 2 for s in seq_ids):
        return None
    positions = call.get("position_ids")
    if positions is None:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    prefill = int(positions.min()) == 0
    for r in range(rows):
        real = mask[r].bool()
        tokens = ids[r][real].tolist()
        if not prefill:
            tokens = ids[r].tolist()  # a decode's token is real whatever the mask; a 0 there is refused
            if not bool(mask[r].all()):
                return None
        if not tokens or not all(0 <= t < VOCAB for t in tokens):
            return None
        if prefill:
            if not torch.equal(positions[r][real], torch.arange(len(tokens))):
                return None
            out.append(tokens)
        else:
            p = int(positions[r, 0])
            cached = held.get(seq_ids[r], [])
            consecutive = torch.equal(positions[r], p + torch.arange(width))
            if not consecutive or not cached or p > len(cached) or p + width > 64:
                return None
            out.append([*cached[:p], *tokens])
    return out


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=calls(), first=st.booleans())
# Found by CI: positions without a mask; the mask is inferred from them (one real token, then padding).
@example(call={"input_ids": torch.tensor([[0, 0]]), "position_ids": torch.tensor([[0, 0]])}, first=False)
def test_any_forward_input_matches_transformers_or_raises_the_documented_error(
    model: Any, tiny_model: Callable[[str], Any], call: dict[str, Any], first: bool
) -> None:
    model.reset()
    held: dict[int, list[int]] = {}
    if first:  # two sequences in the cache, so that decodes can be meaningful
        prompts = [list(PROMPTS[0]), list(PROMPTS[2][:5])]
        ids, mask = padded(prompts)
        model.forward(ids, attention_mask=mask)
        held = {0: prompts[0], 1: prompts[1]}
    meant = expected_sequences(call, held)
    if meant is None:
        with pytest.raises(IncompatibleConfigError):
            model.forward(**call)
        return
    logits = model.forward(**call).logits
    hf = tiny_model("llama")
    for r, sequence in enumerate(meant):
        assert close(logits[r, -1], hf_logits(hf, sequence)[-1]), (call, r, sequence)

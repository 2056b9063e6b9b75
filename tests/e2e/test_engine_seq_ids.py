"""seq_ids that name no sequence (REFERENCE §6): garbage rows (kv_cache_padding_size) take
out-of-range and duplicate ids, apply_seq_ids_mask makes -1 a padding row, and without either such
ids are refused, naming them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.engine_fixtures import PROMPTS, hf_logits, padded, program_calls, runtime_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TWO = [list(PROMPTS[0]), list(PROMPTS[2])]
"""Two sequences kept in cache rows 0 and 1."""


def _rows(model: Any, rows: slice) -> list[torch.Tensor]:
    cache = runtime_of(model).cache
    return [t[rows].clone() for t in (*cache.k, *cache.v)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _argmax(out: Any) -> torch.Tensor:
    return out.logits[:, -1].argmax(-1)


def test_garbage_row_writes_leave_every_real_row_and_its_later_tokens_unchanged(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", batch_size=2, kv_cache_padding_size=1)
    expected = hf_greedy("llama", TWO, 6)
    ids, mask = padded(TWO)
    lengths = mask.sum(-1, keepdim=True)
    model.reset()
    runtime_of(model).reset_cache()
    assert torch.equal(_argmax(model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([0, 1]))), expected[:, 0])
    real = _rows(model, slice(0, 2))
    # A prefill of an out-of-range id, a decode of a duplicate pair, a decode of a negative id: all
    # run (outputs for every row), none touches rows 0 and 1.
    assert model.forward(torch.tensor([[5, 6, 7]]), seq_ids=torch.tensor([7])).logits.shape[0] == 1
    dup = model.forward(torch.tensor([[9], [9]]), position_ids=torch.tensor([[3], [3]]), seq_ids=torch.tensor([0, 0]))
    assert dup.logits.shape[0] == 2
    model.forward(torch.tensor([[4]]), position_ids=torch.tensor([[3]]), seq_ids=torch.tensor([-4]))
    assert _same(_rows(model, slice(0, 2)), real), "a real row's cache changed"
    assert bool(_rows(model, slice(2, 3))[0].abs().sum() > 0), "the garbage row took the writes"
    # A decode mixing the two real rows with a garbage one; then the real rows go on alone.
    step = model.forward(
        torch.cat([expected[:, :1], torch.tensor([[8]])]),
        position_ids=torch.cat([lengths, torch.tensor([[3]])]),
        seq_ids=torch.tensor([0, 1, 5]),  # rows 0, 1 and an out-of-range id
    )
    tokens = [expected[:, 0], _argmax(step)[:2]]
    for k in range(1, 5):
        out = model.forward(tokens[-1][:, None], position_ids=lengths + k, seq_ids=torch.tensor([0, 1]))
        tokens.append(_argmax(out))
    assert torch.equal(torch.stack(tokens, dim=1), expected)


def test_without_garbage_rows_such_seq_ids_are_refused_naming_them(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=2)
    model.reset()
    ids, mask = padded(TWO)
    for seq_ids, named in (([1, 1], r"duplicate ids \[1\]"), ([0, 3], r"ids \[3\] outside"), ([-1, 0], r"\[-1\]")):
        with program_calls(model) as calls, pytest.raises(IncompatibleConfigError, match=named) as caught:
            model.forward(ids, attention_mask=mask, seq_ids=torch.tensor(seq_ids))
        assert calls == [] and "kv_cache_padding_size" in str(caught.value)
    with pytest.raises(IncompatibleConfigError, match="apply_seq_ids_mask"):
        model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([-1, 0]))


def test_masked_rows_run_and_write_nothing(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor], tiny_model: Callable[[str], Any]
) -> None:
    """apply_seq_ids_mask: rows of seq_id -1 pad a batch; their outputs come back (meaningless) and
    no cache row changes for them (nxdi drops the writes; the reference spends 128 positions)."""
    model = loaded_model("llama", batch_size=4, apply_seq_ids_mask=True)
    model.reset()
    runtime_of(model).reset_cache()
    expected = hf_greedy("llama", TWO, 5)
    junk = [11, 12, 13]
    ids, mask = padded([TWO[0], junk, TWO[1], junk])
    first = model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([0, -1, 1, -1]))
    assert first.logits.shape[0] == 4
    assert torch.equal(_argmax(first)[[0, 2]], expected[:, 0])
    assert all(bool((t == 0).all()) for t in _rows(model, slice(2, 4))), "a masked row wrote the cache"
    tokens, lengths = [expected[:, 0]], mask.sum(-1)[[0, 2], None]
    for k in range(4):
        order = [1, 0] if k % 2 else [0, 1]  # real rows in any order, masked rows among them
        ids = torch.tensor([[5], *tokens[-1][order, None].tolist(), [6]])
        positions = torch.tensor([[1], *(lengths + k)[order].tolist(), [40]])
        out = model.forward(ids, position_ids=positions, seq_ids=torch.tensor([-1, *order, -1]))
        step = torch.empty(2, dtype=torch.long)
        step[order] = _argmax(out)[1:3]
        tokens.append(step)
    assert torch.equal(torch.stack(tokens, dim=1), expected)
    assert all(bool((t == 0).all()) for t in _rows(model, slice(2, 4)))
    logits = model.forward(torch.tensor([TWO[0]]), seq_ids=torch.tensor([2])).logits
    reference = hf_logits(tiny_model("llama"), TWO[0])[-1]
    assert (logits[0, -1] - reference).abs().max() <= 1e-4 * reference.abs().max()

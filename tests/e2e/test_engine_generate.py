"""Greedy generation through HuggingFaceGenerationAdapter against transformers' generate(), fp32.

Our side right-pads (NxDI's convention) unless a test says otherwise; transformers left-pads. Every
comparison is token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.testing.checkpoints import SaveFormat
from tests.support.engine_fixtures import FAMILIES, NEW_TOKENS, PROMPTS, hf_logits, nxdi_generate, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH4 = dict(batch_size=4)


@pytest.mark.parametrize("variant", [*FAMILIES, "llama3-tied"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_generation_equals_transformers(
    variant: str, batch: int, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    prompts = [PROMPTS[2]] if batch == 1 else list(PROMPTS)
    ours = nxdi_generate(loaded_model(variant, batch_size=batch), prompts)
    assert ours.shape == (batch, NEW_TOKENS)
    assert torch.equal(ours, hf_greedy(variant, prompts)), (ours, hf_greedy(variant, prompts))


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_left_and_right_padded_prompts_give_the_same_tokens(
    variant: str, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model(variant, **BATCH4)
    right = nxdi_generate(model, PROMPTS, side="right")
    left = nxdi_generate(model, PROMPTS, side="left")
    assert torch.equal(left, right)
    assert torch.equal(left, hf_greedy(variant, PROMPTS))


def test_prompts_padded_wider_than_needed_give_the_same_tokens(loaded_model: Callable[..., Any]) -> None:
    """Extra all-pad columns (a batch padded to a fixed width) change nothing."""
    from nxdi.shell.generation import HuggingFaceGenerationAdapter

    model = loaded_model("llama", **BATCH4)
    expected = nxdi_generate(model, PROMPTS, max_new_tokens=8)
    for side in ("right", "left"):
        ids, mask = padded(PROMPTS, side, width=20)
        out = HuggingFaceGenerationAdapter(model).generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        assert torch.equal(out[:, 20:], expected), side


def test_a_one_token_prompt_works(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor], tiny_model: Callable[[str], Any]
) -> None:
    """REFERENCE §15: the reference reads a padding position for a right-padded 1-token prompt."""
    alone = nxdi_generate(loaded_model("llama", batch_size=1), [(3,)])
    assert torch.equal(alone, hf_greedy("llama", [(3,)]))
    model = loaded_model("llama", **BATCH4)
    model.reset()
    ids, mask = padded([(3,), PROMPTS[2]], "right")
    logits = model.forward(ids, attention_mask=mask).logits  # row 0 is [3, pad, pad, ...]
    expected = hf_logits(tiny_model("llama"), [3])[-1]
    assert (logits[0, -1] - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("fmt", list(SaveFormat))
@pytest.mark.parametrize("variant", FAMILIES)
def test_every_checkpoint_format_loads_through_the_model_class(
    variant: str, fmt: SaveFormat, loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    model = loaded_model(variant, fmt=fmt, **BATCH4)
    model.reset()
    ids, mask = padded(PROMPTS, "right")
    logits = model.forward(ids, attention_mask=mask).logits
    for i, p in enumerate(PROMPTS):
        expected = hf_logits(tiny_model(variant), p)[-1]
        assert (logits[i, -1] - expected).abs().max() <= 1e-4 * expected.abs().max()


# --- batches that are not the compiled batch --------------------------------------------------


def _row_by_row(model: Any, prompts: Any, **kwargs: Any) -> torch.Tensor:
    return torch.cat([nxdi_generate(model, [p], **kwargs) for p in prompts])


def test_a_batch_smaller_than_compiled_gives_the_rows_own_tokens(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **BATCH4)
    two = nxdi_generate(model, PROMPTS[:2])
    assert torch.equal(two, _row_by_row(model, PROMPTS[:2]))
    assert torch.equal(two, hf_greedy("llama", PROMPTS[:2]))


@pytest.mark.parametrize(
    "config",
    [
        dict(batch_size=4, kv_cache_batch_size=6),
        dict(batch_size=4, kv_cache_batch_size=8),
        dict(batch_size=2, kv_cache_batch_size=6),
    ],
    ids=["batch-4-cache-6", "batch-4-cache-8", "batch-2-cache-6"],
)
def test_a_batch_larger_than_compiled_is_split(
    config: dict[str, int], loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """6 rows on a batch-4 program: two calls, the second padded; every cache row is in use, so
    the padding rows must not write anywhere (with 6 cache rows there is no spare row)."""
    from tests.support.engine_fixtures import program_calls

    six = [*PROMPTS, (20, 21, 22), (30,)]
    model = loaded_model("llama", **config)
    with program_calls(model) as calls:
        ours = nxdi_generate(model, six, max_new_tokens=12)
    compiled = config["batch_size"]
    assert {key.batch for key in calls} == {compiled}
    assert len(calls) == -(-len(six) // compiled) * 12  # every step splits into ceil(B / compiled) calls
    assert torch.equal(ours, hf_greedy("llama", six, 12))
    assert torch.equal(ours, _row_by_row(loaded_model("llama", batch_size=1), six, max_new_tokens=12))


def test_a_context_batch_of_one_splits_prefill_into_single_rows(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """ctx_batch_size=1 (continuous-batching style): prefill runs row by row, decoding batched."""
    from nxdi.core.config.neuron_spec import Phase
    from tests.support.engine_fixtures import program_calls

    model = loaded_model("llama", batch_size=4, ctx_batch_size=1)
    with program_calls(model) as calls:
        ours = nxdi_generate(model, PROMPTS, max_new_tokens=6)
    assert [key.batch for key in calls if key.phase is Phase.CONTEXT] == [1, 1, 1, 1]
    assert {key.batch for key in calls if key.phase is Phase.TOKEN} == {4}
    assert torch.equal(ours, hf_greedy("llama", PROMPTS, 6))


def _greedy_steps(model: Any, ids: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill then `steps - 1` decode steps through forward() with explicit seq_ids: tokens [B, steps]."""
    tokens = [model.forward(ids, attention_mask=mask, seq_ids=seq_ids).logits[:, -1].argmax(-1)]
    positions = mask.sum(-1, keepdim=True)
    for k in range(steps - 1):
        out = model.forward(tokens[-1][:, None], position_ids=positions + k, seq_ids=seq_ids)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)


def test_seq_ids_in_any_order_return_outputs_in_the_callers_order(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **BATCH4)
    expected = hf_greedy("llama", PROMPTS, 8)
    ids, mask = padded(PROMPTS, "right")
    model.reset()
    shuffled = _greedy_steps(model, ids, mask, torch.tensor([2, 0, 3, 1]), 8)
    assert torch.equal(shuffled, expected)
    # A sequence is its seq_id: rows may come in another order at every call.
    model.reset()
    first = model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([2, 0, 3, 1])).logits[:, -1].argmax(-1)
    order = torch.tensor([3, 1, 0, 2])  # caller rows for seq_ids 1, 0, 2, 3 below
    nxt = model.forward(
        first[order, None], position_ids=mask.sum(-1, keepdim=True)[order], seq_ids=torch.tensor([1, 0, 2, 3])
    )
    assert torch.equal(nxt.logits[:, -1].argmax(-1), expected[order, 1])


def test_a_call_on_some_cache_rows_leaves_the_other_rows_alone(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """Two requests on one batch-4 model (continuous-batching style): the second's prefill, padded
    to 4 rows, must not write the first's cache rows."""
    model = loaded_model("llama", **BATCH4)
    a, b = list(PROMPTS[:2]), list(PROMPTS[2:])
    model.reset()
    ids_a, mask_a = padded(a, "right")
    ids_b, mask_b = padded(b, "right")
    first_a = model.forward(ids_a, attention_mask=mask_a, seq_ids=torch.tensor([0, 1])).logits[:, -1].argmax(-1)
    first_b = model.forward(ids_b, attention_mask=mask_b, seq_ids=torch.tensor([2, 3])).logits[:, -1].argmax(-1)
    expected_a, expected_b = hf_greedy("llama", a, 2), hf_greedy("llama", b, 2)
    assert torch.equal(first_a, expected_a[:, 0]) and torch.equal(first_b, expected_b[:, 0])
    positions = torch.cat([mask_b.sum(-1, keepdim=True), mask_a.sum(-1, keepdim=True)])
    both = model.forward(
        torch.cat([first_b, first_a])[:, None], position_ids=positions, seq_ids=torch.tensor([2, 3, 0, 1])
    )
    assert torch.equal(both.logits[:, -1].argmax(-1), torch.cat([expected_b[:, 1], expected_a[:, 1]]))

"""NeuronBaseForCausalLM.forward: logits against transformers, the output object, and KV-cache state.

fp32: logits within 1e-4 of the largest |logit| (NxDI's max-scaled closeness), for the prefill and
for decode steps fed the same tokens. bf16 (REFERENCE §10 tolerances): see the bf16 tests' notes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.core import families
from nxdi.core.host.logit_validation import DEFAULT_TOL_MAP, compare_position, max_relative_logit_error
from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.engine_fixtures import (
    FAMILIES,
    NEW_TOKENS,
    PROMPTS,
    hf_logits,
    nxdi_generate,
    padded,
    runtime_of,
    teacher_forced,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DECODE_STEPS = 6


@pytest.mark.parametrize("variant", [*FAMILIES, "llama3-tied"])
def test_fp32_logits_match_transformers_in_prefill_and_decode(
    variant: str,
    loaded_model: Callable[..., Any],
    tiny_model: Callable[[str], Any],
    hf_greedy: Callable[..., torch.Tensor],
) -> None:
    tokens = hf_greedy(variant, PROMPTS)[:, : DECODE_STEPS - 1]
    logits = teacher_forced(loaded_model(variant, batch_size=4), PROMPTS, tokens)
    assert logits.shape == (4, DECODE_STEPS, 160) and logits.dtype == torch.float32
    for i, p in enumerate(PROMPTS):
        expected = hf_logits(tiny_model(variant), [*p, *tokens[i].tolist()])[len(p) - 1 :]  # [N, V]
        for step in range(DECODE_STEPS):
            err = max_relative_logit_error(expected[step], logits[i, step])
            assert err <= 1e-4, f"row {i} step {step}: relative error {err}"


def test_forward_infers_positions_and_mask_and_accepts_1d_ids(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    model = loaded_model("llama", batch_size=1)
    prompt = list(PROMPTS[0])
    expected = hf_logits(tiny_model("llama"), prompt)
    model.reset()
    first = model.forward(torch.tensor(prompt)).logits  # [W] ids, no mask, no positions
    assert max_relative_logit_error(expected[-1], first[0, -1]) <= 1e-4
    token = int(first[0, -1].argmax())
    following = hf_logits(tiny_model("llama"), [*prompt, token])[-1]
    # decode with only an attention mask covering the sequence so far (positions inferred from it)
    step = model.forward(torch.tensor([[token]]), attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long))
    assert max_relative_logit_error(following, step.logits[0, -1]) <= 1e-4


def test_the_output_object(loaded_model: Callable[..., Any]) -> None:
    ids, mask = padded(PROMPTS, "right")
    plain = loaded_model("llama", batch_size=4)
    out = plain.forward(ids, attention_mask=mask)
    assert out.logits.shape == (4, 1, 160) and out.logits.dtype == torch.float32
    assert out.tokens is out.logits and out.hidden_states is out.logits  # NxDI: tokens hold the logits
    assert out["logits"] is out.logits and out.attentions is None

    sampled = loaded_model("llama", batch_size=4, on_device_sampling_config={"top_k": 1})
    ods = sampled.forward(ids, attention_mask=mask)
    assert ods.logits is None, "logits are not returned under on-device sampling"
    assert ods.tokens.shape == (4,) and ods.hidden_states is ods.tokens
    assert torch.equal(ods.tokens, out.logits[:, -1].argmax(-1))

    both = loaded_model("llama", batch_size=4, on_device_sampling_config={"top_k": 1}, output_logits=True)
    with_logits = both.forward(ids, attention_mask=mask)
    torch.testing.assert_close(with_logits.logits, out.logits, rtol=0, atol=0)
    assert torch.equal(with_logits.tokens, ods.tokens)


def test_reset_kv_cache_populated_and_reset_kv_cache(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=4, fresh=True)
    assert model.kv_cache_populated is False
    ids, mask = padded(PROMPTS, "right")
    first = model.forward(ids, attention_mask=mask).logits
    assert model.kv_cache_populated is True
    cache = runtime_of(model).cache
    assert any(bool(t.abs().sum() > 0) for t in cache.k)
    positions = mask.sum(-1, keepdim=True)
    decode = model.forward(ids[:, :1], position_ids=positions).logits
    model.reset()
    assert model.kv_cache_populated is False
    # a new batch: no row holds a sequence to decode from (the stale cache is not read)
    with pytest.raises(IncompatibleConfigError, match=r"seq_id=0, which holds nothing.*encode that sequence's prompt"):
        model.forward(ids[:, :1], position_ids=positions)
    model.forward(ids, attention_mask=mask)
    assert torch.equal(model.forward(ids[:, :1], position_ids=positions).logits, decode)
    model.reset_kv_cache()
    assert all(bool((t == 0).all()) for t in (*cache.k, *cache.v))
    with pytest.raises(IncompatibleConfigError, match=r"holds nothing"):
        model.forward(ids[:, :1], position_ids=positions)
    assert torch.equal(model.forward(ids, attention_mask=mask).logits, first)  # a prefill rebuilds it


# --- bf16 ----------------------------------------------------------------------------------------

DENSE = tuple(r.name for r in families.runnable() if not r.moe)
"""The bf16 checks on random weights below run on dense families: a random router's expert scores
are near ties, and one within bf16 rounding of a tie picks another expert, a jump no logit
tolerance describes (seen on qwen3_moe: 0.19 against rtol 0.05 at one position). The mixtures of
experts are checked in bf16 on briefly trained checkpoints, where the router decides
(tests/e2e/test_accuracy.py)."""


@pytest.mark.parametrize("variant", DENSE)
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(
    variant: str,
    loaded_model: Callable[..., Any],
    tiny_model: Callable[[str], Any],
    hf_greedy: Callable[..., torch.Tensor],
) -> None:
    """Teacher-forced along transformers' fp32 greedy tokens (32 positions x 4 rows), our bf16
    logits meet the §10 tolerance for the whole vocabulary (rtol 0.05) at every position, and their
    error from the fp32 golden is no larger than transformers' own bf16 model's (RMS and max over
    every logit, within 25%; measured ratios are 0.88-1.01).

    The tighter top-50 / top-5 rtols (0.02 / 0.01) are NOT asserted here: on these random tiny
    models transformers' own bf16 misses them too (errors ~0.013-0.02), since the logits are flat.
    check_accuracy_logits on briefly trained checkpoints (tests/e2e/test_accuracy.py) covers them.
    """
    tokens = hf_greedy(variant, PROMPTS)
    ours = teacher_forced(loaded_model(variant, batch_size=4, torch_dtype="bfloat16"), PROMPTS, tokens[:, :-1])
    hf16 = copy.deepcopy(tiny_model(variant)).to(torch.bfloat16)
    all_tol = {None: DEFAULT_TOL_MAP[None]}
    mine, theirs = [], []
    for i, p in enumerate(PROMPTS):
        sequence = [*p, *tokens[i].tolist()][:-1]
        golden = hf_logits(tiny_model(variant), sequence)[len(p) - 1 :]  # [N, V] fp32
        for step in range(NEW_TOKENS):
            # Teacher forced: a differing argmax is not followed, so only the closeness is checked here.
            result = compare_position(step, golden[step], ours[i, step], tol_map=all_tol)
            assert result.max_error["all"] <= all_tol[None][1], f"row {i} step {step}: {result}"
        mine.append(ours[i] - golden)
        theirs.append(hf_logits(hf16, sequence)[len(p) - 1 :] - golden)
    err, ref = torch.stack(mine), torch.stack(theirs)
    assert err.pow(2).mean().sqrt() <= 1.25 * ref.pow(2).mean().sqrt()
    assert err.abs().max() <= 1.25 * ref.abs().max()


@pytest.mark.parametrize("variant", DENSE)
def test_bf16_greedy_tokens_agree_with_transformers_bf16_until_a_near_tie(
    variant: str, loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """Our bf16 greedy tokens equal transformers' bf16 greedy tokens up to the first position where
    they differ (if any); there, the two candidates are a near-tie in the exact (fp32) model: their
    fp32 logits differ by less than bf16 noise (2% of the largest logit). Seen on these models: the
    first 9 new tokens always agree (6 are asserted); later divergences (tokens 10-31) happen in a
    few rows."""
    ours = nxdi_generate(loaded_model(variant, batch_size=4, torch_dtype="bfloat16"), PROMPTS)
    hf16 = copy.deepcopy(tiny_model(variant)).to(torch.bfloat16)
    from tests.support.engine_fixtures import hf_generate

    theirs = hf_generate(hf16, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours[:, :6], theirs[:, :6])
    for i, p in enumerate(PROMPTS):
        differ = (ours[i] != theirs[i]).nonzero()
        if len(differ) == 0:
            continue
        at = int(differ[0])
        golden = hf_logits(tiny_model(variant), [*p, *ours[i, :at].tolist()])[-1]
        gap = float((golden[ours[i, at]] - golden[theirs[i, at]]).abs())
        assert gap <= 0.02 * float(golden.abs().max()), f"row {i} token {at}: not a near-tie (gap {gap})"

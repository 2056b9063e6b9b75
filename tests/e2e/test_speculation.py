"""Speculative decoding on the engine: the speculation programs (`speculation_length` k: one step
scores a row's last token and k-1 draft tokens, [B, k, V]) as forward() runs them, and the draft
loop built on them.

- A speculation step's logits equal k single-token decode steps over the same tokens, at batch 4
  with rows at different positions, through eager programs and compile() + load().
- Its cache writes equal theirs: after a partial acceptance, decoding on from the accepted prefix
  gives the logits of a model that never saw the rejected tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.testing import checkpoints
from tests.support.engine_fixtures import NEW_TOKENS, PROMPTS, load_model, padded, program_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4


def _prefill(model: Any, prompts: Any) -> torch.Tensor:
    """Encode the right-padded prompts; each row's next position [B, 1]."""
    ids, mask = padded(prompts, "right")
    model.reset()
    model.forward(ids, attention_mask=mask)
    return mask.sum(-1, keepdim=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_speculation_step_scores_k_tokens_as_k_decode_steps(loaded_model: Callable[..., Any], compiled: bool) -> None:
    backend = {"backend": "cpu"} if compiled else {}  # compile() + load() through the CPU backend
    spec = loaded_model("llama", batch_size=4, speculation_length=K, **backend)
    plain = loaded_model("llama", batch_size=4)
    tokens = torch.randint(3, 100, (4, K), generator=torch.Generator().manual_seed(0))
    at = _prefill(spec, PROMPTS) + torch.arange(K)  # [B, K]: rows at different positions
    with program_calls(spec) as calls:
        logits = spec.forward(tokens, position_ids=at).logits
    assert [c.phase.value for c in calls] == ["speculation"] and calls[0].tokens == K
    assert logits.shape == (4, K, plain.config.vocab_size)
    _prefill(plain, PROMPTS)
    for i in range(K):
        step = plain.forward(tokens[:, i : i + 1], position_ids=at[:, i : i + 1]).logits[:, -1]
        for row in range(4):
            assert max_relative_logit_error(step[row], logits[row, i]) <= 1e-5, (row, i)


def test_rejected_tokens_leave_nothing_behind(loaded_model: Callable[..., Any]) -> None:
    """Row r accepts r of the k-1 draft tokens: decoding on from its accepted prefix equals a model
    that was only ever given the accepted tokens (the rejected ones' cache slots are rewritten before
    any later step reads them)."""
    spec = loaded_model("llama", batch_size=4, speculation_length=K)
    one = loaded_model("llama", batch_size=1)
    draft = torch.randint(3, 100, (4, K), generator=torch.Generator().manual_seed(1))
    at = _prefill(spec, PROMPTS)
    spec.forward(draft, position_ids=at + torch.arange(K))
    kept = torch.arange(4)[:, None]  # row r keeps draft[r, : r + 1] (its last token and r proposals)
    nxt = torch.randint(3, 100, (4, 1), generator=torch.Generator().manual_seed(2))
    ours = spec.forward(nxt, position_ids=at + kept + 1).logits[:, -1]
    for row in range(4):  # each row alone, given only its accepted tokens
        start = _prefill(one, PROMPTS[row : row + 1])
        for i in range(row + 1):
            one.forward(draft[row : row + 1, i : i + 1], position_ids=start + i)
        expected = one.forward(nxt[row : row + 1], position_ids=start + row + 1).logits[0, -1]
        assert max_relative_logit_error(expected, ours[row]) <= 1e-5, row


# --- the draft loop: generate(assistant_model=draft) ------------------------------------------


@pytest.fixture(scope="module")
def weak_draft(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """`weak_draft(batch)`: a one-layer llama of other random weights over the same vocabulary, so
    it proposes mostly wrong tokens (low acceptance)."""
    path, _ = checkpoints.build_checkpoint(
        tmp_path_factory.mktemp("draft"), "llama", checkpoints.SaveFormat.SAFETENSORS, seed=7, num_hidden_layers=1
    )
    built: dict[int, Any] = {}

    def get(batch: int) -> Any:
        if batch not in built:
            built[batch] = load_model(path, "llama", batch_size=batch)
        return built[batch]

    return get


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A batch-4 draft: the tiny llama with noise on its lm_head, so its proposals are plausible to
    the target but drawn from another distribution (acceptance in between, residual draws often)."""
    model = checkpoints.build_model("llama", seed=0)
    with torch.no_grad():
        noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
        model.lm_head.weight.add_(noise * model.lm_head.weight.std())
    path = checkpoints.save_checkpoint(model, tmp_path_factory.mktemp("near"), checkpoints.SaveFormat.SAFETENSORS)
    return load_model(path, "llama", batch_size=4)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_kind", ["itself", "weak"])
def test_greedy_speculation_gives_the_targets_greedy_tokens(
    batch: int,
    draft_kind: str,
    loaded_model: Callable[..., Any],
    weak_draft: Callable[..., Any],
    hf_greedy: Callable[..., torch.Tensor],
) -> None:
    """Equal to transformers' greedy tokens, with the target as its own draft (every proposal
    accepted: k tokens per target step) and with a weak draft (few accepted), rows of a batch
    accepting different counts; 32 new tokens cross several token-generation buckets."""
    prompts = PROMPTS[:batch]
    target = loaded_model("llama", batch_size=batch, speculation_length=K)
    draft = loaded_model("llama", batch_size=batch) if draft_kind == "itself" else weak_draft(batch)
    adapter = HuggingFaceGenerationAdapter(target)
    ids, mask = padded(prompts, "right")
    out = adapter.generate(
        ids, attention_mask=mask, assistant_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out[:, ids.shape[1] :], hf_greedy("llama", prompts))
    stats = adapter.speculation_stats
    rate = stats["accepted"] / stats["proposed"]
    if draft_kind == "itself":
        assert rate == 1.0 and stats["emitted"] / stats["target_steps"] > K - 1
    else:
        assert rate < 0.5, stats


def test_the_last_tokens_before_max_length_come_from_steps_that_end_there(
    loaded_model: Callable[..., Any], weak_draft: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """A 14-token prompt and 50 new tokens fill all 64 positions: the last rounds have no room for
    a k-token step after the last token, so their steps start at 64 - k (re-reading accepted
    tokens); no token-generation step runs, and the tokens are still the greedy ones."""
    prompts = PROMPTS[2:3]
    target = loaded_model("llama", batch_size=1, speculation_length=K)
    ids, mask = padded(prompts, "right")
    with program_calls(target) as calls:
        out = HuggingFaceGenerationAdapter(target).generate(
            ids, attention_mask=mask, assistant_model=weak_draft(1), max_new_tokens=50, do_sample=False, pad_token_id=0
        )
    assert torch.equal(out[:, ids.shape[1] :], hf_greedy("llama", prompts, new_tokens=50))
    assert {c.phase.value for c in calls} == {"context_encoding", "speculation"}
    assert max(c.length for c in calls) == 64


def test_sampled_speculation_is_repeatable_under_a_seed(
    loaded_model: Callable[..., Any], weak_draft: Callable[..., Any]
) -> None:
    target = loaded_model("llama", batch_size=4, speculation_length=K)
    ids, mask = padded(PROMPTS, "right")
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(
            HuggingFaceGenerationAdapter(target).generate(
                ids,
                attention_mask=mask,
                assistant_model=weak_draft(4),
                max_new_tokens=16,
                do_sample=True,
                top_k=20,
                temperature=0.8,
                pad_token_id=0,
            )
        )
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (4, ids.shape[1] + 16)


def test_what_speculation_cannot_run_is_refused(
    loaded_model: Callable[..., Any], weak_draft: Callable[..., Any]
) -> None:
    ids, mask = padded(PROMPTS[:1], "right")
    plain = loaded_model("llama", batch_size=1)
    target = loaded_model("llama", batch_size=1, speculation_length=K)
    cases = [
        (plain, {}, "speculation_length=0"),
        (target, {"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
        (target, {"assistant_model": weak_draft(4)}, "the draft's batch_size=4"),
    ]
    for model, extra, message in cases:
        settings = {"assistant_model": weak_draft(1), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
        with pytest.raises(IncompatibleConfigError, match=re.escape(message)):
            HuggingFaceGenerationAdapter(model).generate(ids, attention_mask=mask, **(settings | extra))


def test_sampled_speculation_keeps_the_targets_distribution(loaded_model: Callable[..., Any], near_draft: Any) -> None:
    """The first two new tokens of a sampled run (top_k=3, so 9 possible pairs) drawn with a draft
    of another distribution (some proposals accepted, some replaced by residual draws) against their exact
    probability p(t1) p(t2 | t1) from the target's own logits: a chi-square test over the pairs
    with at least 5 expected draws, failing when its p-value is below 1e-4 (the false-failure rate;
    the seed is fixed, so the outcome is too)."""
    prompt = PROMPTS[0]
    target = loaded_model("llama", batch_size=4, speculation_length=K)
    one = loaded_model("llama", batch_size=1)
    settings = {"do_sample": True, "top_k": 3, "temperature": 1.0, "pad_token_id": 0}

    def top3(logits: torch.Tensor) -> dict[int, float]:
        values, ids = logits.float().topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    exact: dict[tuple[int, int], float] = {}
    ids1, mask1 = padded([prompt], "right")
    one.reset()
    for t1, p1 in top3(one.forward(ids1, attention_mask=mask1).logits[0, -1]).items():
        one.reset()
        ids2, mask2 = padded([(*prompt, t1)], "right")
        for t2, p2 in top3(one.forward(ids2, attention_mask=mask2).logits[0, -1]).items():
            exact[(t1, t2)] = p1 * p2
    ids, mask = padded([prompt] * 4, "right")
    torch.manual_seed(11)
    counts: dict[tuple[int, int], int] = {}
    runs = 200
    accepted = proposed = 0
    for _ in range(runs):
        adapter = HuggingFaceGenerationAdapter(target)
        out = adapter.generate(ids, attention_mask=mask, assistant_model=near_draft, max_new_tokens=2, **settings)
        out = out[:, ids.shape[1] :]
        accepted += adapter.speculation_stats["accepted"]
        proposed += adapter.speculation_stats["proposed"]
        for t1, t2 in out.tolist():
            counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    n = 4 * runs
    assert set(counts) <= set(exact), "a pair outside the target's top 3 x top 3"
    cells = [(pair, p * n) for pair, p in exact.items() if p * n >= 5]
    stat = sum((counts.get(pair, 0) - e) ** 2 / e for pair, e in cells)
    df = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4, (stat, df, counts, exact)
    assert 0 < accepted < proposed, "both accepted proposals and residual draws are exercised"


def test_speculation_at_tp2_gives_the_targets_greedy_tokens(
    tp_model: Callable[..., Any], weak_draft: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """The speculation programs on two rank processes (sequence parallelism is off in them)."""
    target = tp_model("llama", tp_degree=2, batch_size=4, speculation_length=K, sequence_parallel_enabled=True)
    ids, mask = padded(PROMPTS, "right")
    out = HuggingFaceGenerationAdapter(target).generate(
        ids, attention_mask=mask, assistant_model=weak_draft(4), max_new_tokens=16, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out[:, ids.shape[1] :], hf_greedy("llama", PROMPTS, new_tokens=16))


@pytest.mark.parametrize("setting", ["async_mode", "is_block_kv_layout"])
def test_speculation_programs_refuse_what_they_do_not_run_with(
    setting: str, tiny_checkpoint: Callable[..., Any]
) -> None:
    extra: dict[str, Any] = {"pa_num_blocks": 16, "pa_block_size": 16}
    if setting == "async_mode":
        extra = {"on_device_sampling_config": {"top_k": 1}, "output_logits": True}
    with pytest.raises(IncompatibleConfigError, match=f"{setting}=True: does not run with speculation_length=4"):
        load_model(tiny_checkpoint("llama"), "llama", speculation_length=K, **{setting: True}, **extra)


def test_on_device_sampling_gives_a_token_per_position(loaded_model: Callable[..., Any]) -> None:
    """With on-device greedy sampling a speculation step returns tokens [B, k], each position's argmax."""
    spec = loaded_model(
        "llama", batch_size=4, speculation_length=K, on_device_sampling_config={"top_k": 1}, output_logits=True
    )
    at = _prefill(spec, PROMPTS) + torch.arange(K)
    out = spec.forward(torch.randint(3, 100, (4, K), generator=torch.Generator().manual_seed(4)), position_ids=at)
    assert out.tokens.shape == (4, K) and torch.equal(out.tokens.long(), out.logits.argmax(-1))

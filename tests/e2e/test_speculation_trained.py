"""Speculative decoding with a trained target/draft pair (`nxdi.testing.training.train_pair`: a
tiny target and a tinier draft trained on the same progressions, so the draft's proposals are
mostly right, as a real distilled draft's are), and a target built with
trace_tokengen_model=False, which has no token-generation programs and decodes only in
speculation steps, to the end of seq_len.

Also `get_generate_outputs` (NxDI's utils.accuracy) with a tokenizer built locally, with and
without the draft.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell import accuracy
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.testing import training
from nxdi.testing.word_tokenizer import word_tokenizer, words
from tests.support.engine_fixtures import SEQ_LEN, load_model, nxdi_generate, padded, program_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
PROMPTS = tuple(training.progression_prompts(160, lengths=(10, 3, 14, 6), seed=1))
"""Four progressions of different lengths (in distribution for the pair)."""
NEW = 40
MIN_ACCEPTANCE = 0.85
"""accepted / proposed draft tokens. Measured (40 new tokens): 1.00 at batch 1 (30 of 30), 0.98 at
batch 4 (121 of 123); a random one-layer draft gets under 0.5 (tests/e2e/test_speculation.py)."""
MIN_TOKENS_PER_STEP = 3.2
"""New tokens per row (the prefill's one included) per target speculation step, at most K = 4 (and one).
Measured: 4.0 at batch 1, 3.6 at batch 4."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The toy pair trained once for this module on sequences as long as the cache (seq_len 64)."""
    root = tmp_path_factory.mktemp("pair")
    target, draft = training.train_pair(root / "target", root / "draft", recipe="toy", length=SEQ_LEN)
    return target.path, draft.path


@pytest.fixture(scope="module")
def models(pair: tuple[Path, Path]) -> Iterator[Callable[..., Any]]:
    """`models(role, batch)`: "target" (speculation_length K, trace_tokengen_model=False), "plain"
    (the target with token-generation programs, no speculation) or "draft", loaded once each."""
    built: dict[tuple[str, int], Any] = {}
    settings = {
        "target": (pair[0], {"speculation_length": K, "trace_tokengen_model": False}),
        "plain": (pair[0], {}),
        "draft": (pair[1], {}),
    }

    def get(role: str, batch: int) -> Any:
        if (role, batch) not in built:
            path, extra = settings[role]
            built[(role, batch)] = load_model(path, "llama", batch_size=batch, **extra)
        return built[(role, batch)]

    yield get
    for model in built.values():
        model.close()


def _speculate(models: Callable[..., Any], prompts: Any, new: int) -> tuple[torch.Tensor, dict[str, int], list[Any]]:
    """Greedy speculation of `new` tokens: the new tokens, the stats and the target's program calls."""
    batch = len(prompts)
    target = models("target", batch)
    adapter = HuggingFaceGenerationAdapter(target)
    ids, mask = padded(prompts, "right")
    with program_calls(target) as calls:
        out = adapter.generate(
            ids,
            attention_mask=mask,
            assistant_model=models("draft", batch),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, ids.shape[1] :], adapter.speculation_stats, calls


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_with_a_trained_draft_is_greedy_and_mostly_accepted(
    batch: int, models: Callable[..., Any]
) -> None:
    prompts = PROMPTS[:batch]
    got, stats, calls = _speculate(models, prompts, NEW)
    want = nxdi_generate(models("plain", batch), prompts, max_new_tokens=NEW)
    assert torch.equal(got, want)
    assert stats["accepted"] / stats["proposed"] >= MIN_ACCEPTANCE, stats
    assert stats["emitted"] / (batch * stats["target_steps"]) >= MIN_TOKENS_PER_STEP, stats
    assert {c.phase.value for c in calls} == {"context_encoding", "speculation"}


def test_speculation_runs_to_the_end_of_seq_len_without_token_generation(models: Callable[..., Any]) -> None:
    """Rows whose last tokens land on positions 63, 61, 62 and 60 of the 64: near the end every
    step starts at 64 - k, re-reading a row's last tokens, and the tokens stay the greedy ones."""
    prompts = [
        p[:n]
        for p, n in zip(training.progression_prompts(160, lengths=(14,) * 4, seed=3), (14, 12, 13, 11), strict=True)
    ]
    new = SEQ_LEN - 14
    got, _, calls = _speculate(models, prompts, new)
    assert torch.equal(got, nxdi_generate(models("plain", 4), prompts, max_new_tokens=new))
    spec = [c for c in calls if c.phase.value == "speculation"]
    assert spec and all(c.tokens == K for c in spec) and len(spec) < len(calls)  # plus the prefill


def test_sampled_speculation_also_runs_to_the_end_of_seq_len(models: Callable[..., Any]) -> None:
    """Speculative sampling through the last steps (which start at 64 - k), repeatable under a seed."""
    ids, mask = padded([PROMPTS[2]] * 4, "right")  # 14 tokens: 50 new ones fill the cache
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(
            HuggingFaceGenerationAdapter(models("target", 4)).generate(
                ids,
                attention_mask=mask,
                assistant_model=models("draft", 4),
                max_new_tokens=SEQ_LEN - 14,
                do_sample=True,
                temperature=1.5,
                pad_token_id=0,
                eos_token_id=None,
            )
        )
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (4, SEQ_LEN)
    assert len({tuple(r) for r in runs[0].tolist()}) > 1  # rows drew differently


def test_a_target_without_token_generation_compiles_fewer_programs(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """compile() writes the context-encoding and speculation programs only (eager to_cpu() builds
    the same set: the tests above ran without token-generation programs)."""
    names = {}
    for flag in (True, False):
        workdir = tmp_path / str(flag)
        workdir.mkdir()
        model = load_model(
            pair[0], "llama", workdir=workdir, backend="cpu", speculation_length=K, trace_tokengen_model=flag
        )
        model.close()
        (manifest,) = workdir.glob("compiled-*/manifest.json")
        programs = json.loads(manifest.read_text())["programs"]
        names[flag] = {(p["phase"], p["length"], p["tokens"]) for p in programs}
    assert {n for n in names[True] if n[0] != "token_generation"} == names[False]
    assert len(names[False]) < len(names[True])
    assert {n[0] for n in names[False]} == {"context_encoding", "speculation"}


def test_decoding_without_a_draft_is_refused_naming_the_setting(models: Callable[..., Any]) -> None:
    target = models("target", 1)
    ids, mask = padded(PROMPTS[:1], "right")
    message = re.escape("trace_tokengen_model=False")
    with pytest.raises(IncompatibleConfigError, match=message) as info:
        HuggingFaceGenerationAdapter(target).generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert "assistant_model=draft" in str(info.value) and "trace_tokengen_model=True" in str(info.value)
    first = HuggingFaceGenerationAdapter(target).generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0)
    assert first.shape == (1, ids.shape[1] + 1)  # one new token needs only the prefill
    at = mask.sum(-1, keepdim=True)
    with pytest.raises(IncompatibleConfigError, match=message):
        target.forward(first[:, -1:], position_ids=at)
    scored = target.forward(torch.full((1, K), 5), position_ids=at + torch.arange(K))  # a speculation step runs
    assert scored.logits.shape == (1, K, 160)


@pytest.mark.parametrize(
    "settings",
    [{"is_block_kv_layout": True, "pa_num_blocks": 16, "pa_block_size": 16}, {"async_mode": True}],
    ids=["is_block_kv_layout", "async_mode"],
)
def test_settings_that_need_token_generation_are_refused_with_it_off(settings: dict[str, Any]) -> None:
    from nxdi.core.config.cpu_support import check_cpu_support
    from nxdi.shell.config import NeuronConfig

    spec = NeuronConfig(trace_tokengen_model=False, on_device_sampling_config={"top_k": 1}, **settings).spec
    (problem,) = check_cpu_support(spec).failure().problems
    name = next(iter(settings))
    assert problem.field == "trace_tokengen_model" and f"{name}=True" in problem.reason and name in problem.fix


# --- get_generate_outputs -------------------------------------------------------------------------


def test_get_generate_outputs_returns_the_output_ids_and_their_text(models: Callable[..., Any]) -> None:
    """Without a draft on the plain target, with the draft on the speculation target (greedy), and
    transformers on the same checkpoint: one text. The tokenizer has no pad token (it becomes EOS)."""
    prompts = [words([5, 7, 9, 11]), words([40, 43, 46])]
    plain = models("plain", 2)
    tokenizer = word_tokenizer(160, with_pad=False)
    outputs, texts = accuracy.get_generate_outputs(plain, prompts, tokenizer, max_new_tokens=12, eos_token_id=None)
    assert tokenizer.pad_token == "</s>"
    assert outputs.shape == (2, 4 + 12) and texts == tokenizer.batch_decode(outputs, skip_special_tokens=True)
    assert texts[0].startswith("w5 w7 w9 w11 w13 w15") and texts[1].startswith("w40 w43 w46 w49 w52")
    spec_out, spec_texts = accuracy.get_generate_outputs(
        models("target", 2), prompts, tokenizer, draft_model=models("draft", 2), max_new_tokens=12, eos_token_id=None
    )
    assert spec_texts == texts and torch.equal(spec_out, outputs)
    hf = plain.load_hf_model(plain.checkpoint_path).float().eval()
    hf_out, hf_texts = accuracy.get_generate_outputs(
        hf, prompts, tokenizer, is_hf=True, max_new_tokens=12, eos_token_id=None
    )
    assert hf_texts == texts and hf_out.shape == outputs.shape  # left padded: other columns, same text


def test_get_generate_outputs_takes_a_generation_config_and_offsets(models: Callable[..., Any]) -> None:
    from transformers import GenerationConfig

    prompts = [words([5, 7, 9, 11]), words([40, 43, 46])]
    tokenizer = word_tokenizer(160)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out, texts = accuracy.get_generate_outputs(
        models("target", 2),
        prompts,
        tokenizer,
        draft_model=models("draft", 2),
        generation_config=config,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (2, 4 + 6)
    shifted, shifted_texts = accuracy.get_generate_outputs(
        models("plain", 2), prompts, tokenizer, generation_config=config, input_start_offsets=[2]
    )
    assert shifted.shape == (2, 2 + 4 + 6) and shifted_texts == texts  # two pad columns before each prompt


def test_get_generate_outputs_refuses_what_it_cannot_do(models: Callable[..., Any]) -> None:
    tokenizer = word_tokenizer(160)
    plain = models("plain", 1)
    with pytest.raises(IncompatibleConfigError, match="input_capture_hook"):
        accuracy.get_generate_outputs(plain, [words([5, 7])], tokenizer, input_capture_hook=print)
    with pytest.raises(ValueError, match="device='gpu'"):
        accuracy.get_generate_outputs(plain, [words([5, 7])], tokenizer, device="gpu")
    with pytest.raises(IncompatibleConfigError, match="the draft's batch_size=2"):
        accuracy.get_generate_outputs(
            models("target", 1), [words([5, 7])], tokenizer, draft_model=models("draft", 2), max_new_tokens=4
        )


def test_compat_exports_get_generate_outputs(compat_package: Path) -> None:
    from neuronx_distributed_inference.utils.accuracy import get_generate_outputs

    assert get_generate_outputs is accuracy.get_generate_outputs

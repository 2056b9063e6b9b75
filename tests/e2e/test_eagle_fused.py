"""EAGLE speculation through fused speculation, the feature guide's "Fused Speculation" example:
the target's NeuronConfig with `enable_eagle_speculation=True, enable_fused_speculation=True`, the
draft's a copy with `is_eagle_draft=True, enable_fused_speculation=False`, the draft an EAGLE draft
folder (`nxdi.testing.eagle.save_eagle_draft`), then to_cpu() or compile() + load(), and generate()
without an assistant model.

Drafts of the tiny llama: `random` (random EAGLE layers and fc: almost nothing accepted) and
`trained` (`train_eagle_draft` on a briefly trained target: most proposals accepted).

- greedy tokens equal transformers' greedy tokens at batch 1 and 4, with acceptance below / above
  stated bounds, through the context and fused programs only;
- rows at different positions cross token-generation buckets up to the last position of seq_len;
- compile() + load() in a fresh object gives the same tokens;
- sampling keeps the target's distribution (chi-square, stated false-failure rate);
- a wrong pairing of target and draft is refused naming every problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import nxdi
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.testing import checkpoints, training
from nxdi.testing import eagle as reference
from tests.support.engine_fixtures import NEW_TOKENS, PAD, SEQ_LEN, hf_generate, padded, program_calls
from tests.support.fused_models import K, eagle_config, fused_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LM = nxdi.NeuronLlamaForCausalLM
PROMPTS: tuple[tuple[int, ...], ...] = ((5, 8, 11, 14, 17), (100, 102), (7, 13, 19, 25, 31, 37, 43), (1,))
"""Progressions, the task the trained pair learned."""
TRAINED_ACCEPTANCE = 0.5
"""Accepted over proposed draft tokens of the trained pair at k = 4 (measured: 0.73 at batch 1, 0.64 at batch 4)."""
RANDOM_ACCEPTANCE = 0.2
"""The random draft stays below it (measured: 0)."""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path, Any]]:
    """`pairs(name)` -> (target checkpoint, EAGLE draft folder, the target as a transformers model)."""
    root = tmp_path_factory.mktemp("eagle-pairs")
    made: dict[str, tuple[Path, Path, Any]] = {}
    fmt = checkpoints.SaveFormat.SAFETENSORS

    def get(name: str) -> tuple[Path, Path, Any]:
        if name not in made:
            hf = checkpoints.build_model("llama", seed=0)
            if name == "trained":
                training.train_briefly(hf)
                draft = reference.train_eagle_draft(hf).draft
            else:
                assert name == "random"
                draft = reference.from_target(hf, seed=3)
            target = checkpoints.save_checkpoint(hf, root / f"{name}-target", fmt)
            made[name] = (target, reference.save_eagle_draft(draft, hf.lm_head.weight, root / f"{name}-draft"), hf)
        return made[name]

    return get


@pytest.fixture(scope="module")
def eagle(pairs: Callable[[str], tuple[Path, Path, Any]]) -> Callable[..., Any]:
    """`eagle(pair, **neuron_config)`: an EAGLE fused model run eagerly (to_cpu()), shared per arguments."""
    built: dict[str, Any] = {}

    def get(name: str, **kwargs: Any) -> Any:
        key = repr((name, sorted(kwargs.items())))
        if key not in built:
            target, draft, _ = pairs(name)
            built[key] = LM(target, eagle_config(target, draft, **kwargs))
            built[key].to_cpu()
        return built[key]

    return get


def generate(model: Any, prompts: Sequence[Sequence[int]], **kwargs: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """generate() on the right-padded prompts, no assistant model: the new tokens and the stats."""
    adapter = HuggingFaceGenerationAdapter(model)
    ids, mask = padded(prompts, "right")
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    out = adapter.generate(ids, attention_mask=mask, **settings)
    return out[:, ids.shape[1] :], adapter.speculation_stats


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("pair", ["random", "trained"])
def test_greedy_eagle_gives_the_targets_greedy_tokens(
    batch: int, pair: str, eagle: Callable[..., Any], pairs: Callable[[str], tuple[Path, Path, Any]]
) -> None:
    """32 new tokens per row equal to transformers' greedy tokens, rows advancing by their own
    counts, through the context and fused programs only; the trained draft's proposals mostly
    accepted, the random draft's almost never."""
    prompts = PROMPTS[:batch]
    model = eagle(pair, batch_size=batch)
    with program_calls(model) as calls:
        tokens, stats = generate(model, prompts)
    assert torch.equal(tokens, hf_generate(pairs(pair)[2], prompts, max_new_tokens=NEW_TOKENS))
    assert {c.phase.value for c in calls} == {"context_encoding", "fused_speculation"}
    rate = stats["accepted"] / stats["proposed"]
    assert (rate < RANDOM_ACCEPTANCE) if pair == "random" else (rate > TRAINED_ACCEPTANCE), stats
    assert stats["emitted"] == batch * NEW_TOKENS and stats["target_steps"] == len(calls) - 1


def test_rows_cross_token_generation_buckets_to_the_last_position(
    eagle: Callable[..., Any], pairs: Callable[[str], tuple[Path, Path, Any]]
) -> None:
    """Four rows of different prompt lengths (at different positions, accepting different counts)
    generate to the last position of seq_len through four token-generation buckets (three
    boundaries crossed, the hidden-state cache read across each): the target's greedy tokens."""
    buckets = {"enable_bucketing": True, "token_generation_buckets": [16, 32, 48, 64]}
    new = SEQ_LEN + 1 - max(len(p) for p in PROMPTS)
    model = eagle("trained", batch_size=4, context_encoding_buckets=[16, 64], **buckets)
    with program_calls(model) as calls:
        tokens, stats = generate(model, PROMPTS, max_new_tokens=new)
    assert torch.equal(tokens, hf_generate(pairs("trained")[2], PROMPTS, max_new_tokens=new))
    assert {c.length for c in calls if c.phase.value == "fused_speculation"} == {b + K for b in (16, 32, 48, 64)}
    assert 0 < stats["accepted"] < stats["proposed"], stats


def test_fused_outputs_hold_the_draft_and_target_logits(eagle: Callable[..., Any], pairs: Any) -> None:
    """forward() returns NxDI's fused_outputs: after the prompt the target's first token; a fused
    step's accepted tokens are the target's argmax after each accepted input, and its k draft logits
    propose the tokens it scored (the draft's argmax at step i is the input at i + 1)."""
    model = eagle("trained", batch_size=2, output_logits=True)
    ids, mask = padded(PROMPTS[:2], "right")
    model.reset()
    first = model.forward(ids, attention_mask=mask).fused_outputs
    fo = model.forward(first[1], position_ids=first[3]).fused_outputs
    accepted, draft_logits, target_logits = fo[0], fo[4], fo[5]
    assert draft_logits.shape == target_logits.shape == (2, K, target_logits.shape[-1])
    counts = (fo[3] - first[3])[:, 0]
    proposals = draft_logits.argmax(-1)  # [B, k]: the draft's token after each of its steps
    for row in range(2):
        c = int(counts[row])
        assert accepted[row, :c].tolist() == target_logits[row, :c].argmax(-1).tolist()
        assert accepted[row, : c - 1].tolist() == proposals[row, : c - 1].tolist()
        assert (accepted[row, c:] == -1).all()


def test_a_compiled_eagle_model_loads_in_a_fresh_object(pairs: Any, tmp_path: Path) -> None:
    """compile() writes one program per bucket holding the target, the EAGLE draft and the hidden-state
    cache; a fresh `NeuronLlamaForCausalLM(folder)` loads it and gives the target's greedy tokens."""
    target, draft, hf = pairs("trained")
    folder = tmp_path / "compiled"
    model = LM(target, eagle_config(target, draft, batch_size=4))
    model.compile(folder)
    programs = sorted(p.name for p in (folder / "programs").iterdir())
    assert programs == [f"context_encoding_{SEQ_LEN}.pt2", f"fused_speculation_{SEQ_LEN + K}.pt2"]
    model.close()
    fresh = LM(folder)
    assert fresh.config.fused_spec_config.draft_config.neuron_config.is_eagle_draft
    fresh.load(folder)
    tokens, stats = generate(fresh, PROMPTS)
    assert torch.equal(tokens, hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS))
    assert stats["accepted"] / stats["proposed"] > TRAINED_ACCEPTANCE, stats


def test_sampled_eagle_keeps_the_targets_distribution(eagle: Callable[..., Any], pairs: Any) -> None:
    """The first two new tokens of sampled runs (top_k=3, temperature 2: 9 possible pairs); the
    second comes from the first fused step: the draft's proposal accepted, or a residual draw.
    Against their exact probability p(t1) p(t2 | t1) from the target's logits (transformers'), a
    chi-square test over the pairs with at least 5 expected draws fails when its p-value is below
    1e-4 (the false-failure rate; the seed is fixed, so the outcome is too)."""
    temperature = 2.0
    model = eagle("trained", batch_size=4, on_device_sampling_config={"do_sample": True})
    hf, prompt = pairs("trained")[2], PROMPTS[0]

    def top3(sequence: Sequence[int]) -> dict[int, float]:
        with torch.no_grad():
            values, ids = hf(torch.tensor([list(sequence)])).logits[0, -1].float().topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values / temperature, -1).tolist(), strict=True))

    exact = {(t1, t2): p1 * p2 for t1, p1 in top3(prompt).items() for t2, p2 in top3((*prompt, t1)).items()}
    model.set_seed(11)
    counts: dict[tuple[int, int], int] = {}
    runs, accepted, proposed = 150, 0, 0
    for _ in range(runs):
        tokens, stats = generate(
            model, [prompt] * 4, max_new_tokens=2, do_sample=True, top_k=3, temperature=temperature
        )
        accepted, proposed = accepted + stats["accepted"], proposed + stats["proposed"]
        for t1, t2 in tokens.tolist():
            counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    n = 4 * runs
    assert set(counts) <= set(exact), "a pair outside the target's top 3 x top 3"
    cells = [(pair, p * n) for pair, p in exact.items() if p * n >= 5]
    stat = sum((counts.get(pair, 0) - e) ** 2 / e for pair, e in cells)
    p_value = float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))
    assert len(cells) >= 3 and p_value > 1e-4, (stat, counts, exact)
    assert 0 < accepted < proposed, "both accepted proposals and residual draws are exercised"


def test_a_wrong_eagle_pairing_is_refused_with_every_problem(pairs: Any, tmp_path: Path) -> None:
    """EAGLE with an ordinary draft, an EAGLE draft without EAGLE, a draft of another hidden size;
    and an EAGLE draft config alone is still refused as a model."""
    target, draft, _ = pairs("random")
    plain, _ = checkpoints.build_checkpoint(
        tmp_path / "plain", "llama", checkpoints.SaveFormat.SAFETENSORS, seed=7, num_hidden_layers=1
    )
    config = fused_config(target, plain, enable_eagle_speculation=True)
    with pytest.raises(IncompatibleConfigError, match=r"draft_config\.neuron_config\.is_eagle_draft=False"):
        LM(target, config)
    config = fused_config(target, draft)
    config.fused_spec_config.draft_config.neuron_config.is_eagle_draft = True
    with pytest.raises(IncompatibleConfigError, match="set enable_eagle_speculation=True on the target"):
        LM(target, config)
    wide = reference.from_target(checkpoints.build_model("llama", seed=1, hidden_size=128, intermediate_size=64))
    other = reference.save_eagle_draft(wide, None, tmp_path / "wide")
    with pytest.raises(IncompatibleConfigError, match=r"draft_config\.hidden_size=128"):
        LM(target, eagle_config(target, other))
    alone = LM.get_config_cls()(
        NeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN, is_eagle_draft=True),
        load_config=load_pretrained_config(draft),
    )
    with pytest.raises(IncompatibleConfigError, match="is_eagle_draft=True: marks an EAGLE draft"):
        LM(draft, alone)


def test_the_draft_sees_the_targets_hidden_states_across_calls(pairs: Any, tmp_path: Path) -> None:
    """A draft with input norms and an fc bias (`enable_eagle_draft_input_norm`, the config's
    fc_bias): after the prompt its logits at the last pair (the first token beside the prompt's last
    hidden state) equal the reference module's fed transformers' hidden states; the next call's
    first draft step pairs the same token with the same state, read back from the hidden-state
    cache, so it gives the same logits."""
    target, _, hf = pairs("random")
    module = reference.from_target(hf, input_norm=True, fc_bias=True, seed=5)
    draft = reference.save_eagle_draft(module, hf.lm_head.weight, tmp_path / "draft")
    config = eagle_config(target, draft, batch_size=2, output_logits=True)
    config.fused_spec_config.draft_config.neuron_config.enable_eagle_draft_input_norm = True
    model = LM(target, config)
    model.to_cpu()
    prompts = PROMPTS[:2]
    ids, mask = padded(prompts, "right")
    first = model.forward(ids, attention_mask=mask).fused_outputs
    step = model.forward(first[1], position_ids=first[3]).fused_outputs
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
            seq = torch.tensor([[*prompt[1:], int(first[0][row, 0])]])
            expected, _ = module(seq, out.hidden_states[-1])
        torch.testing.assert_close(first[4][row, 0], expected[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step[4][row, 0], expected[0, -1], atol=1e-4, rtol=1e-4)

"""EAGLE token-tree speculation through the documented API: flat EAGLE's flow (tests/e2e/test_eagle_fused.py)
plus `token_tree_config=TREE` and `speculation_length=` its node count on the target's NeuronConfig
(the draft's config, its copy, carries them too), then to_cpu() and generate() without an assistant model.

- greedy tokens equal transformers' greedy tokens at batch 1 and 4, with a random draft (almost nothing
  accepted) and a trained one (paths of several nodes accepted), across the token-generation bucket
  boundary (buckets 32 and 64) and, at batch 1, to the last position of seq_len;
- a step emits at most the tree's depth + 1 tokens (fused_outputs[0] is [B, depth + 1]);
- after tree steps, the target's, the draft's and the hidden-state caches below each row's next position
  equal those of a model that encoded only the emitted tokens: rejected nodes leave nothing behind;
- sampling and a tree of the wrong size are refused, naming the setting.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import nxdi
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.testing import checkpoints, training
from nxdi.testing import eagle as reference
from tests.support.engine_fixtures import NEW_TOKENS, PAD, SEQ_LEN, hf_generate, padded, program_calls, runtime_of
from tests.support.fused_models import eagle_config, fused_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LM = nxdi.NeuronLlamaForCausalLM
TREE = {"0": ["1", "2"], "1": ["3", "4"], "2": ["5"], "3": ["6"]}
"""7 nodes, depth 3: the root's top 2, the best one's top 2, the second's best, and one more level."""
NODES, DEPTH = 7, 3
BUCKETS = [32, 64]
PROMPTS: tuple[tuple[int, ...], ...] = ((5, 8, 11, 14, 17), (100, 102), (7, 13, 19, 25, 31, 37, 43), (1,))
"""Progressions, the task the trained pair learned."""
TRAINED_ACCEPTED = 1.2
"""Accepted tree nodes per row and step of the trained pair stay above it (at most DEPTH)."""
RANDOM_ACCEPTED = 0.3
"""The random draft's stay below it."""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path, Any]]:
    """`pairs(name)` -> (target checkpoint, EAGLE draft folder, the target as a transformers model)."""
    root = tmp_path_factory.mktemp("eagle-tree-pairs")
    made: dict[str, tuple[Path, Path, Any]] = {}

    def get(name: str) -> tuple[Path, Path, Any]:
        if name not in made:
            hf = checkpoints.build_model("llama", seed=0)
            if name == "trained":
                training.train_briefly(hf)
                draft = reference.train_eagle_draft(hf).draft
            else:
                draft = reference.from_target(hf, seed=3)
            target = checkpoints.save_checkpoint(hf, root / f"{name}-target", checkpoints.SaveFormat.SAFETENSORS)
            made[name] = (target, reference.save_eagle_draft(draft, hf.lm_head.weight, root / f"{name}-draft"), hf)
        return made[name]

    return get


@pytest.fixture(scope="module")
def tree_model(pairs: Callable[[str], tuple[Path, Path, Any]]) -> Callable[..., Any]:
    """`tree_model(pair, **neuron_config)`: an EAGLE token-tree model run eagerly, shared per arguments."""
    built: dict[str, Any] = {}

    def get(name: str, **kwargs: Any) -> Any:
        key = repr((name, sorted(kwargs.items())))
        if key not in built:
            target, draft, _ = pairs(name)
            settings = {
                "token_tree_config": TREE,
                "speculation_length": NODES,
                "enable_bucketing": True,
                "token_generation_buckets": BUCKETS,
            }
            built[key] = LM(target, eagle_config(target, draft, **{**settings, **kwargs}))
            built[key].to_cpu()
        return built[key]

    return get


def generate(model: Any, prompts: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, int]]:
    adapter = HuggingFaceGenerationAdapter(model)
    ids, mask = padded(prompts, "right")
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    out = adapter.generate(ids, attention_mask=mask, **settings)
    return out[:, ids.shape[1] :], adapter.speculation_stats


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("pair", ["random", "trained"])
def test_greedy_tree_gives_the_targets_greedy_tokens(
    batch: int, pair: str, tree_model: Callable[..., Any], pairs: Callable[[str], tuple[Path, Path, Any]]
) -> None:
    """32 new tokens per row (positions past the first bucket, 32) equal transformers' greedy tokens,
    through the context program and both tree programs; the trained draft's tree gets paths of
    several nodes accepted, the random draft's almost none."""
    prompts = PROMPTS[:batch]
    model = tree_model(pair, batch_size=batch)
    with program_calls(model) as calls:
        tokens, stats = generate(model, prompts)
    assert torch.equal(tokens, hf_generate(pairs(pair)[2], prompts, max_new_tokens=NEW_TOKENS))
    assert {(c.phase.value, c.length) for c in calls if c.phase.value != "context_encoding"} == {
        ("fused_speculation", b + NODES) for b in BUCKETS
    }
    per_step = stats["accepted"] / (stats["target_steps"] * batch)
    assert (per_step < RANDOM_ACCEPTED) if pair == "random" else (per_step > TRAINED_ACCEPTED), stats
    assert stats["emitted"] == batch * NEW_TOKENS


def test_a_step_emits_at_most_depth_plus_one_tokens(tree_model: Callable[..., Any], pairs: Any) -> None:
    """fused_outputs[0] is [B, depth + 1]; the trained pair's steps emit up to all of them, each row
    its count, the rest -1; generate() to the last position of seq_len gives the target's tokens."""
    model = tree_model("trained", batch_size=1)
    ids, mask = padded(PROMPTS[:1], "right")
    model.reset()
    fo = model.forward(ids, attention_mask=mask).fused_outputs
    assert fo[0].shape == (1, DEPTH + 1) and fo[0][0, 1:].tolist() == [-1] * DEPTH
    seen = []
    for _ in range(4):
        fo, at = model.forward(fo[1], position_ids=fo[3]).fused_outputs, fo[3]
        n = int(fo[3] - at)
        seen.append(n)
        assert fo[0].shape == (1, DEPTH + 1) and (fo[0][0, n:] == -1).all() and (fo[0][0, :n] >= 0).all()
    assert max(seen) == DEPTH + 1, seen
    hf, prompts = pairs("trained")[2], PROMPTS[2:3]
    new = SEQ_LEN + 1 - len(prompts[0])  # the last token at position max_length
    tokens, _ = generate(model, prompts, max_new_tokens=new)
    assert torch.equal(tokens, hf_generate(hf, prompts, max_new_tokens=new))


def test_rejected_nodes_leave_nothing_in_any_cache(tree_model: Callable[..., Any], pairs: Any) -> None:
    """After tree steps of the trained pair (rows accepting different paths, some nodes rejected),
    each row's target, draft and hidden-state caches below its next position n equal those of a flat
    EAGLE model that encoded only the row's emitted tokens (its context step holds the target's
    keys at 0..n-1, the draft's pairs (t_{q+1}, h_q) at q < n and h_q)."""
    target, draft, _ = pairs("trained")
    model = tree_model("trained", batch_size=4)
    prompts = (PROMPTS[0], (3, 90, 41, 7, 66), PROMPTS[2], (50, 20, 9))
    ids, mask = padded(prompts, "right")
    model.reset()
    fo = model.forward(ids, attention_mask=mask).fused_outputs
    seqs = [[*p, int(fo[0][r, 0])] for r, p in enumerate(prompts)]
    seen: list[int] = []
    for _ in range(5):
        fo, at = model.forward(fo[1], position_ids=fo[3]).fused_outputs, fo[3]
        counts = (fo[3] - at)[:, 0]
        seen += counts.tolist()
        for r in range(4):
            seqs[r] += fo[0][r, : int(counts[r])].tolist()
    assert max(seen) > 1 and min(seen) < DEPTH + 1, seen
    cache = runtime_of(model).cache
    flat = LM(target, eagle_config(target, draft, batch_size=1))
    flat.to_cpu()
    for r, seq in enumerate(seqs):
        n = int(fo[3][r])
        assert n == len(seq) - 1  # the last emitted token is fed next, not cached yet
        flat.reset()
        flat.forward(torch.tensor([seq[:n]]))
        plain = runtime_of(flat).cache
        assert len(plain.k) == len(cache.k)
        for ours, theirs in ((cache.k, plain.k), (cache.v, plain.v)):
            for layer in range(len(plain.k)):
                torch.testing.assert_close(ours[layer][r, :, :n], theirs[layer][0, :, :n], atol=1e-4, rtol=1e-4)


def test_sampling_and_a_wrong_tree_are_refused(pairs: Any) -> None:
    """Greedy only (on_device_sampling_config.do_sample named); speculation_length must be the node count;
    a broken tree lists every problem; a tree without EAGLE speculation is refused."""
    target, draft, _ = pairs("random")
    base = {"token_tree_config": TREE, "speculation_length": NODES}
    with pytest.raises(ValueError, match=r"on_device_sampling_config\.do_sample=True.*accepts greedily"):
        eagle_config(target, draft, **base, on_device_sampling_config={"do_sample": True})
    with pytest.raises(ValueError, match=r"speculation_length=4: .*set speculation_length=7"):
        eagle_config(target, draft, token_tree_config=TREE, speculation_length=4)
    broken = {"0": [1, 2], "1": [2], "x": [3]}
    with pytest.raises(ValueError, match=r"(?s)not an integer node id.*parent\(s\) \[0, 1\]"):
        eagle_config(target, draft, token_tree_config=broken, speculation_length=4)
    with pytest.raises(IncompatibleConfigError, match=r"token_tree_config.*set enable_eagle_speculation=True"):
        fused_config(target, draft, **base)


def test_a_compiled_tree_model_loads_in_a_fresh_object(pairs: Any, tmp_path: Path) -> None:
    """compile() writes the context program and one tree program per bucket (length bucket + nodes);
    a fresh `NeuronLlamaForCausalLM(folder)` keeps token_tree_config, loads them and gives the
    target's greedy tokens."""
    target, draft, hf = pairs("trained")
    folder = tmp_path / "compiled"
    settings = {"token_tree_config": TREE, "speculation_length": NODES, "batch_size": 4}
    model = LM(target, eagle_config(target, draft, **settings))
    model.compile(folder)
    programs = sorted(p.name for p in (folder / "programs").iterdir())
    assert programs == [f"context_encoding_{SEQ_LEN}.pt2", f"fused_speculation_{SEQ_LEN + NODES}.pt2"]
    model.close()
    fresh = LM(folder)
    assert fresh.neuron_config.token_tree_config == TREE
    fresh.load(folder)
    tokens, _ = generate(fresh, PROMPTS)
    assert torch.equal(tokens, hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS))


def test_async_mode_gives_the_same_tokens_and_runs_steps_ahead(
    tree_model: Callable[..., Any], pairs: Callable[[str], tuple[Path, Path, Any]]
) -> None:
    """async_mode launches each tree step ahead from the previous step's fused_outputs (next ids and
    positions); the tokens stay transformers' greedy ones and launched steps are used."""
    target, draft, hf = pairs("trained")
    settings = {"token_tree_config": TREE, "speculation_length": NODES, "batch_size": 4, "async_mode": True}
    ahead = LM(target, eagle_config(target, draft, **settings))
    ahead.to_cpu()
    try:
        tokens, _ = generate(ahead, PROMPTS)
        assert torch.equal(tokens, hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS))
        assert ahead.async_stats.used > 0, ahead.async_stats
    finally:
        ahead.close()

"""`nxdi.testing.training`: trained target/draft pairs are saved as Hugging Face checkpoints,
share a vocabulary, and are the same under the same seeds."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from nxdi.testing import training

QUICK = attrs.evolve(
    training.PAIRS["toy"], target_schedule=training.Schedule(steps=3), draft_schedule=training.Schedule(steps=3)
)
"""The toy recipe trained for 3 steps: enough to check files, shapes and determinism."""


def _pair(root: Path, seed: int = 0) -> tuple[training.TrainedModel, training.TrainedModel]:
    return training.train_pair(root / "target", root / "draft", recipe=QUICK, length=9, seed=seed)


def test_the_pair_is_saved_as_hugging_face_checkpoints_over_one_vocabulary(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    for trained in (target, draft):
        assert (trained.path / "config.json").is_file() and (trained.path / "model.safetensors").is_file()
        assert trained.loss == trained.loss and trained.seconds > 0  # a number, not NaN
    t, d = (json.loads((m.path / "config.json").read_text()) for m in (target, draft))
    assert t["vocab_size"] == d["vocab_size"] == 160
    assert (d["num_hidden_layers"], d["hidden_size"]) < (t["num_hidden_layers"], t["hidden_size"])
    assert sum(p.numel() for p in draft.model.parameters()) < sum(p.numel() for p in target.model.parameters()) / 3


def test_training_is_deterministic_under_its_seeds(tmp_path: Path) -> None:
    first, again, other = (_pair(tmp_path / name, seed=seed)[0] for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    a, b, c = (load_file(m.path / "model.safetensors") for m in (first, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_dropout_is_seeded_and_the_callers_random_state_kept() -> None:
    """OPT trains with dropout 0.1: two runs give the same weights, whatever the global generator
    held before, and the global generator goes on as if training had not drawn from it."""
    from nxdi.testing import checkpoints

    trained = []
    for seed in (1, 2):
        model = checkpoints.build_model("opt", initializer_range=0.02)
        assert model.config.dropout > 0
        torch.manual_seed(seed)
        training.train_briefly(model, steps=3, length=9, batch=4)
        after = torch.rand(4)
        torch.manual_seed(seed)
        assert torch.equal(after, torch.rand(4))  # the caller's stream is where it was
        trained.append(model.state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_fit_minimises_any_loss_of_a_batch() -> None:
    """The loop other trainers (Medusa heads, an EAGLE draft) reuse: here one bias learns the
    mean token of the progressions, as a share of the vocabulary (about one half)."""
    bias = torch.nn.Parameter(torch.zeros(()))
    loss = training.fit(
        [bias],
        lambda seq: (bias - seq.float().mean() / 160) ** 2,
        vocab=160,
        schedule=training.Schedule(steps=200, lr=0.02, length=8),
    )
    assert abs(float(bias) - 0.5) < 0.1 and loss < 0.01


def test_prompts_are_progressions_of_the_asked_lengths() -> None:
    rows = training.progression_prompts(160, lengths=[3, 7], seed=4)
    assert [len(r) for r in rows] == [3, 7]
    for r in rows:
        steps = {(b - a) % 160 for a, b in itertools.pairwise(r)}
        assert len(steps) == 1 and 1 <= steps.pop() <= 6


def test_an_unknown_recipe_is_a_key_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        training.train_pair(tmp_path / "t", tmp_path / "d", recipe="huge")

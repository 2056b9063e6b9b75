"""Briefly trained tiny checkpoints: stand-ins for real weights in accuracy and speculation tests.

A randomly initialised model has nearly flat logits, so bf16 rounding flips its argmax between
near-equal tokens and its max-scaled logit error sits at the edge of the reference tolerances,
for transformers' own bf16 run as much as for nxdi's. Real checkpoints are confident. A few
seconds of training on a learnable synthetic task (arithmetic progressions modulo the vocabulary)
gives a tiny model the same property, so a bf16 accuracy check measures the engine, not the
noise of random weights. The training uses its own seeded generator for data, and seeds torch's
global generator (forked, so the caller's is left as it was) for dropout: OPT trains with
dropout 0.1, and an unseeded dropout made its checkpoint differ from run to run.

Speculative decoding needs more: a target and a draft that *agree*, as a real model and its
distilled draft do. `train_pair` trains a target and a smaller draft (fewer layers, a narrower
hidden size, the same vocabulary; no tokenizer) on the same progressions and saves both as
Hugging Face checkpoints (config.json + model.safetensors). Two trained models predict the same
continuations, so a draft's proposals are mostly accepted, while two random models agree by chance.

Building blocks for other trainers (Medusa heads, an EAGLE draft: they take the trained target,
`TrainedModel.model`, and train their own parameters on the same data):
- `progression_batch` / `progression_prompts`: the data;
- `Schedule`: steps, learning rate, sequence length, batch and seed of a run;
- `fit(parameters, loss_of, vocab=..., schedule=...)`: the AdamW loop over fresh batches, given
  a loss of a batch [batch, length]; `train_briefly` is `fit` with the next-token loss.
Everything is deterministic under `Schedule.seed` and the models' build seeds (on one machine
and thread count: float reductions may differ across CPUs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import transformers

from nxdi.testing import checkpoints


def progression_batch(vocab: int, *, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] sequences `(start + stride * i) % vocab` with random start and stride 1..6."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 7, (batch, 1), generator=generator)
    return (start + stride * torch.arange(length)[None, :]) % vocab


def progression_prompts(vocab: int, *, lengths: Iterable[int], seed: int = 1) -> list[list[int]]:
    """One progression per entry of `lengths`, each that long: in-distribution prompts for a
    trained model (drawn from a generator of their own, not the training stream)."""
    generator = torch.Generator().manual_seed(seed)
    return [progression_batch(vocab, batch=1, length=n, generator=generator)[0].tolist() for n in lengths]


@attrs.frozen(kw_only=True)
class Schedule:
    """One training run: `steps` AdamW steps, each on a fresh batch of progressions."""

    steps: int = attrs.field(default=150, validator=attrs.validators.ge(1))
    lr: float = attrs.field(default=3e-3, validator=attrs.validators.gt(0))
    length: int = attrs.field(default=33, validator=attrs.validators.ge(3))
    """Tokens per training sequence: train on as many as the model will generate up to (past
    them it extrapolates and its top logits come close to ties)."""
    batch: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    seed: int = 0
    """Seed of the data stream (model weights are seeded where they are built)."""


def fit(
    parameters: Iterable[torch.nn.Parameter],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    *,
    vocab: int,
    schedule: Schedule,
) -> float:
    """Minimise `loss_of(batch)` (a scalar; batch [schedule.batch, schedule.length] progressions
    over `vocab`) with AdamW on `parameters` for `schedule.steps` steps; returns the last loss.
    The caller sets train/eval modes (`train_briefly` does for a whole model)."""
    generator = torch.Generator().manual_seed(schedule.seed)
    optimizer = torch.optim.AdamW(list(parameters), lr=schedule.lr)
    loss = torch.tensor(float("nan"))
    # Dropout draws from torch's global generator: seed a fork of it, so a run is repeatable and
    # the caller's random state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(schedule.seed)
        for _ in range(schedule.steps):
            batch = progression_batch(vocab, batch=schedule.batch, length=schedule.length, generator=generator)
            loss = loss_of(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return float(loss.detach())


def next_token_loss(model: transformers.PreTrainedModel, seq: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `model`'s next-token logits on `seq` [B, S] (the causal LM loss)."""
    logits = model(seq[:, :-1]).logits  # [B, S-1, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))


def train_briefly(
    model: transformers.PreTrainedModel,
    *,
    steps: int = 150,
    seed: int = 0,
    lr: float = 3e-3,
    length: int = 33,
    batch: int = 32,
) -> float:
    """Train `model` in place on progressions of `length` tokens for `steps` AdamW steps; returns the last loss.

    With the tiny test configurations the loss drops from ~5 to ~0.2 in 150 steps (2-3 s on 2 cores).
    Past `length` positions the model extrapolates and its top logits come close to ties, so a test
    that generates further should train on sequences as long as it generates (80: ~7 s).
    """
    schedule = Schedule(steps=steps, seed=seed, lr=lr, length=length, batch=batch)
    model.train()
    try:
        return fit(
            model.parameters(),
            lambda seq: next_token_loss(model, seq),
            vocab=model.config.vocab_size,
            schedule=schedule,
        )
    finally:
        model.eval()


@attrs.frozen(kw_only=True, eq=False)
class TrainedModel:
    """A trained checkpoint: where it was saved, the transformers model (eval mode, fp32), its
    last training loss and the seconds training took."""

    path: Path
    model: transformers.PreTrainedModel
    loss: float
    seconds: float


_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
"""A one-layer draft of hidden size 32 (~20k parameters over the tiny base's vocabulary of 160)."""


@attrs.frozen(kw_only=True, eq=False)
class PairRecipe:
    """A target and its draft: config overrides (over `nxdi.testing.checkpoints`' tiny base of the
    variant) and training schedules. The draft's vocabulary is always the target's."""

    target: Mapping[str, Any] = attrs.field(factory=dict)
    draft: Mapping[str, Any] = attrs.field(factory=lambda: dict(_DRAFT))
    target_schedule: Schedule = Schedule()
    draft_schedule: Schedule = Schedule()


PAIRS: Mapping[str, PairRecipe] = {
    "toy": PairRecipe(),
    "small": PairRecipe(
        target=dict(
            hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2
        ),
        target_schedule=Schedule(steps=150, lr=1e-3, batch=8),
    ),
}
"""Named recipes. `toy`: the tiny base as target (hidden 64, 2 layers, ~95k parameters) and the
~20k-parameter draft, about 2 + 1 s of training on 2 cores at 65 tokens, for tests. `small`: a
target of hidden 384 and 6 layers (~9.6M parameters, about 4x the draft's decode step on the CPU
engine; 0.25-0.55 s per training step at 80 tokens, so 40-80 s), for `nxdi bench generate
--speculation draft`."""


def train_checkpoint(
    directory: str | os.PathLike[str],
    *,
    variant: str = "llama",
    schedule: Schedule = Schedule(),
    seed: int = 0,
    **overrides: Any,
) -> TrainedModel:
    """Build a random `variant` model (`checkpoints.build_model(variant, seed=seed, **overrides)`,
    initializer_range 0.02 unless overridden), train it with `schedule` on the next-token loss and
    save it to `directory` as config.json + model.safetensors (fp32)."""
    model = checkpoints.build_model(variant, seed=seed, **{"initializer_range": 0.02, **overrides})
    start = time.perf_counter()
    loss = train_briefly(
        model, steps=schedule.steps, seed=schedule.seed, lr=schedule.lr, length=schedule.length, batch=schedule.batch
    )
    seconds = time.perf_counter() - start
    path = checkpoints.save_checkpoint(model, directory, checkpoints.SaveFormat.SAFETENSORS)
    return TrainedModel(path=path, model=model, loss=loss, seconds=seconds)


def train_pair(
    target_dir: str | os.PathLike[str],
    draft_dir: str | os.PathLike[str],
    *,
    recipe: PairRecipe | str = "toy",
    length: int | None = None,
    variant: str = "llama",
    seed: int = 0,
) -> tuple[TrainedModel, TrainedModel]:
    """Train a target and its draft on the same progressions and save each in its folder:
    (target, draft).

    Args:
        recipe: a `PairRecipe`, or the name of one in `PAIRS`.
        length: tokens per training sequence for both (default: the recipe's schedules'); give the
            prompt length plus the new tokens the tests generate.
        seed: the target's weights; the draft's are drawn from `seed + 1`, its data stream is the
            same as the target's.

    Raises:
        KeyError: `recipe` names no entry of `PAIRS`.
    """
    chosen = PAIRS[recipe] if isinstance(recipe, str) else recipe
    target = train_target(target_dir, recipe=chosen, length=length, variant=variant, seed=seed)
    schedule = chosen.draft_schedule if length is None else attrs.evolve(chosen.draft_schedule, length=length)
    overrides = {**chosen.draft, "vocab_size": target.model.config.vocab_size}
    draft = train_checkpoint(draft_dir, variant=variant, schedule=schedule, seed=seed + 1, **overrides)
    return target, draft


def train_target(
    directory: str | os.PathLike[str],
    *,
    recipe: PairRecipe | str = "toy",
    length: int | None = None,
    variant: str = "llama",
    seed: int = 0,
) -> TrainedModel:
    """The target of `recipe` alone, trained and saved as `train_pair` trains and saves it (the same
    weights under the same arguments): for drafts trained from the target (Medusa heads, an EAGLE draft).

    Raises:
        KeyError: `recipe` names no entry of `PAIRS`.
    """
    chosen = PAIRS[recipe] if isinstance(recipe, str) else recipe
    schedule = chosen.target_schedule if length is None else attrs.evolve(chosen.target_schedule, length=length)
    return train_checkpoint(directory, variant=variant, schedule=schedule, seed=seed, **chosen.target)

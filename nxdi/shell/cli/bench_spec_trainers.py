"""Drafts the `medusa` and `eagle` methods of `nxdi bench generate --speculation` train from the
trained target: Medusa heads (`nxdi.testing.medusa.train_medusa_heads`) and an EAGLE draft
(`nxdi.testing.eagle.train_eagle_draft`), on the same progressions the target learned, seeded.

Each trainer takes the trained target (`nxdi.testing.training.TrainedModel`), a folder and the
options, and returns a `TrainedModel` whose `path` is what nxdi loads (a copy of the target's
checkpoint with `medusa_heads.pt`, or an EAGLE draft folder), `model` the trained torch module
(the heads, or the EAGLE draft), and its last loss and training seconds. A training step's time
is mostly the frozen target's forward pass over its batch, so with the `small` target they train
on batches of 8, 18-36 s each (`MEDUSA_SCHEDULES`, `EAGLE_SCHEDULES`; the target takes 60-105 s).
Heavy libraries are imported inside the functions."""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MEDUSA_HEADS = 4
"""Heads of the `medusa` method: one per level of `nxdi.testing.medusa.DEFAULT_TREE` (4 deep)."""

MEDUSA_SCHEDULES: Mapping[str, tuple[int, int]] = {"toy": (200, 32), "small": (120, 8)}
"""`--shape` -> (steps, batch) of the heads' training. At `small` on one thread: about 18 s on an
idle machine (27 s on a busy one), last loss ~0.23 (the mean over heads; 60 steps: 9 s, 0.56)."""

EAGLE_SCHEDULES: Mapping[str, tuple[int, int]] = {"toy": (200, 32), "small": (120, 8)}
"""`--shape` -> (steps, batch) of the EAGLE draft's training. At `small` on one thread: about 26 s
(36 s on a busy machine);
then the fused EAGLE model accepts 0.98 of its proposals at k = 5, batch 1 (0.91 at batch 4).
60 steps (14 s) gave 0.64: the draft feeds its own hidden states forward, so a small error in
them compounds over the k-1 proposals (200 steps, 42 s: 0.98 / 0.94)."""


def medusa_heads(target: Any, folder: Path, args: argparse.Namespace) -> Any:
    """A copy of the target's checkpoint in `folder` with `MEDUSA_HEADS` heads trained on it
    (`medusa_heads.pt`), on sequences of `--prompt-len` + `--new-tokens` tokens."""
    from nxdi.testing import medusa
    from nxdi.testing.training import TrainedModel

    steps, batch = MEDUSA_SCHEDULES[args.shape]
    shutil.copytree(target.path, folder)
    start = time.perf_counter()
    heads, loss = medusa.train_medusa_heads(
        target.model, num_heads=MEDUSA_HEADS, steps=steps, length=args.prompt_len + args.new_tokens, batch=batch
    )
    seconds = time.perf_counter() - start
    medusa.save_medusa_heads(heads, folder)
    return TrainedModel(path=folder, model=heads, loss=loss, seconds=seconds)


def eagle_draft(target: Any, folder: Path, args: argparse.Namespace) -> Any:
    """A one-layer EAGLE draft of the target trained on its hidden states, saved in `folder` with the
    target's lm_head (`nxdi.testing.eagle.save_eagle_draft`)."""
    from nxdi.testing import eagle
    from nxdi.testing.training import TrainedModel

    steps, batch = EAGLE_SCHEDULES[args.shape]
    start = time.perf_counter()
    trained = eagle.train_eagle_draft(target.model, steps=steps, length=args.prompt_len + args.new_tokens, batch=batch)
    seconds = time.perf_counter() - start
    path = eagle.save_eagle_draft(trained.draft, target.model.lm_head.weight, folder)
    return TrainedModel(path=path, model=trained.draft, loss=trained.loss, seconds=seconds)

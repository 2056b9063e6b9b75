"""The checkpoints a model's weights come from, and how a compiled folder pins them. Effects:
reads checkpoints (a scan of every byte) and pin files, writes pin files.

A compiled folder that reads its weights from the original checkpoints at load (no
`save_sharded_checkpoint`) pins their files (name, size, mtime, sha256: `checkpoint_scan`) at
compile, and load() refuses a checkpoint changed since:

- one checkpoint's files (with a Medusa model's heads file after them) are the manifest's `source`;
- any other checkpoint (a fused draft's) is pinned in its own file beside the manifest
  (`Pinned.side`, `manifest.write_side_pin`), which the manifest lists.

A model names its checkpoints (`engine.Deployable.checkpoints`); `scan` checks and pins them at
compile and re-pin, `check` compares them with the pins at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ArtifactError, CheckpointError, Problem
from nxdi.core.weight_plan import WeightPlan
from nxdi.effects import checkpoint, checkpoint_scan, manifest, medusa_heads, weight_loader
from nxdi.effects.checkpoint_scan import SourceFile


@attrs.frozen(kw_only=True)
class CheckpointSource:
    """Where a model's weights come from: the original checkpoint, and how it converts."""

    path: str
    """The original Hugging Face checkpoint (a folder or a file)."""
    plan: WeightPlan
    """How it converts into the programs' weights (the whole model; each rank derives its share)."""
    allow_nonfinite: bool = False
    """Accept NaN and inf weights (NXDI_ALLOW_NONFINITE_WEIGHTS=1); otherwise compile() and
    to_cpu() refuse them, naming each tensor."""
    medusa_heads: str | None = None
    """A Medusa model's heads file (`medusa_heads.pt`, `nxdi.effects.medusa_heads`); None otherwise."""


@attrs.frozen(kw_only=True)
class Pinned:
    """One checkpoint a model reads its weights from, and where a compiled folder pins its files."""

    source: CheckpointSource
    side: str | None = None
    """The folder's own file pinning it (a fused draft's `draft_source.json`, listed in the
    manifest), or None: the manifest's `source`."""
    prefix: str = ""
    """Put before the field of each of its checkpoint problems (`draft_model`), naming which checkpoint."""


Scanned = tuple[tuple[Pinned, tuple[SourceFile, ...]], ...]
"""Every checkpoint of a model with the files to pin for it."""


def scan(checkpoints: Sequence[Pinned]) -> Result[Scanned, CheckpointError]:
    """Check every checkpoint as compile() does (headers, then every value:
    `weight_loader.scan_source`) and give each one's files to pin (a Medusa model's heads file
    after the checkpoint's). A CheckpointError lists every problem of every checkpoint."""
    found: list[tuple[Pinned, tuple[SourceFile, ...]]] = []
    problems: list[Problem] = []
    for pinned in checkpoints:
        s = pinned.source
        scanned = weight_loader.scan_source(s.path, s.plan, allow_nonfinite=s.allow_nonfinite)
        match scanned.bind(lambda scan, s=s: _with_heads(s, scan.files)):
            case Success(files):
                found.append((pinned, files))
            case Failure(err):
                problems.extend(p.prefixed(pinned.prefix) if pinned.prefix else p for p in err.problems)
    return Failure(CheckpointError(problems=tuple(problems))) if problems else Success(tuple(found))


def manifest_source(scanned: Scanned) -> tuple[SourceFile, ...]:
    """The files the manifest's `source` pins (the checkpoint with no side file)."""
    return next((files for pinned, files in scanned if pinned.side is None), ())


def write_side_pins(folder: Path, scanned: Scanned) -> list[str]:
    """Pin every checkpoint but the manifest's in its own file (`manifest.write_side_pin`); their names."""
    return [manifest.write_side_pin(folder, pinned.side, files) for pinned, files in scanned if pinned.side is not None]


def _with_heads(
    source: CheckpointSource, pinned: Sequence[SourceFile]
) -> Result[tuple[SourceFile, ...], CheckpointError]:
    """The files a compiled folder pins: the checkpoint's `pinned`, then a Medusa model's heads file."""
    if source.medusa_heads is None:
        return Success(tuple(pinned))
    found = checkpoint.find_checkpoint(source.path)
    return medusa_heads.pin(source.medusa_heads, found).map(lambda heads: (*pinned, heads))


def check(
    root: Path, pinned_source: Sequence[SourceFile], checkpoints: Sequence[Pinned]
) -> Result[None, ArtifactError]:
    """Every checkpoint is there and as pinned at compile in the folder `root` (`pinned_source`:
    its manifest's `source`; a side file's for the others). A gone one reads as weights gone
    (`not_found`, as FileNotFoundError); the error lists every problem of every checkpoint."""
    problems: list[Problem] = []
    missing = False
    for pinned in checkpoints:
        recorded = pinned_source if pinned.side is None else manifest.read_side_pin(root, pinned.side)
        try:
            found = checkpoint.find_checkpoint(pinned.source.path)
        except FileNotFoundError:
            why = "holds no checkpoint: the folder was compiled without save_sharded_checkpoint, so its weights come from it"
            fix = "restore the checkpoint, or compile with save_sharded_checkpoint=True"
            problems.append(Problem.of(pinned.source.path, "<missing>", why, fix))
            missing = True
            continue
        if pinned.source.medusa_heads is not None:  # pinned beside the checkpoint's files
            found = medusa_heads.pinned_files(found, pinned.source.medusa_heads)
        match checkpoint_scan.check_pinned(recorded, found):
            case Failure(err):
                problems.extend(err.problems)
    return Failure(ArtifactError(problems=tuple(problems), not_found=missing)) if problems else Success(None)

"""The Medusa heads' file, `<model dir>/medusa_heads.pt`: found, read and checked. Effects: reads it.

NxDI loads the heads from `medusa_heads.pt` beside the checkpoint (`torch.load`) and adds them to
the model's state dict. nxdi reads it with `weights_only=True` (no code in the file runs), checks
it against the layout `nxdi.core.planning.medusa.head_shapes` gives (every key present, every
shape right, floating point, finite), and casts the heads to the model's dtype. Keys of heads
beyond `num_medusa_heads` are ignored (a model may use fewer heads than were trained). Every
problem is reported at once, each naming the file and the key.

A compiled folder pins the heads file in its manifest with the checkpoint's files (`pin`), so a
load that reads its weights from the original checkpoint (no `save_sharded_checkpoint`) refuses
heads changed since compile, naming the file (the fix: compile again, or re-pin with
`load(..., repin_checkpoint=True)`).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core import weight_checks
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import CheckpointError, Problem
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import medusa as medusa_plan
from nxdi.effects import checkpoint, checkpoint_scan
from nxdi.effects.checkpoint_scan import SourceFile

_READ_ERRORS = (
    OSError,
    RuntimeError,
    ValueError,
    TypeError,
    EOFError,
    KeyError,
    AttributeError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
)
"""What torch.load raises for a file that is not a weights-only torch file (truncated, pickled code, ...)."""

_FIX = "save the heads there in the documented layout (nxdi.testing.medusa.save_medusa_heads writes it), or set is_medusa=False"


def heads_path(model_path: str | os.PathLike[str]) -> Path:
    """Where a model's heads are: `medusa_heads.pt` in its directory (beside a checkpoint file)."""
    path = Path(model_path)
    return (path.parent if path.is_file() else path) / medusa_plan.HEADS_FILE


def _absent(path: Path) -> CheckpointError | None:
    """The error of a heads file that is missing or not a regular file, else None."""
    if not os.path.lexists(path):
        why = "is missing: a Medusa model (is_medusa=True) reads its heads from it"
        return CheckpointError.of(str(path), "<missing>", why, _FIX)
    odd = checkpoint.irregular(path)
    if odd is not None:
        return CheckpointError.of(str(path), "<not a file>", f"is {odd}", "replace it with the heads' file")
    return None


def pin(path: str | os.PathLike[str], files: checkpoint.CheckpointFiles) -> Result[SourceFile, CheckpointError]:
    """The heads file's record for a compiled folder's manifest, beside the checkpoint `files`' own
    (`checkpoint_scan.pin_file`): load() then refuses heads changed since compile, as it refuses a
    changed checkpoint. A CheckpointError when the file is missing or not a regular file."""
    where = Path(path)
    absent = _absent(where)
    return Failure(absent) if absent is not None else Success(checkpoint_scan.pin_file(files, where))


def pinned_files(files: checkpoint.CheckpointFiles, path: str | os.PathLike[str]) -> checkpoint.CheckpointFiles:
    """The checkpoint `files` with the heads file `path` among them (when it exists), as load()
    compares them with the manifest's pins (a gone heads file then reads as gone since compile)."""
    where = Path(path)
    return attrs.evolve(files, shards=(*files.shards, where)) if os.path.lexists(where) else files


def _load(path: Path) -> Result[dict[str, Tensor], CheckpointError]:
    """The file's name -> tensor dict, read with weights_only=True."""
    absent = _absent(path)
    if absent is not None:
        return Failure(absent)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except _READ_ERRORS as e:
        said = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(str(e).split()))  # torch's message has terminal colours
        if "Weights only load failed" in said:  # pickled code or objects: never run
            said = "it holds pickled objects other than tensors, which weights_only=True does not load"
        why = f"cannot be read as a weights-only torch file ({type(e).__name__}: {said[:200]})"
        return Failure(CheckpointError.of(str(path), "<unreadable>", why, _FIX))
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
        why = f"holds a {type(loaded).__name__}, not a state dict of name -> tensor"
        return Failure(CheckpointError.of(str(path), "<unreadable>", why, _FIX))
    return Success(loaded)


def check_heads(
    tensors: dict[str, Tensor], path: Path, *, num_heads: int, hidden: int, vocab: int, allow_nonfinite: bool
) -> list[Problem]:
    """Every missing, misshapen, non-floating or (unless allowed) non-finite head tensor."""
    problems = []
    for key, shape in medusa_plan.head_shapes(num_heads, hidden=hidden, vocab=vocab).items():
        t = tensors.get(key)
        if t is None:
            why = f"is missing from {path} (num_medusa_heads={num_heads} heads need it)"
            problems.append(Problem.of(key, "<missing>", why, "save every head, or lower num_medusa_heads"))
        elif tuple(t.shape) != shape:
            why = f"in {path} has shape {list(t.shape)}, expected {list(shape)} (hidden_size={hidden}, vocab_size={vocab})"
            problems.append(Problem.of(key, list(t.shape), why, "train the heads for this model"))
        elif not t.is_floating_point():
            problems.append(Problem.of(key, str(t.dtype), f"in {path} is not floating point", "save float weights"))
        elif not allow_nonfinite and (bad := checkpoint_scan.count_nonfinite(t)) is not None:
            why = f"in {path} holds {bad.describe()}"
            problems.append(
                Problem.of(key, "<non-finite>", why, f"fix the heads, or set {weight_checks.ALLOW_NONFINITE}=1")
            )
    return problems


def read_for(
    spec: NeuronSpec, model: ModelSpec, path: str | os.PathLike[str], *, allow_nonfinite: bool = False
) -> Result[dict[str, Tensor], CheckpointError]:
    """The heads of a Medusa model (`spec.is_medusa`) of architecture `model` from `path` (`read_heads`)."""
    return read_heads(
        path,
        num_heads=spec.num_medusa_heads,
        hidden=model.hidden_size,
        vocab=model.vocab_size,
        dtype=spec.torch_dtype,
        allow_nonfinite=allow_nonfinite,
    )


def read_heads(
    path: str | os.PathLike[str],
    *,
    num_heads: int,
    hidden: int,
    vocab: int,
    dtype: str,
    allow_nonfinite: bool = False,
) -> Result[dict[str, Tensor], CheckpointError]:
    """The heads in `path` (a `medusa_heads.pt`), checked and cast to `dtype`, in binding order.

    Returns:
        name -> tensor for every head key of `num_heads` heads, or a CheckpointError naming the
        file (missing, not a regular file, unreadable, not a state dict) or every bad key.
    """
    where = Path(path)

    def checked(tensors: dict[str, Tensor]) -> Result[dict[str, Tensor], CheckpointError]:
        problems = check_heads(
            tensors, where, num_heads=num_heads, hidden=hidden, vocab=vocab, allow_nonfinite=allow_nonfinite
        )
        if problems:
            return Failure(CheckpointError(problems=tuple(problems)))
        want = weight_ops.torch_dtype(dtype)
        keys = medusa_plan.head_shapes(num_heads, hidden=hidden, vocab=vocab)
        return Success({k: tensors[k].to(want).contiguous() for k in keys})

    return _load(where).bind(checked)

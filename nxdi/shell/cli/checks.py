"""Command-line arguments checked before any long step (compiling, loading). Effects: reads file
metadata, probes a folder for writability (with a temporary file the system removes).

Each check raises `UsageError` naming the flag, the value, why, and the fix, so `nxdi` exits 2 with
one message before it has compiled anything.
"""

from __future__ import annotations

import re
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.shell.cli.errors import UsageError


def model_class(model_type: str | None, model_path: str, task: str = "causal-lm") -> Any:
    """The application class of `--model-type` (default: the checkpoint's config.json's model_type).

    Raises:
        UsageError: no family the engine runs has that model_type.
        FileNotFoundError, PermissionError, IncompatibleConfigError: config.json is missing,
            unreadable or not JSON (see `nxdi.shell.models.model_type_of`).
    """
    from nxdi.shell.models import MODEL_TYPES, model_type_of

    try:
        name = model_type or model_type_of(model_path)
    except KeyError as exc:
        raise UsageError(f"--model-path {model_path!r}: {exc.args[0]}") from None
    if name not in MODEL_TYPES:
        raise UsageError(f"--model-type {name!r}: is not a model type nxdi runs (supported: {', '.join(MODEL_TYPES)})")
    return MODEL_TYPES[name][task]


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a file" if stat.S_ISREG(mode) else "not a folder"


def output_folder(path: str, flag: str = "--compiled-model-path") -> Path:
    """`path` as a folder nxdi can write: an existing, writable folder, or a new one whose nearest
    existing parent is a writable folder.

    Raises:
        UsageError: it (or that parent) is a file, a device or otherwise not a folder, or cannot be
            written (probed with a temporary file, so it holds for root and read-only mounts too).
    """
    folder = Path(path)
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    st = existing.stat()
    if not stat.S_ISDIR(st.st_mode):
        what = "is" if existing == folder else f"is inside {str(existing)!r}, which is"
        raise UsageError(f"{flag} {path!r}: {what} {_kind(st.st_mode)}, not a folder. Fix: name a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        where = "" if existing == folder else f" (its parent {str(existing)!r})"
        why = exc.strerror or str(exc)
        raise UsageError(f"{flag} {path!r}{where}: cannot be written ({why}). Fix: name a writable folder") from None
    return folder


_SEPARATORS = re.compile(r"[\s,]+")


def token_rows(texts: Sequence[str], flag: str = "--input-ids") -> list[list[int]]:
    """Each `--input-ids` value ("1 5 7" or "1,5,7") as a list of token ids.

    Raises:
        UsageError: a value holds no ids, or an id that is not an integer.
    """
    rows = []
    for text in texts:
        tokens = [t for t in _SEPARATORS.split(text.strip()) if t]
        if not tokens:
            raise UsageError(f"{flag} {text!r}: holds no token ids. Fix: give ids like {flag} '1 5 7'")
        bad = [t for t in tokens if not re.fullmatch(r"[+-]?\d+", t)]
        if bad:
            what = "is not an integer token id" if len(bad) == 1 else "are not integer token ids"
            raise UsageError(f"{flag} {text!r}: {', '.join(map(repr, bad))} {what}")
        rows.append([int(t) for t in tokens])
    return rows


def check_vocab(rows: Sequence[Sequence[int]], vocab_size: int, flag: str = "--input-ids") -> None:
    """Raises UsageError naming every id outside [0, vocab_size)."""
    bad = sorted({t for row in rows for t in row if not 0 <= t < vocab_size})
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        what = f"token id {shown} is" if len(bad) == 1 else f"token ids {shown} are"
        raise UsageError(
            f"{flag}: {what} outside the model's vocabulary (vocab_size={vocab_size}: ids "
            f"0..{vocab_size - 1}). Fix: give ids below {vocab_size}"
        )


def check_length(rows: Sequence[Sequence[int]], spec: NeuronSpec, flag: str = "--input-ids") -> None:
    """Raises UsageError when a prompt is longer than max_context_length (unless allow_input_truncation)."""
    longest = max((len(row) for row in rows), default=0)
    if longest > spec.max_context_length and not spec.allow_input_truncation:
        raise UsageError(
            f"{flag}: a prompt of {longest} tokens is longer than max_context_length={spec.max_context_length}. "
            "Fix: raise --max-context-length (and --seq-len), or pass --allow-input-truncation"
        )

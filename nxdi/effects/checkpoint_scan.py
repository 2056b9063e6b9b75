"""One streaming pass over a checkpoint's bytes: their identity (sha256) and any NaN or inf in its
weights. Effects: reads checkpoint files (never writes them).

Compiling reads only the checkpoint's headers to trace, so without this pass nothing would look
at the values, and a compiled folder that reads its weights from the original checkpoint at load
(no `save_sharded_checkpoint`) would take whatever the checkpoint holds by then. So `compile()`
scans every file once:

- a `.safetensors` file is read front to back in 16 MiB chunks; each chunk updates the file's
  sha256 and, when it lies inside a tensor the model reads, is checked for non-finite values
  (one `aminmax`: NaN and inf propagate into the min or max). Memory stays at one chunk, whatever
  the tensor sizes; every byte is read once.
- a `.bin` file (legacy, pickled) is hashed in chunks and its tensors are checked as the
  memory-mapped state dict holds them; an index file is hashed.

The result's `SourceFile` records (name, size, mtime, sha256) are pinned in the compiled folder's
manifest; `check_pinned` compares a checkpoint with them at load. It re-hashes a file only when its
size matches but its mtime does not (a copy, a `touch`, a re-download): size and mtime equal to the
record are taken as "unchanged", which costs one `stat` per file instead of reading gigabytes at
every load. A change that keeps both the size and the nanosecond mtime (a deliberate one) is not
detected; re-pinning (`load(..., repin_checkpoint=True)`) records new mtimes and re-checks the values.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ArtifactError, Problem
from nxdi.core.weight_checks import NonFinite
from nxdi.effects import checkpoint

_CHUNK = 1 << 24
"""Bytes read at a time (a multiple of every element size)."""
_NO_MINMAX = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
"""Dtypes torch's CPU aminmax does not take: checked in float32, one chunk at a time."""
_HASHED: dict[tuple[str, int, int, int], str] = {}
"""(real path, inode, size, mtime_ns) -> sha256, so one process hashes an unchanged file once
(every rank of an SPMD load checks the same files)."""


@attrs.frozen(kw_only=True)
class SourceFile:
    """One file of the original checkpoint, as it was when the model was compiled."""

    path: str
    """Relative to the checkpoint's directory, `/`-separated."""
    size: int
    """Bytes."""
    mtime_ns: int
    """Modification time (ns since the epoch), so an unchanged file needs no re-hash at load."""
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns, "sha256": self.sha256}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SourceFile:
        """The inverse of `to_json`. Raises KeyError/TypeError/ValueError on a malformed record."""
        return cls(
            path=str(raw["path"]), size=int(raw["size"]), mtime_ns=int(raw["mtime_ns"]), sha256=str(raw["sha256"])
        )


@attrs.frozen(kw_only=True)
class Scan:
    """What one pass over a checkpoint found."""

    files: tuple[SourceFile, ...]
    """Every file: the index (if any) first, then the shards."""
    nonfinite: tuple[tuple[str, NonFinite], ...]
    """(checkpoint key, counts) of every scanned tensor holding NaN or inf."""


def count_nonfinite(t: Tensor) -> NonFinite | None:
    """The NaN and inf values in `t`, or None when there are none (or `t` is not floating point).

    One `aminmax` pass per chunk (NaN and inf propagate into the min or max, and it allocates
    nothing); they are counted only when there are some.
    """
    if t.numel() == 0 or not t.is_floating_point():
        return None
    flat, step = t.reshape(-1), _CHUNK // t.element_size()
    counts = [_bad(flat[start : start + step]) for start in range(0, flat.numel(), step)]
    return _found(counts, t.numel())


def _bad(x: Tensor) -> tuple[int, int]:
    """(NaN, inf) counts of a chunk: one `aminmax` when every value is finite (the usual case)."""
    if x.dtype in _NO_MINMAX:
        x = x.float()  # exact: every float8 value (NaN and inf too) is a float32 value
    lo, hi = torch.aminmax(x)  # ~20 GB/s per core; isfinite().all() is ~0.5 GB/s (it allocates)
    if math.isfinite(lo) and math.isfinite(hi):
        return 0, 0
    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())


def _found(counts: Sequence[tuple[int, int]], numel: int) -> NonFinite | None:
    """The counts of a tensor of `numel` values from those of its chunks; None when all are finite."""
    nan, inf = sum(n for n, _ in counts), sum(i for _, i in counts)
    return NonFinite(nan=nan, inf=inf, numel=numel) if nan or inf else None


def _relative(files: checkpoint.CheckpointFiles, path: Path) -> str:
    return Path(os.path.relpath(path, files.directory)).as_posix()


def checkpoint_paths(files: checkpoint.CheckpointFiles) -> tuple[Path, ...]:
    """Every file of a checkpoint: its index (if any), then its shards."""
    return ((files.index,) if files.index is not None else ()) + files.shards


# --- reading ------------------------------------------------------------------------------------


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise checkpoint.CorruptCheckpointError(f"{path}: ends early (truncated?); re-download it")
    return data


def _stream(f: BinaryIO, n: int, buf: bytearray, path: Path) -> Iterator[memoryview]:
    """The next `n` bytes of `f`, as full views of `buf` (valid until the next one): every view but
    the last is `len(buf)` bytes, so a tensor's chunks hold whole elements."""
    view = memoryview(buf)
    while n > 0:
        want, got = min(n, len(buf)), 0
        while got < want:  # a read may return less than asked (pipes, network file systems)
            k = f.readinto(view[got:want])
            if not k:
                raise checkpoint.CorruptCheckpointError(f"{path}: ends early (truncated?); re-download it")
            got += k
        n -= want
        yield view[:want]


def _spans(header: Mapping[str, Any]) -> list[tuple[int, int, str, torch.dtype | None]]:
    """(begin, end, key, dtype) of every tensor in a safetensors header, by position."""
    spans = []
    for key, info in header.items():
        if key != "__metadata__":
            begin, end = info["data_offsets"]
            spans.append((int(begin), int(end), key, checkpoint.SAFETENSORS_DTYPES.get(info["dtype"])))
    return sorted(spans)


def _scan_safetensors(path: Path, keys: Collection[str]) -> tuple[str, os.stat_result, dict[str, NonFinite]]:
    """sha256 of the file, its stat as opened, and the non-finite counts of its tensors in `keys`."""
    digest, found, buf = hashlib.sha256(), {}, bytearray(_CHUNK)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        head = _read_exact(f, 8, path)
        header = _read_exact(f, int.from_bytes(head, "little"), path)
        digest.update(head + header)
        pos = 0  # bytes of the data section read so far
        for begin, end, key, dtype in _spans(json.loads(header)):
            for chunk in _stream(f, max(begin - pos, 0), buf, path):  # gaps (none in a valid file)
                digest.update(chunk)
            check = key in keys and dtype is not None and dtype.is_floating_point
            counts = []
            for chunk in _stream(f, end - max(begin, pos), buf, path):
                digest.update(chunk)
                if check:
                    assert dtype is not None
                    counts.append(_bad(torch.frombuffer(chunk, dtype=dtype)))
            pos = max(pos, end)
            if dtype is not None and (bad := _found(counts, (end - begin) // dtype.itemsize)) is not None:
                found[key] = bad
        while got := f.readinto(buf):  # anything after the last tensor (none in a valid file)
            digest.update(memoryview(buf)[:got])
    return digest.hexdigest(), st, found


def _hash_file(path: Path) -> tuple[str, os.stat_result]:
    """sha256 of a file and its stat as opened, read in chunks."""
    digest, buf = hashlib.sha256(), bytearray(_CHUNK)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        while got := f.readinto(buf):
            digest.update(memoryview(buf)[:got])
    return digest.hexdigest(), st


def _record(files: checkpoint.CheckpointFiles, path: Path, sha: str, st: os.stat_result) -> SourceFile:
    _HASHED[(os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)] = sha
    return SourceFile(path=_relative(files, path), size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=sha)


def scan_checkpoint(ckpt: checkpoint.Checkpoint, keys: Collection[str]) -> Scan:
    """Hash every file of an open checkpoint and count the NaN and inf values of the tensors `keys`
    names (checkpoint keys as stored), in one pass over the bytes.

    Raises:
        CorruptCheckpointError: a file ends before its header says.
        OSError: a file cannot be read.
    """
    files, records, found = ckpt.files, [], {}
    if files.index is not None:
        records.append(_record(files, files.index, *_hash_file(files.index)))
    wanted = frozenset(keys)
    for shard in files.shards:
        if shard.suffix == ".safetensors":
            sha, st, counts = _scan_safetensors(shard, wanted)
            found.update(counts)
        else:
            sha, st = _hash_file(shard)
            for key in ckpt.keys():  # noqa: SIM118 (a Checkpoint is not a dict)
                if key in wanted and ckpt.shard_of(key) == shard and (c := count_nonfinite(ckpt.read(key))):
                    found[key] = c
        records.append(_record(files, shard, sha, st))
    return Scan(files=tuple(records), nonfinite=tuple(found.items()))


def pin_file(files: checkpoint.CheckpointFiles, path: Path) -> SourceFile:
    """The record of one more file a model reads beside the checkpoint `files` (a Medusa model's
    heads), its path relative to the checkpoint's directory, so `check_pinned` checks it too.

    Raises:
        OSError: the file cannot be read.
    """
    return _record(files, path, *_hash_file(path))


# --- the pin --------------------------------------------------------------------------------------


def _sha256(path: Path, st: os.stat_result) -> str:
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = _hash_file(path)[0]
    return _HASHED[key]


def check_pinned(recorded: Sequence[SourceFile], files: checkpoint.CheckpointFiles) -> Result[None, ArtifactError]:
    """The checkpoint `files` is the one `recorded` when the folder was compiled: the same file
    names, sizes and contents (a file whose size and mtime match its record is not re-read).

    Returns:
        `Success(None)` (also when nothing was recorded), or an ArtifactError naming every file
        added, removed or changed since.
    """
    current = {_relative(files, p): p for p in checkpoint_paths(files)}
    fix = (
        "compile again from this checkpoint, or accept it as it is now with "
        "load(compiled_model_path, repin_checkpoint=True) (the values are checked again)"
    )
    why = "the compiled model reads its weights from this checkpoint (it was compiled without save_sharded_checkpoint)"
    problems = []
    for rec in recorded:
        path = current.pop(rec.path, None)
        if path is None:
            problems.append(
                Problem.of(str(files.directory / rec.path), "<missing>", f"is gone since compile; {why}", fix)
            )
            continue
        st = path.stat()
        if st.st_size != rec.size:
            reason = f"has {st.st_size} bytes, {rec.size} at compile: it changed since; {why}"
            problems.append(Problem.of(str(path), st.st_size, reason, fix))
        elif st.st_mtime_ns != rec.mtime_ns and _sha256(path, st) != rec.sha256:
            reason = f"content changed since compile (sha256 differs); {why}"
            problems.append(Problem.of(str(path), "sha256 mismatch", reason, fix))
    if recorded:
        for rel, path in current.items():
            problems.append(Problem.of(str(path), rel, f"was not part of the checkpoint at compile; {why}", fix))
    return Failure(ArtifactError(problems=tuple(problems))) if problems else Success(None)

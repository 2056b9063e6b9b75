"""Hugging Face checkpoint files: find, open lazily, read one tensor at a time; write safetensors. Effects: file I/O.

Rules:
- A model directory is read in NxDI's order of preference: `model.safetensors`,
  `model.safetensors.index.json`, `pytorch_model.bin`, `pytorch_model.bin.index.json` (REFERENCE §5).
  A path to one of those files (or any `.safetensors`/`.bin`/`.pt` file) is read as is.
- Reading is lazy: opening lists keys, shapes and dtypes from the safetensors headers (or from a
  memory-mapped `torch.load(weights_only=True)`); tensors are read one at a time on request, so peak
  memory stays near one tensor. Shard files are opened read-only (private mappings); the user's
  files are never modified.
- Every checkpoint file must resolve to a regular file: a symlink to one is fine (the Hugging
  Face cache is built of them), while a file that is, or links to, a directory, device, FIFO or
  socket, or a broken symlink, is refused saying so (`NotARegularFileError`), never read (a FIFO
  would block) and never mistaken for "no checkpoint".
- Every bad input raises one exception type, all subclasses of `CheckpointReadError`, with a
  message naming the file or key and what to do.
- Writes go to a temporary file in the destination folder and are renamed into place.

(Over 400 lines: finding the files, refusing the ones that are not safe to open, and the lazy
reader share one error vocabulary; split, each piece would re-explain it.)
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from nxdi.effects import files


class CheckpointReadError(Exception):
    """A checkpoint could not be read; the message names the file or key."""


class CheckpointNotFoundError(CheckpointReadError, FileNotFoundError):
    """No checkpoint file was found where one was expected."""


class MissingShardError(CheckpointReadError, FileNotFoundError):
    """An index names a shard file that does not exist."""


class CorruptCheckpointError(CheckpointReadError, ValueError):
    """A checkpoint or index file is truncated, corrupt, or not in the expected format."""


class NotARegularFileError(CheckpointReadError, ValueError):
    """A checkpoint file is, or links to, something other than a regular file (a directory,
    device, FIFO or socket), or is a broken symlink."""


class UnsafeShardPathError(CheckpointReadError, ValueError):
    """An index names a file outside the model directory."""


class DuplicateTensorError(CheckpointReadError, ValueError):
    """The same tensor key appears in more than one shard (or twice in an index)."""


class IndexMismatchError(CheckpointReadError, ValueError):
    """An index places a key in a shard that does not contain it."""


class CheckpointFormat(enum.Enum):
    SAFETENSORS = "model.safetensors"
    SAFETENSORS_INDEX = "model.safetensors.index.json"
    BIN = "pytorch_model.bin"
    BIN_INDEX = "pytorch_model.bin.index.json"


SEARCH_ORDER: tuple[CheckpointFormat, ...] = tuple(CheckpointFormat)
"""File names looked for in a model directory, most preferred first."""

SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, t)
        for name, t in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"))
        if hasattr(torch, t)
    },
}
"""safetensors header dtype names."""


@attrs.frozen(kw_only=True)
class CheckpointFiles:
    """The files that make up one checkpoint."""

    format: CheckpointFormat
    directory: Path
    shards: tuple[Path, ...]
    index: Path | None = None
    weight_map: Mapping[str, Path] = attrs.field(factory=dict, eq=False)
    """From an index: key -> shard path (empty for single files)."""


def _format_of_file(path: Path) -> CheckpointFormat:
    if path.name.endswith(".index.json"):
        return CheckpointFormat.SAFETENSORS_INDEX if ".safetensors" in path.name else CheckpointFormat.BIN_INDEX
    return CheckpointFormat.SAFETENSORS if path.suffix == ".safetensors" else CheckpointFormat.BIN


def _no_duplicate_pairs(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise DuplicateTensorError(f"{path}: key {k!r} appears twice in the index; remove one entry")
            seen[k] = v
        return seen

    return hook


def _read_index(path: Path) -> dict[str, str]:
    """The index's weight_map, validated as a mapping of key -> relative file name."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_pairs(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e}); re-download or re-save the index") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{path}: no 'weight_map' object of key -> file name; re-save the index")
    return weight_map


def _shard_path(directory: Path, name: str, index: Path) -> Path:
    """`directory/name`, refusing names that leave the directory.

    Checked lexically (no symlink resolution), so symlinked shards such as the Hugging Face cache's
    blobs stay readable while `../x` and absolute names are refused.
    """
    base = os.path.normpath(directory)
    joined = os.path.normpath(os.path.join(base, name))
    if os.path.isabs(name) or not joined.startswith(base + os.sep):
        raise UnsafeShardPathError(
            f"{index}: shard {name!r} lies outside {directory}; shards must be in the model directory"
        )
    return Path(joined)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def irregular(path: Path) -> str | None:
    """What `path` is when it does not resolve to a regular file (`"a symlink to /dev/zero, which
    is a character device"`), or None when it does (directly or through symlinks) or is absent."""
    try:
        mode = path.stat().st_mode  # follows symlinks: a link to a regular file is regular
    except FileNotFoundError:
        return f"a broken symlink (to {os.readlink(path)})" if path.is_symlink() else None
    except OSError as e:  # a symlink loop, a component that is not a directory
        return f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"a symlink to {os.path.realpath(path)}, which is {kind}" if path.is_symlink() else kind


def _refuse_irregular(paths: Iterable[Path], where: str) -> None:
    bad = [f"{p.name} is {why}" for p in paths if (why := irregular(p)) is not None]
    if bad:
        raise NotARegularFileError(
            f"{where}: {'; '.join(bad)}; checkpoint files must be regular files (or symlinks to regular "
            f"files). Fix: replace {'it' if len(bad) == 1 else 'each'} with the checkpoint file it should be"
        )


def _indexed_files(index: Path, fmt: CheckpointFormat) -> CheckpointFiles:
    directory = index.parent
    names = _read_index(index)
    paths = {name: _shard_path(directory, name, index) for name in sorted(set(names.values()))}
    _refuse_irregular(paths.values(), str(index))
    missing = sorted(n for n, p in paths.items() if not p.is_file())
    if missing:
        raise MissingShardError(f"{index}: names shard file(s) that do not exist: {', '.join(missing)}")
    weight_map = {k: paths[v] for k, v in names.items()}
    return CheckpointFiles(
        format=fmt, directory=directory, shards=tuple(paths.values()), index=index, weight_map=weight_map
    )


def find_checkpoint(path: str | os.PathLike[str]) -> CheckpointFiles:
    """The checkpoint files of a model directory (or of one checkpoint file).

    Raises:
        CheckpointNotFoundError: the path does not exist, or the directory holds none of the four files.
        NotARegularFileError: the path, one of the four files or a shard an index names is, or
            links to, a directory, device, FIFO or socket, or is a broken symlink.
        CorruptCheckpointError: an index is not valid JSON or has no weight_map.
        UnsafeShardPathError: an index names a file outside the directory.
        MissingShardError: an index names a file that does not exist.
        DuplicateTensorError: an index lists a key twice.
    """
    p = Path(path)
    if p.is_file():
        fmt = _format_of_file(p)
        if fmt in (CheckpointFormat.SAFETENSORS_INDEX, CheckpointFormat.BIN_INDEX):
            return _indexed_files(p, fmt)
        return CheckpointFiles(format=fmt, directory=p.parent, shards=(p,))
    if not p.is_dir():
        if os.path.lexists(p):
            _refuse_irregular([p], str(p.parent))
        raise CheckpointNotFoundError(f"{p} does not exist; pass a model directory or a checkpoint file")
    for fmt in SEARCH_ORDER:
        candidate = p / fmt.value
        # A preferred name that exists but is no file is refused, not skipped: falling back to a
        # less preferred file would load weights the user did not mean.
        _refuse_irregular([candidate], str(p))
        if candidate.is_file():
            if fmt in (CheckpointFormat.SAFETENSORS_INDEX, CheckpointFormat.BIN_INDEX):
                return _indexed_files(candidate, fmt)
            return CheckpointFiles(format=fmt, directory=p, shards=(candidate,))
    names = ", ".join(f.value for f in SEARCH_ORDER)
    raise CheckpointNotFoundError(f"no checkpoint in {p}: looked for {names}")


_BIN_ERRORS = (
    OSError,
    RuntimeError,
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    AttributeError,
    pickle.UnpicklingError,
)


def _load_bin(path: Path) -> dict[str, Tensor]:
    """A `.bin` state dict, memory-mapped when the file is in the zip format (torch >= 1.6)."""
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "_use_new_zipfile_serialization" not in str(e):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy format: no mmap
    except (PermissionError, FileNotFoundError, IsADirectoryError):
        raise
    except _BIN_ERRORS as e:
        raise CorruptCheckpointError(f"{path}: cannot be read as a weights-only torch checkpoint ({e})") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in sd.items()):
        raise CorruptCheckpointError(f"{path}: does not hold a state dict of name -> tensor")
    return sd


class Checkpoint:
    """An open checkpoint: keys and shapes known, tensors read on demand.

    Use as a context manager, or call `close()`. Not thread safe.
    """

    def __init__(self, files: CheckpointFiles) -> None:
        self.files = files
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for shard in files.shards:
            self._inventory(shard)
        self._check_index()

    def _open(self, shard: Path) -> Any:
        if shard not in self._handles:
            if shard.suffix == ".safetensors":
                try:
                    self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
                except SafetensorError as e:
                    raise CorruptCheckpointError(f"{shard}: not a valid safetensors file ({e}); re-download it") from e
            else:
                self._handles[shard] = _load_bin(shard)
        return self._handles[shard]

    def _inventory(self, shard: Path) -> None:
        handle = self._open(shard)
        duplicates = []
        for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            if key in self._where:
                duplicates.append(f"{key!r} in {self._where[key].name} and {shard.name}")
                continue
            self._where[key] = shard
            if isinstance(handle, dict):
                self._shapes[key], self._dtypes[key] = tuple(handle[key].shape), str(handle[key].dtype)
            else:
                sl = handle.get_slice(key)
                self._shapes[key], self._dtypes[key] = tuple(sl.get_shape()), sl.get_dtype()
        if duplicates:
            raise DuplicateTensorError(f"{self.files.directory}: keys in more than one shard: {'; '.join(duplicates)}")

    def _check_index(self) -> None:
        wrong = [f"{k!r} (index: {p.name})" for k, p in self.files.weight_map.items() if self._where.get(k) != p]
        if wrong:
            raise IndexMismatchError(
                f"{self.files.index}: keys not found in the shard the index names: {', '.join(wrong)}"
            )

    def keys(self) -> tuple[str, ...]:
        return tuple(self._where)

    def shard_of(self, key: str) -> Path:
        """The file holding `key`."""
        return self._where[key]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Key -> shape, without reading tensor data."""
        return dict(self._shapes)

    def dtypes(self) -> dict[str, str]:
        """Key -> stored dtype name (safetensors names such as `BF16`, or torch names for `.bin`)."""
        return dict(self._dtypes)

    def torch_dtype(self, key: str) -> torch.dtype:
        """The stored dtype of `key` as a torch dtype, from the file's header (no tensor data read)."""
        name = self._dtypes[key]
        dtype = SAFETENSORS_DTYPES.get(name) or getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{self._where[key]}: tensor {key!r} has an unknown dtype {name!r}")
        return dtype

    def read(self, key: str) -> Tensor:
        """One tensor.

        Raises:
            KeyError: `key` is not in the checkpoint.
            CorruptCheckpointError: its bytes cannot be read.
        """
        shard = self._where[key]
        handle = self._open(shard)
        if isinstance(handle, dict):
            return handle[key]
        try:
            return handle.get_tensor(key)
        except SafetensorError as e:
            raise CorruptCheckpointError(f"{shard}: tensor {key!r} cannot be read ({e})") from e

    def read_slice(self, key: str, *, dim: int, start: int, stop: int) -> Tensor:
        """`tensor[start:stop]` along `dim`, reading only that slice from safetensors files."""
        handle = self._open(self._where[key])
        index = (slice(None),) * dim + (slice(start, stop),)
        if isinstance(handle, dict):
            return handle[key][index].clone()
        return handle.get_slice(key)[index]

    def iter_tensors(self, keys: Iterable[str] | None = None) -> Iterator[tuple[str, Tensor]]:
        """(key, tensor) one at a time, in checkpoint order (or in `keys` order)."""
        for key in self.keys() if keys is None else keys:
            yield key, self.read(key)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Find and open a checkpoint (see `find_checkpoint` and `Checkpoint` for what can be raised)."""
    return Checkpoint(find_checkpoint(path))


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a checkpoint, as stored (NxDI's `load_state_dict`)."""
    with open_checkpoint(path) as ckpt:
        return dict(ckpt.iter_tensors())


def _savable(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, with a copy for any that share storage with an earlier one (safetensors refuses sharing)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        out[key] = t.clone() if ptr in seen else t
        if ptr != -1:
            seen.add(ptr)
    return out


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, Tensor], *, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write `tensors` to a safetensors file atomically (temp file in the same folder, fsync, rename).

    Tensors sharing memory (tied weights) are written as separate copies. `tensors` is not modified.
    """
    return files.publish(
        path, lambda tmp: save_file(_savable(tensors), str(tmp), metadata=dict(metadata) if metadata else None)
    )

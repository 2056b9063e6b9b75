"""The streaming scan of a checkpoint (sha256 of every file, NaN/inf counts), the pin check, and
the dtype and value rules of `nxdi.core.weight_checks`."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from returns.result import Failure, Success
from safetensors.torch import save_file

from nxdi.core import weight_checks
from nxdi.core.weight_checks import NonFinite
from nxdi.effects import checkpoint, checkpoint_scan
from nxdi.effects.env import read_env
from nxdi.testing.checkpoints import SaveFormat


def _files(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("fmt", list(SaveFormat))
def test_the_scan_hashes_every_file_as_hashlib_does(fmt: SaveFormat, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", fmt)
    before = _files(path)
    with checkpoint.open_checkpoint(path) as ckpt:
        scan = checkpoint_scan.scan_checkpoint(ckpt, ckpt.keys())
        expected = checkpoint_scan.checkpoint_paths(ckpt.files)
    assert [f.path for f in scan.files] == [p.name for p in expected]
    for record, file in zip(scan.files, expected, strict=True):
        assert record.sha256 == hashlib.sha256(file.read_bytes()).hexdigest()
        assert (record.size, record.mtime_ns) == (file.stat().st_size, file.stat().st_mtime_ns)
    assert scan.nonfinite == ()
    assert _files(path) == before, "scanning modified the user's files"


def _poisoned(n: int, dtype: torch.dtype, nan_at: tuple[int, ...], inf_at: tuple[int, ...]) -> torch.Tensor:
    t = torch.linspace(-1, 1, n).to(dtype)
    for i in nan_at:
        t[i] = float("nan")
    for i in inf_at:
        t[i] = float("inf") if i % 2 else float("-inf")
    return t


def test_nan_and_inf_are_counted_exactly_across_chunks_and_unaligned_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Odd-sized tensors of every floating dtype leave later ones at unaligned offsets; a tiny
    chunk makes every tensor span several chunks."""
    monkeypatch.setattr(checkpoint_scan, "_CHUNK", 64)
    tensors = {
        "a.bf16": _poisoned(37, torch.bfloat16, (0, 36), (20,)),
        "b.f32": _poisoned(41, torch.float32, (17,), (3, 40)),
        "c.f16": _poisoned(5, torch.float16, (), ()),
        "d.f64": _poisoned(19, torch.float64, (18,), ()),
        "e.e5m2": _poisoned(23, torch.float8_e5m2, (1,), (22,)),
        "f.e4m3": _poisoned(9, torch.float8_e4m3fn, (8,), ()),  # e4m3fn has NaN but no inf
        "g.int": torch.arange(7, dtype=torch.int32),
        "h.unread": _poisoned(8, torch.float32, (0,), ()),
        "i.f32.clean-chunks-first": _poisoned(100, torch.float32, (99,), ()),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    scans = []
    for path in (tmp_path, tmp_path / "bin"):
        with checkpoint.open_checkpoint(path) as ckpt:
            scans.append(dict(checkpoint_scan.scan_checkpoint(ckpt, [k for k in tensors if k != "h.unread"]).nonfinite))
    scan = scans[0]
    assert scans[1] == scan, "the .bin layout finds the same"
    expected = {
        k: NonFinite(nan=int(t.float().isnan().sum()), inf=int(t.float().isinf().sum()), numel=t.numel())
        for k, t in tensors.items()
        if k not in ("c.f16", "g.int", "h.unread")
    }
    assert expected["a.bf16"] == NonFinite(nan=2, inf=1, numel=37)
    assert scan == expected
    assert checkpoint_scan.count_nonfinite(tensors["b.f32"]) == NonFinite(nan=1, inf=2, numel=41)
    assert checkpoint_scan.count_nonfinite(tensors["c.f16"]) is None
    assert checkpoint_scan.count_nonfinite(torch.empty(0)) is None


def _pinned(path: Path) -> tuple[checkpoint_scan.SourceFile, ...]:
    with checkpoint.open_checkpoint(path) as ckpt:
        return checkpoint_scan.scan_checkpoint(ckpt, ()).files


def _check(recorded: tuple[checkpoint_scan.SourceFile, ...], path: Path) -> list[tuple[str, str]]:
    match checkpoint_scan.check_pinned(recorded, checkpoint.find_checkpoint(path)):
        case Success(_):
            return []
        case Failure(err):
            return [(Path(p.field).name, p.reason) for p in err.problems]
    raise AssertionError("unreachable")


def test_the_pin_names_every_changed_added_or_removed_file(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", SaveFormat.SAFETENSORS_SHARDED), path)
    recorded = _pinned(path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert _check(recorded, path) == []
    copy = tmp_path / "copy"
    shutil.copytree(path, copy, copy_function=shutil.copy)  # new mtimes, same bytes: re-hashed, accepted
    assert _check(recorded, copy) == []

    first = path / shards[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1  # same size, new content, new mtime
    first.write_bytes(bytes(data))
    problems = dict(_check(recorded, path))
    assert list(problems) == [shards[0]] and "content changed since compile" in problems[shards[0]]

    with open(path / shards[1], "ab") as f:
        f.write(b"\0")
    problems = dict(_check(recorded, path))
    assert list(problems) == [shards[0], shards[1]] and "bytes" in problems[shards[1]]

    shutil.rmtree(path)  # re-saved as one file: the index and every shard gone, a new file
    shutil.copytree(tiny_checkpoint("llama"), path)
    problems = dict(_check(recorded, path))
    assert set(problems) == {"model.safetensors.index.json", *shards, "model.safetensors"}
    assert "is gone since compile" in problems[shards[0]]
    assert "was not part of the checkpoint at compile" in problems["model.safetensors"]


def test_a_change_keeping_size_and_mtime_is_the_documented_blind_spot(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    recorded = _pinned(path)
    file = path / "model.safetensors"
    st = file.stat()
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    assert _check(recorded, path) != []
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))  # a deliberate forgery of the mtime
    assert _check(recorded, path) == [], "size and mtime equal to the record are taken as unchanged"


def test_nothing_recorded_checks_nothing(tiny_checkpoint: Callable[..., Path]) -> None:
    assert _check((), tiny_checkpoint("llama")) == []


def test_the_dtype_and_value_rules_name_every_tensor() -> None:
    dtypes = {"a": "float32", "b": "int32", "c": "bfloat16", "d": "bool", "e": "float8_e4m3fn"}
    err = weight_checks.check_dtypes(dtypes).failure()
    assert [(p.field, p.value) for p in err.problems] == [("b", "'int32'"), ("d", "'bool'")]
    assert "must be floating point" in err.render()
    found = {"x": NonFinite(nan=2, inf=1, numel=10), "y": NonFinite(nan=0, inf=3, numel=4)}
    err = weight_checks.check_finite(found).failure()
    assert [p.field for p in err.problems] == ["x", "y"]
    assert "2 NaN and 1 inf of 10 values" in err.render() and weight_checks.ALLOW_NONFINITE in err.render()
    assert weight_checks.check_finite(found, allowed=True) == Success(None)
    assert weight_checks.check_finite({}) == Success(None)


@pytest.mark.parametrize(
    ("raw", "allowed", "problem"),
    [(None, False, False), ("1", True, False), ("TRUE", True, False), ("no", False, False), ("maybe", False, True)],
)
def test_the_opt_in_variable(raw: str | None, allowed: bool, problem: bool) -> None:
    env = read_env({} if raw is None else {weight_checks.ALLOW_NONFINITE: raw})
    assert env.allow_nonfinite_weights is allowed
    assert any(p.startswith(weight_checks.ALLOW_NONFINITE) for p in env.problems) is problem

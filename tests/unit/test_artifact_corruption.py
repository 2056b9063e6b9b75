"""Files that pass the manifest's hash check yet cannot be read back: each is an
ArtifactIntegrityError naming the file, never a bare decoder error.

Every corruption below rewrites a program file *and* its manifest entry (sha256 and size), the way
a broken writer or a hand-edited folder would, so the integrity check passes and the bytes reach
the backend's deserializer.
"""

from __future__ import annotations

import io
import json
import random
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nxdi.core.planning.program_key import ProgramKey
from nxdi.effects import artifacts
from nxdi.effects.backends import xla
from nxdi.effects.backends.base import CompiledProgram
from nxdi.effects.backends.cpu import CpuBackend
from nxdi.shell.exceptions import ArtifactIntegrityError, unwrap
from tests.support import cpu_programs as cp

Corrupt = Callable[[bytes], bytes]


def _garbage(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def _rezip(data: bytes, change: Callable[[str, bytes], bytes | None]) -> bytes:
    """The zip `data` with each member replaced by `change(name, content)` (None: dropped)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            new = change(name, src.read(name))
            if new is not None:
                dst.writestr(name, new)
    return out.getvalue()


def _json_members(fix: Callable[[object], object]) -> Corrupt:
    """Every JSON member of the zip passed through `fix` (valid JSON, wrong types)."""

    def change(name: str, content: bytes) -> bytes:
        return json.dumps(fix(json.loads(content))).encode() if name.endswith(".json") else content

    return lambda data: _rezip(data, change)


def _wrong_types(doc: object) -> object:
    """Every value of a JSON object replaced by one of another type."""
    if isinstance(doc, dict):
        return {
            k: ([v] if isinstance(v, str) else "x" if isinstance(v, (int, float, list)) else 7) for k, v in doc.items()
        }
    return {"not": "what was there"}


COMMON: dict[str, Corrupt] = {
    "garbage bytes": lambda data: _garbage(len(data)),
    "empty": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "a zip with garbage inside": lambda data: _rezip(data, lambda name, content: _garbage(len(content) + 1)),
    "a zip of something else": lambda data: _rezip(data, lambda name, content: None) or _zip({"hello.txt": b"hi"}),
    "JSON members with wrong types": _json_members(_wrong_types),
    "JSON members emptied": _json_members(lambda doc: {}),
    "text members not UTF-8": lambda data: _rezip(
        data, lambda name, content: b"\xff\xfe\x00" + content if name.endswith((".json", ".txt")) else content
    ),
}


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, content in members.items():
            z.writestr(name, content)
    return out.getvalue()


def _corrupt(folder: Path, rel: str, corrupt: Corrupt) -> Path:
    """Rewrite `folder/rel` with `corrupt(bytes)` and its manifest entry to match."""
    path = folder / rel
    path.write_bytes(corrupt(path.read_bytes()))
    manifest = folder / artifacts.MANIFEST
    doc = json.loads(manifest.read_text())
    doc["files"][rel] = {"sha256": artifacts.sha256_file(path), "size": path.stat().st_size}
    manifest.write_text(json.dumps(doc))
    return path


def _assert_named(load: Callable[[], object], path: Path) -> None:
    with pytest.raises(ArtifactIntegrityError) as info:
        load()
    message = str(info.value)
    assert str(path) in message and "cannot be read as" in message and "compile again" in message, message
    assert [p.field for p in info.value.error.problems] == [str(path)]  # type: ignore[union-attr]


# --- the CPU backend (torch.export archives) -------------------------------------------------------


@pytest.fixture
def cpu_folder(tmp_path: Path) -> Path:
    requests = [
        artifacts.ProgramRequest(
            key=ProgramKey.token(s, cp.B), fn=cp.step, signature=cp.SIGNATURE, example=lambda s=s: cp.example(s)
        )
        for s in (1, 4)
    ]
    artifacts.compile_programs(tmp_path, requests, graph_key="k", backend=CpuBackend())
    return tmp_path


@pytest.mark.parametrize("corrupt", COMMON.values(), ids=COMMON.keys())
def test_an_unreadable_cpu_program_is_named(cpu_folder: Path, corrupt: Corrupt) -> None:
    path = _corrupt(cpu_folder, "programs/token_generation_4.pt2", corrupt)
    _assert_named(lambda: unwrap(artifacts.load_programs(cpu_folder, CpuBackend())), path)


def test_every_unreadable_program_is_named_at_once(cpu_folder: Path) -> None:
    paths = [_corrupt(cpu_folder, f"programs/token_generation_{s}.pt2", COMMON["garbage bytes"]) for s in (1, 4)]
    message = artifacts.load_programs(cpu_folder, CpuBackend()).failure().render()
    assert all(str(p) in message for p in paths)


# --- the XLA backend's zip (read without torch-xla) -------------------------------------------------


class OfflineXla(xla.XlaBackend):
    """The xla backend's file format without torch-xla (loading a file never needs it)."""

    def version(self) -> str:
        return "xla-offline"


@pytest.fixture
def xla_folder(tmp_path: Path) -> Path:
    hlo = xla.HloProgram(
        module=b"\x0a\x04main",
        text="HloModule main",
        parameters=(xla.Parameter(kind="weight", name="proj.weight", index=0, shape=(cp.E, cp.E), dtype="float32"),),
        constants=(torch.tensor(0.5),),
    )
    rel = "programs/token_generation_4.xla"
    (tmp_path / "programs").mkdir()
    program = CompiledProgram(name="token_generation_4", signature=cp.SIGNATURE, backend="xla", payload=hlo)
    OfflineXla().save(program, tmp_path / rel)
    key = ProgramKey.token(4, cp.B)
    record = artifacts.ProgramRecord(key=key, file=rel, signature=cp.SIGNATURE, cache_key="k")
    manifest = artifacts.Manifest(
        graph_key="k",
        backend="xla",
        backend_version="xla-offline",
        programs=(record,),
        files=(artifacts.record_file(tmp_path, rel),),
    )
    (tmp_path / artifacts.MANIFEST).write_text(json.dumps(manifest.to_json()))
    return tmp_path


def _parameters(change: Callable[[dict[str, object]], object]) -> Corrupt:
    def fix(doc: object) -> object:
        assert isinstance(doc, dict)
        return {**doc, "parameters": [change(p) for p in doc["parameters"]]}

    return _json_members(fix)


XLA: dict[str, Corrupt] = {
    **COMMON,
    "a parameter index of the wrong type": _parameters(lambda p: {**p, "index": "0"}),
    "a parameter shape of the wrong type": _parameters(lambda p: {**p, "shape": "64x64"}),
    "an unknown parameter dtype": _parameters(lambda p: {**p, "dtype": "float99"}),
    "a parameter without its kind": _parameters(lambda p: {k: v for k, v in p.items() if k != "kind"}),
    "parameters not a list": _json_members(lambda doc: {**doc, "parameters": 5} if isinstance(doc, dict) else doc),
    "constants not safetensors": lambda data: _rezip(
        data, lambda name, content: b"{}" if name == xla.CONSTANTS else content
    ),
    "a member missing": lambda data: _rezip(data, lambda name, content: None if name == xla.TEXT else content),
}


def test_the_xla_fixture_loads(xla_folder: Path) -> None:
    (program,) = unwrap(artifacts.load_programs(xla_folder, OfflineXla())).values()
    assert program.payload.parameters[0].shape == (cp.E, cp.E)


@pytest.mark.parametrize("corrupt", XLA.values(), ids=XLA.keys())
def test_an_unreadable_xla_program_is_named(xla_folder: Path, corrupt: Corrupt) -> None:
    path = _corrupt(xla_folder, "programs/token_generation_4.xla", corrupt)
    _assert_named(lambda: unwrap(artifacts.load_programs(xla_folder, OfflineXla())), path)


# --- the manifest itself (no hash protects it: it is the root) --------------------------------------


def _program_field(key: str, value: object) -> Callable[[dict[str, object]], object]:
    return lambda doc: {**doc, "programs": [{**p, key: value} for p in doc["programs"]]}  # type: ignore[attr-defined]


MANIFESTS: dict[str, Callable[[dict[str, object]], object]] = {
    "programs not a list": lambda doc: {**doc, "programs": 5},
    "an unknown phase": _program_field("phase", "decode"),
    "a length that is not a number": _program_field("length", "four"),
    "a batch of no rows": _program_field("batch", 0),
    "no tokens per row": _program_field("tokens", None),
    "a signature of the wrong type": _program_field("signature", {"weights": 5}),
    "files not an object": lambda doc: {**doc, "files": ["programs/token_generation_4.pt2"]},
    "a file entry of the wrong type": lambda doc: {**doc, "files": dict.fromkeys(doc["files"], 5)},  # type: ignore[arg-type]
    "not an object": lambda doc: [doc],
}


@pytest.mark.parametrize("change", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_a_malformed_manifest_is_named(cpu_folder: Path, change: Callable[[dict[str, object]], object]) -> None:
    manifest = cpu_folder / artifacts.MANIFEST
    manifest.write_text(json.dumps(change(json.loads(manifest.read_text()))))
    with pytest.raises(ArtifactIntegrityError, match=rf"{manifest}.*compile again"):
        unwrap(artifacts.load_programs(cpu_folder, CpuBackend()))

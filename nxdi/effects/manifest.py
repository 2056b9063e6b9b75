"""The compiled-model folder's manifest: what the folder holds (every program and recorded file, by
content), what made it, and the original checkpoint it was compiled from. Effects: reads, writes
and hashes files.

`nxdi.effects.artifacts` writes and checks it (its module docstring gives the folder's rules);
this module is the record and its reading, verifying and re-pinning.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.errors import ArtifactError, Problem
from nxdi.core.planning.program_key import ProgramKey
from nxdi.effects import files
from nxdi.effects.backends.base import Signature
from nxdi.effects.checkpoint_scan import SourceFile

MANIFEST = "manifest.json"
PROGRAMS = "programs"
FORMAT = 4
"""Manifest format: 4 records each program's whole key (phase, length, batch, tokens), so programs
of one length but several batch sizes (token_generation_batches) or token counts are told apart;
3 pinned the original checkpoint (`source`), which load() checks when it reads its weights from
there; 2 recorded phase and bucket per program (1 encoded them in the file name). Older folders
are refused ("compile again"): a format-3 record does not say a program's batch, and a format-2
folder cannot show that its checkpoint is unchanged."""
PROGRAM_FORMAT = 3
"""The saved programs' own format, part of every program's cache key. Manifest formats 3 and 4
did not change the programs (nor, for models without batch buckets, their names); 3: multi-LoRA
programs take their adapters in the layout `lora_memory_transpose` names ([in, out] by default),
so programs compiled before are traced again rather than bound to weights of another layout."""
_CHUNK = 1 << 22


def _programs(values: Iterable[ProgramRecord]) -> tuple[ProgramRecord, ...]:
    return tuple(values)  # typed converters: mypy cannot see element types through a bare `tuple`


def _files(values: Iterable[FileRecord]) -> tuple[FileRecord, ...]:
    return tuple(values)


def _sources(values: Iterable[SourceFile]) -> tuple[SourceFile, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class FileRecord:
    """One file of the folder, by content."""

    path: str
    """Relative to the folder, `/`-separated."""
    sha256: str
    size: int
    """Bytes."""


@attrs.frozen(kw_only=True)
class ProgramRecord:
    """One compiled program in the folder."""

    key: ProgramKey
    """Which program: sub-model and static shapes."""
    file: str
    """Relative path of the program file (also listed in `Manifest.files`)."""
    signature: Signature
    cache_key: str
    """`program_key(...)` it was compiled under."""


@attrs.frozen(kw_only=True)
class Manifest:
    """What a compiled-model folder holds and what made it."""

    graph_key: str
    """The caller's hash of every graph-affecting setting."""
    backend: str
    backend_version: str
    programs: tuple[ProgramRecord, ...] = attrs.field(converter=_programs)
    files: tuple[FileRecord, ...] = attrs.field(converter=_files)
    source: tuple[SourceFile, ...] = attrs.field(default=(), converter=_sources)
    """The original checkpoint's files when compiled (names relative to it, sizes, mtimes,
    sha256), and a Medusa model's heads file (`medusa_heads.pt`, named relative to the checkpoint):
    load() refuses a changed checkpoint or heads file when it reads the weights from them."""
    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "format": self.format,
            "graph_key": self.graph_key,
            "backend": self.backend,
            "backend_version": self.backend_version,
            "programs": [
                {
                    "phase": p.key.phase.value,
                    "length": p.key.length,
                    "batch": p.key.batch,
                    "tokens": p.key.tokens,
                    "file": p.file,
                    "cache_key": p.cache_key,
                    "signature": p.signature.to_json(),
                }
                for p in self.programs
            ],
            "files": {f.path: {"sha256": f.sha256, "size": f.size} for f in self.files},
            "source": [f.to_json() for f in self.source],
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Manifest:
        """The inverse of `to_json`. Raises KeyError/TypeError/ValueError on a malformed document."""
        programs = tuple(
            ProgramRecord(
                key=ProgramKey(
                    phase=Phase(p["phase"]),
                    length=int(p["length"]),
                    batch=int(p["batch"]),
                    tokens=int(p["tokens"]),
                ),
                file=str(p["file"]),
                cache_key=str(p["cache_key"]),
                signature=Signature.from_json(p["signature"]),
            )
            for p in raw["programs"]
        )
        records = tuple(
            FileRecord(path=str(k), sha256=str(v["sha256"]), size=int(v["size"])) for k, v in raw["files"].items()
        )
        return cls(
            graph_key=str(raw["graph_key"]),
            backend=str(raw["backend"]),
            backend_version=str(raw["backend_version"]),
            programs=programs,
            files=records,
            source=tuple(SourceFile.from_json(f) for f in raw["source"]),
            format=int(raw["format"]),
        )


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_file(directory: Path, rel: str) -> FileRecord:
    """The content record of `directory/rel`."""
    path = directory / rel
    return FileRecord(path=rel, sha256=sha256_file(path), size=path.stat().st_size)


def read_manifest(directory: str | os.PathLike[str]) -> Result[Manifest, ArtifactError]:
    """The folder's manifest, or an ArtifactError (`not_found` when there is none; another format refused)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        problem = Problem.of(str(path), "<missing>", "no compiled model here", "compile() the model into this folder")
        return Failure(ArtifactError(problems=(problem,), not_found=True))
    fix = "delete the folder and compile again"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        version = raw.get("format") if isinstance(raw, dict) else None
        if version != FORMAT:
            who = "an older" if isinstance(version, int) and version < FORMAT else "another"
            why = f"was written by {who} nxdi (manifest format {version}; this nxdi reads {FORMAT})"
            return Failure(ArtifactError(problems=(Problem.of(f"{path}:format", version, why, "compile again"),)))
        return Success(Manifest.from_json(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return Failure(ArtifactError(problems=(Problem.of(str(path), type(e).__name__, f"is malformed ({e})", fix),)))


def replace_source(directory: str | os.PathLike[str], source: Iterable[SourceFile]) -> Result[Manifest, ArtifactError]:
    """Pin another checkpoint identity in the folder's manifest (rewritten atomically; nothing
    else in it changes). The caller holds the folder's lock exclusively.

    Returns:
        The new manifest, or the ArtifactError of `read_manifest`.
    """
    root = Path(directory)

    def write(manifest: Manifest) -> Manifest:
        new = attrs.evolve(manifest, source=source)
        files.write_text_atomic(root / MANIFEST, json.dumps(new.to_json(), indent=1, sort_keys=True))
        return new

    return read_manifest(root).map(write)


def write_side_pin(directory: str | os.PathLike[str], name: str, pinned: Iterable[SourceFile]) -> str:
    """Pin one more checkpoint the folder reads (a fused draft's) in its own file `name` beside the
    manifest (written atomically), `{"files": [...]}` as the manifest's `source`; returns `name`,
    for the caller to record in the manifest."""
    doc = {"files": [f.to_json() for f in pinned]}
    files.write_text_atomic(Path(directory) / name, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return name


def read_side_pin(directory: str | os.PathLike[str], name: str) -> tuple[SourceFile, ...]:
    """The files `write_side_pin` pinned in `name` (none when the folder has no such file: nothing pinned).

    Raises:
        ValueError, KeyError, TypeError: a malformed file (the manifest records it, so `verify` finds it changed first).
    """
    path = Path(directory) / name
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text(encoding="utf-8"))
    return tuple(SourceFile.from_json(f) for f in raw.get("files", ()))


def add_files(directory: str | os.PathLike[str], rels: Iterable[str]) -> Result[Manifest, ArtifactError]:
    """Record the files `rels` (relative paths) in the folder's manifest, replacing their old
    records (rewritten atomically). The caller holds the folder's lock exclusively.

    Returns:
        The new manifest, or the ArtifactError of `read_manifest` (nothing compiled there).
    """
    root, added = Path(directory), [record_file(Path(directory), r) for r in rels]

    def write(manifest: Manifest) -> Manifest:
        kept = [f for f in manifest.files if f.path not in {a.path for a in added}]
        new = attrs.evolve(manifest, files=(*kept, *added))
        files.write_text_atomic(root / MANIFEST, json.dumps(new.to_json(), indent=1, sort_keys=True))
        return new

    return read_manifest(root).map(write)


def verify(directory: str | os.PathLike[str], manifest: Manifest) -> Result[Manifest, ArtifactError]:
    """Check every recorded file's size and sha256; the error names each bad file."""
    root, problems = Path(directory), []
    fix = "the file was changed after compiling; compile again (or restore the folder)"
    for rec in manifest.files:
        path = root / rec.path
        if not path.is_file():
            problems.append(Problem.of(str(path), "<missing>", "is listed in manifest.json but missing", fix))
        elif path.stat().st_size != rec.size:
            size = path.stat().st_size
            problems.append(Problem.of(str(path), size, f"has {size} bytes; manifest.json says {rec.size}", fix))
        elif sha256_file(path) != rec.sha256:
            problems.append(Problem.of(str(path), "sha256 mismatch", "content differs from manifest.json", fix))
    return Failure(ArtifactError(problems=problems)) if problems else Success(manifest)

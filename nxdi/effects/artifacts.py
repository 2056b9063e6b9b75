"""The compiled-model folder: program files, their manifest, and the compile cache.
Effects: reads, writes, copies and hashes files; calls a backend to trace programs.

Layout of a compiled-model folder:

    neuron_config.json                                 the shell writes it
    weights/tp{rank}_sharded_checkpoint.safetensors    the weights writer (once, for every program)
    programs/<name><suffix>                            one program per ProgramKey, no weights
    manifest.json                                      written last: see `nxdi.effects.manifest`

Rules:
- A folder is compiled exactly when `manifest.json` exists; it is written last.
- `compile_programs` writes into the folder it is given. The shell gives it an empty build folder
  beside the compiled one (`nxdi.effects.staging.building`) together with `previous=` the compiled
  folder, and swaps the build in when the whole compile (configuration, weights, programs,
  manifest, debug HLO) is written: at every instant the compiled folder holds the old complete
  compile or the new one, whatever interrupts it, and compiles of one folder take turns (a lock).
  Unchanged programs of `previous` are hard-linked (else copied) into the build, not traced again.
- Compiling into a live folder (no `previous`) deletes its manifest before writing anything, so an
  interrupted compile there leaves a folder that reads as "nothing compiled", never a half-valid one.
- Every file is written to a temporary name in its folder and renamed into place.
- The manifest records each program's key (phase, length, batch, tokens; see
  `nxdi.core.planning.program_key`) as fields, and the sha256 and size of every program (and of any file the caller asks it to record). Loading checks them all
  and names each file that is missing, truncated or altered; a file that passes the check but
  cannot be read back (a backend's deserializer fails on it) is named too (`ArtifactError`).
- The manifest also pins the original checkpoint (`source`: each file's name, size, mtime and
  sha256, from `nxdi.effects.checkpoint_scan`); loading from a folder without weights of its own
  refuses a checkpoint that changed since (`engine.rank_weights`), and `replace_source` re-pins.
- The manifest carries a format number. A folder written by another format (an older nxdi) is
  refused with "compile again", before anything else in it is read.
- Program files are named by `program_key.program_names` (`token_generation_256`,
  `token_generation_256_b2`, ...), from the keys alone, so a folder's names follow from its manifest.
- Compile cache: a program's cache key hashes the caller's graph key, the program name, the backend,
  the backend version (torch version and saved format) and the nxdi code that traces programs (a
  hash of the `nxdi.core` and `nxdi.effects` sources, `code_version`), so a program traced by an
  older or edited nxdi is never reused: it would run that code's graph. Compiling an unchanged
  configuration again reuses the folder's programs; with `cache_dir`, programs are also reused
  across folders.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
from returns.pipeline import is_successful
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ArtifactError, Problem
from nxdi.core.planning.program_key import ProgramKey, program_names
from nxdi.effects import files
from nxdi.effects.backends.base import Backend, CompiledProgram, FlatProgram, Signature
from nxdi.effects.checkpoint_scan import SourceFile
from nxdi.effects.manifest import (
    FORMAT,
    MANIFEST,
    PROGRAM_FORMAT,
    PROGRAMS,
    FileRecord,
    Manifest,
    ProgramRecord,
    add_files,
    read_manifest,
    record_file,
    replace_source,
    sha256_file,
    verify,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "PROGRAMS",
    "PROGRAM_FORMAT",
    "CompileResult",
    "FileRecord",
    "Manifest",
    "ProgramRecord",
    "ProgramRequest",
    "add_files",
    "compile_programs",
    "load_programs",
    "program_key",
    "read_manifest",
    "record_file",
    "replace_source",
    "sha256_file",
    "verify",
]


@attrs.frozen(eq=False, kw_only=True)
class ProgramRequest:
    """One program to compile: its key, the pure flat program, its signature, examples."""

    key: ProgramKey
    fn: FlatProgram
    signature: Signature
    example: Callable[[], Sequence[Tensor]]
    """Builds the W + C + I example tensors; called only when the program must be traced."""


@attrs.frozen(kw_only=True)
class CompileResult:
    """The manifest written, and which programs were traced or reused."""

    manifest: Manifest
    traced: tuple[str, ...]
    reused: tuple[str, ...]


def program_key(graph_key: str, name: str, backend: str, backend_version: str, code: str) -> str:
    """The compile-cache key of one program (hex sha256); `code` is `code_version()`. Pure."""
    doc = json.dumps([PROGRAM_FORMAT, graph_key, name, backend, backend_version, code], separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


@functools.cache
def code_version() -> str:
    """A hash (hex sha256) of the Python sources of `nxdi.core` and `nxdi.effects`: the code whose
    graph a traced program holds. Read once per process (a few hundred files, milliseconds)."""
    root = Path(__file__).resolve().parent.parent  # the nxdi package
    digest = hashlib.sha256()
    for path in sorted(p for sub in ("core", "effects") for p in (root / sub).rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _compatibility(
    manifest: Manifest, backend: Backend, graph_key: str | None, directory: Path
) -> Result[Manifest, ArtifactError]:
    """The manifest was made by this backend and version (and for `graph_key`, when given)."""
    where, fix = str(directory / MANIFEST), "compile the model again with this installation"
    problems = []
    if manifest.backend != backend.name:
        why = f"loading with backend {backend.name!r}"
        fix_backend = f"load with NXDI_BACKEND={manifest.backend}, or compile again with backend {backend.name!r}"
        problems.append(Problem.of(f"{where}:backend", manifest.backend, why, fix_backend))
    elif manifest.backend_version != backend.version():
        reason = f"compiled with {manifest.backend_version}, running {backend.version()}"
        problems.append(Problem.of(f"{where}:backend_version", manifest.backend_version, reason, fix))
    if graph_key is not None and manifest.graph_key != graph_key:
        reason = "compiled for a different configuration (graph key)"
        problems.append(Problem.of(f"{where}:graph_key", manifest.graph_key, reason, "compile with this configuration"))
    return Failure(ArtifactError(problems=problems)) if problems else Success(manifest)


def load_programs(
    directory: str | os.PathLike[str], backend: Backend, *, graph_key: str | None = None
) -> Result[dict[ProgramKey, CompiledProgram], ArtifactError]:
    """Every program of a compiled folder, verified and deserialized (no tracing).

    Returns:
        key -> program, or an ArtifactError: no manifest (`not_found`), a manifest of
        another format or malformed, missing/altered files (each named), or another backend,
        version or graph key.
    """
    root = Path(directory)
    checked = (
        read_manifest(root).bind(lambda m: _compatibility(m, backend, graph_key, root)).bind(lambda m: verify(root, m))
    )
    return checked.bind(lambda m: _deserialize(root, m, backend))


def _deserialize(
    root: Path, manifest: Manifest, backend: Backend
) -> Result[dict[ProgramKey, CompiledProgram], ArtifactError]:
    """Every program read back by the backend; an ArtifactError names each file it cannot read."""
    programs, problems = {}, []
    names = program_names(p.key for p in manifest.programs)
    for p in manifest.programs:
        path = root / p.file
        try:
            programs[p.key] = backend.load(path, p.signature, name=names[p.key])
        except ImportError:
            raise  # the backend's toolchain is missing: not the file's fault
        except Exception as e:  # a deserializer fed bad bytes can raise anything
            # The file matched its manifest hash, so it was replaced along with the manifest (or
            # written broken): say which file and what the reader said.
            why = f"cannot be read as a {backend.name} program ({type(e).__name__}: {e})"
            problems.append(Problem.of(str(path), "<unreadable>", why, "delete the folder and compile again"))
    return Failure(ArtifactError(problems=tuple(problems))) if problems else Success(programs)


# --- compiling --------------------------------------------------------------------------------


def _publish(write: Callable[[Path], object], target: Path) -> None:
    files.publish(target, write)


def _from_cache(cache_dir: Path | None, key: str, target: Path) -> bool:
    """Copy a verified cached program to `target`; False when absent or not intact."""
    if cache_dir is None:
        return False
    entry = cache_dir / key
    try:
        record = json.loads((entry / "entry.json").read_text(encoding="utf-8"))
        source = entry / str(record["file"])
        if sha256_file(source) != record["sha256"]:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    _publish(lambda tmp: shutil.copyfile(source, tmp), target)
    return True


def _to_cache(cache_dir: Path | None, key: str, source: Path) -> None:
    """Store a program under its key (the entry record is written last)."""
    if cache_dir is None:
        return
    entry = cache_dir / key
    try:
        _publish(lambda tmp: shutil.copyfile(source, tmp), entry / source.name)
        doc = {"file": source.name, "sha256": sha256_file(entry / source.name)}
        files.write_text_atomic(entry / "entry.json", json.dumps(doc, indent=1))
    except OSError:
        # The cache only saves time (it is on by default, in the user's cache folder): one that
        # cannot be written (read-only, full) leaves the compile as it is, and the entry without
        # its record is never read.
        return


def _reusable(directory: Path) -> dict[str, ProgramRecord]:
    """cache key -> record of the folder's current programs whose files are intact."""
    match read_manifest(directory):
        case Success(m):
            ok = {f.path for f in m.files if is_successful(verify(directory, attrs.evolve(m, files=(f,))))}
            return {p.cache_key: p for p in m.programs if p.file in ok}
    return {}


def _place(req: ProgramRequest, name: str, target: Path, key: str, ctx: _Context) -> bool:
    """Put the program at `target`: from the folder, the cache, or by tracing. True when traced."""
    old = ctx.reusable.get(key)
    if old is not None:
        source = ctx.previous / old.file
        if source != target:
            files.link_or_copy(source, target)
        return False  # same key, intact: keep it (linked from the previous folder)
    if _from_cache(ctx.cache_dir, key, target):
        return False
    program = ctx.backend.compile(req.fn, req.signature, req.example(), name=name)
    _publish(lambda tmp: ctx.backend.save(program, tmp), target)
    _to_cache(ctx.cache_dir, key, target)
    return True


@attrs.frozen(kw_only=True)
class _Context:
    directory: Path
    previous: Path
    """The folder whose intact programs are reused (the folder itself when compiling in place)."""
    backend: Backend
    cache_dir: Path | None
    reusable: dict[str, ProgramRecord]


def compile_programs(
    directory: str | os.PathLike[str],
    requests: Sequence[ProgramRequest],
    *,
    graph_key: str,
    backend: Backend,
    cache_dir: str | os.PathLike[str] | None = None,
    record: Iterable[str] = (),
    source: Iterable[SourceFile] = (),
    previous: str | os.PathLike[str] | None = None,
) -> CompileResult:
    """Compile `requests` into `directory` (reusing unchanged programs) and write the manifest last.

    Args:
        directory: the compiled-model folder (created if needed).
        requests: one per program key; keys must be unique.
        graph_key: hash of the graph-affecting configuration (part of every program's cache key).
        backend: traces, saves and (later) loads the programs.
        cache_dir: optional cache shared across folders (e.g. `Env.compile_cache_dir`).
        record: other files of the folder (relative paths, e.g. `neuron_config.json`) whose
            hashes the manifest should hold, so loading detects changes to them too.
        source: the original checkpoint's files (`checkpoint_scan.scan_checkpoint`), pinned in
            the manifest.
        previous: the compiled folder that `directory` (a build folder) will replace; its intact
            programs of unchanged keys are linked into `directory`. Default: `directory` itself,
            compiled in place (its manifest is deleted first).

    Raises:
        ValueError: two requests for one key. Exceptions from tracing propagate; the
            folder is then left without a manifest (reads as not compiled).
    """
    root = Path(directory)
    keys = [r.key for r in requests]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two requests for one program among {[k.describe() for k in keys]}")
    named = program_names(keys)
    names = [named[k] for k in keys]
    version = backend.version()
    old = root if previous is None else Path(previous)
    reusable = _reusable(old)
    if old == root:
        (root / MANIFEST).unlink(missing_ok=True)  # not compiled until the new manifest lands
    cache = None if cache_dir is None else Path(cache_dir)
    ctx = _Context(directory=root, previous=old, backend=backend, cache_dir=cache, reusable=reusable)
    programs, traced = [], []
    for req, name in zip(requests, names, strict=True):
        key = program_key(graph_key, name, backend.name, version, code_version())
        rel = f"{PROGRAMS}/{name}{backend.suffix}"
        if _place(req, name, root / rel, key, ctx):
            traced.append(name)
        programs.append(ProgramRecord(key=req.key, file=rel, signature=req.signature, cache_key=key))
    _remove_stale(root, {p.file for p in programs})
    rels = [p.file for p in programs] + [r for r in record if r not in {p.file for p in programs}]
    manifest = Manifest(
        graph_key=graph_key,
        backend=backend.name,
        backend_version=version,
        programs=programs,
        files=[record_file(root, r) for r in rels],
        source=source,
    )
    files.write_text_atomic(root / MANIFEST, json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    reused = tuple(n for n in names if n not in traced)
    return CompileResult(manifest=manifest, traced=tuple(traced), reused=reused)


def _remove_stale(root: Path, keep: set[str]) -> None:
    """Delete program files (and leftover temporaries) that the new manifest does not list."""
    folder = root / PROGRAMS
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.is_file() and f"{PROGRAMS}/{path.name}" not in keep:
            path.unlink()

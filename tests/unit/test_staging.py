"""Replacing a compiled-model folder as a whole: the swap, what it keeps, what it cleans up, and
recovery from a swap interrupted on a file system without an atomic exchange."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nxdi.effects import staging


def _write(folder: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def _read(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _compile(folder: Path, files: dict[str, str]) -> None:
    with staging.building(folder) as build:
        target = build.target  # the real folder (a symlink resolved)
        assert build.path.parent == target.parent and build.path.name.startswith(f".{target.name}.nxdi-build-")
        _write(build.path, files)


OLD = {"manifest.json": "old", "programs/a.pt2": "old a", "programs/b.pt2": "old b"}
NEW = {"manifest.json": "new", "programs/a.pt2": "new a", "neuron_config.json": "new config"}


@pytest.fixture
def compiled(tmp_path: Path) -> Path:
    folder = tmp_path / "compiled"
    _compile(folder, OLD)
    return folder


def _beside(folder: Path) -> list[str]:
    """What compiles left beside the folder (the lock file excepted)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.nxdi-build"))


def test_a_first_compile_creates_the_folder(compiled: Path) -> None:
    assert _read(compiled) == OLD and _beside(compiled) == []


def test_a_recompile_replaces_the_folder_as_a_whole_and_keeps_foreign_files(compiled: Path) -> None:
    _write(compiled, {"tokenizer.json": "tok", "extra/notes.txt": "mine"})
    inode = (compiled / "tokenizer.json").stat().st_ino
    _compile(compiled, NEW)
    # programs/ is the build's own (b.pt2 gone); files the build did not write are carried over
    assert _read(compiled) == {**NEW, "tokenizer.json": "tok", "extra/notes.txt": "mine"}
    assert (compiled / "tokenizer.json").stat().st_ino == inode  # hard-linked, not copied
    assert _beside(compiled) == []


def test_an_exception_while_building_leaves_the_folder_untouched(compiled: Path) -> None:
    with pytest.raises(KeyboardInterrupt), staging.building(compiled) as build:
        _write(build.path, NEW)
        raise KeyboardInterrupt
    assert _read(compiled) == OLD and _beside(compiled) == []


def test_the_folder_keeps_its_permissions(compiled: Path) -> None:
    compiled.chmod(0o750)
    _compile(compiled, NEW)
    assert compiled.stat().st_mode & 0o777 == 0o750
    fresh = compiled.parent / "fresh"
    _compile(fresh, NEW)
    assert fresh.stat().st_mode & 0o077 != 0  # not mkdtemp's private 0700 (umask permitting)


@pytest.mark.skipif(staging._renameat2() is None, reason="no renameat2 here")
def test_exchange_swaps_two_folders_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, {"x": "a"})
    _write(b, {"x": "b"})
    assert staging.exchange(a, b)
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_without_an_atomic_exchange_the_fallback_swaps_too(compiled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "exchange", lambda a, b: False)
    _compile(compiled, NEW)
    assert _read(compiled) == NEW
    assert [p.name for p in compiled.parent.iterdir() if ".nxdi-old-" in p.name] == []


def _interrupt_fallback_swap(compiled: Path) -> Path:
    """The state a compile killed between the fallback's two renames leaves: the folder renamed
    aside, the new build complete beside it."""
    aside = compiled.parent / f".{compiled.name}.nxdi-old-4242-deadbeef"
    os.rename(compiled, aside)
    _write(compiled.parent / f".{compiled.name}.nxdi-build-4242-cafe0001", NEW)
    return aside


def test_a_load_puts_back_a_folder_left_aside_by_an_interrupted_swap(compiled: Path) -> None:
    aside = _interrupt_fallback_swap(compiled)
    with staging.reading(compiled) as folder:
        assert folder == compiled and _read(compiled) == OLD
    assert not aside.exists()


def test_the_next_compile_recovers_and_deletes_every_leftover(compiled: Path) -> None:
    _interrupt_fallback_swap(compiled)
    (compiled.parent / f".{compiled.name}.nxdi-build-77-stale").mkdir()
    (compiled.parent / f".{compiled.name}x.nxdi-build-77-other").mkdir()  # another folder's: kept
    reused = {}
    with staging.building(compiled) as build:
        reused = _read(build.target)  # the old compile, back in place for reuse
        _write(build.path, NEW)
    assert reused == OLD and _read(compiled) == NEW
    assert _beside(compiled) == [] and [p.name for p in compiled.parent.iterdir() if ".nxdi-old-" in p.name] == []
    assert (compiled.parent / f".{compiled.name}x.nxdi-build-77-other").is_dir()


def test_a_symlinked_folder_is_replaced_behind_its_link(compiled: Path) -> None:
    link = compiled.parent / "link"
    link.symlink_to(compiled)
    _compile(link, NEW)
    assert link.is_symlink() and _read(compiled) == NEW


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "compiled").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="compile into a folder"), staging.building(tmp_path / "compiled"):
        pass


def test_entries_the_compile_owns_are_not_carried_over(compiled: Path) -> None:
    _write(compiled, {"hlo/old_program.hlo.txt": "stale", "tokenizer.json": "tok"})
    with staging.building(compiled, owned=("hlo", "programs")) as build:
        _write(build.path, {"manifest.json": "new"})
    assert _read(compiled) == {"manifest.json": "new", "tokenizer.json": "tok"}

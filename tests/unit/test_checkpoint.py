"""The checkpoint reader: every layout, preference order, laziness, and one clear error per bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from nxdi.effects import checkpoint
from nxdi.testing.checkpoints import SaveFormat

EXPECTED_FORMAT = {
    SaveFormat.SAFETENSORS: checkpoint.CheckpointFormat.SAFETENSORS,
    SaveFormat.SAFETENSORS_SHARDED: checkpoint.CheckpointFormat.SAFETENSORS_INDEX,
    SaveFormat.BIN: checkpoint.CheckpointFormat.BIN,
    SaveFormat.BIN_SHARDED: checkpoint.CheckpointFormat.BIN_INDEX,
}


def _digests(directory: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("fmt", list(SaveFormat))
def test_every_layout_reads_back_the_state_dict_without_touching_the_files(
    fmt: SaveFormat, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    path = tiny_checkpoint("llama3-tied", fmt)
    before = _digests(path)
    expected = {k: v for k, v in tiny_model("llama3-tied").state_dict().items() if k != "lm_head.weight"}
    with checkpoint.open_checkpoint(path) as ckpt:
        assert ckpt.files.format is EXPECTED_FORMAT[fmt]
        assert ckpt.shapes() == {k: tuple(v.shape) for k, v in expected.items()}
        stream = ckpt.iter_tensors()
        first_key, first = next(stream)  # a generator: one tensor at a time
        assert torch.equal(first, expected[first_key])
        got = dict(stream) | {first_key: first}
        q = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(ckpt.read_slice(q, dim=0, start=8, stop=24), expected[q][8:24])
        assert torch.equal(ckpt.read_slice(q, dim=1, start=3, stop=5), expected[q][:, 3:5])
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert _digests(path) == before, "reading modified the user's files"


def test_a_directory_is_read_in_nxdi_preference_order(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    for fmt in SaveFormat:
        for f in tiny_checkpoint("llama", fmt).iterdir():
            shutil.copy(f, tmp_path / f.name)
    for fmt in checkpoint.SEARCH_ORDER:
        assert checkpoint.find_checkpoint(tmp_path).format is fmt
        (tmp_path / fmt.value).unlink()
    with pytest.raises(checkpoint.CheckpointNotFoundError):
        checkpoint.find_checkpoint(tmp_path)


def test_a_single_file_path_is_read_as_is(tiny_checkpoint: Callable[..., Path]) -> None:
    single = tiny_checkpoint("llama", SaveFormat.BIN) / "pytorch_model.bin"
    assert checkpoint.find_checkpoint(single).format is checkpoint.CheckpointFormat.BIN
    index = tiny_checkpoint("llama", SaveFormat.SAFETENSORS_SHARDED) / "model.safetensors.index.json"
    assert checkpoint.find_checkpoint(index).format is checkpoint.CheckpointFormat.SAFETENSORS_INDEX


def test_no_checkpoint_names_the_four_files_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        checkpoint.find_checkpoint(tmp_path)
    assert isinstance(info.value, checkpoint.CheckpointNotFoundError)
    for name in (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ):
        assert name in str(info.value)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="does not exist"):
        checkpoint.find_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize(
    ("fmt", "name", "damage"),
    [
        (SaveFormat.SAFETENSORS, "model.safetensors", lambda b: b[: len(b) - 64]),
        (SaveFormat.SAFETENSORS, "model.safetensors", lambda b: b[:6]),
        (SaveFormat.SAFETENSORS, "model.safetensors", lambda b: b[:8] + b"{{{{" + b[12:]),
        (SaveFormat.BIN, "pytorch_model.bin", lambda b: b[: len(b) // 2]),
        (SaveFormat.BIN, "pytorch_model.bin", lambda b: b"not a zip file at all" * 8),
        (SaveFormat.SAFETENSORS_SHARDED, "model.safetensors.index.json", lambda b: b[: len(b) // 2]),
    ],
)
def test_truncated_or_corrupt_files_name_the_file(
    fmt: SaveFormat, name: str, damage: Callable[[bytes], bytes], tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _copy(tiny_checkpoint("llama", fmt), tmp_path / "ckpt")
    (path / name).write_bytes(damage((path / name).read_bytes()))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=re.escape(name)):
        checkpoint.read_state_dict(path)


class _NotATensor:
    pass


def test_a_pickle_that_is_not_a_plain_state_dict_is_refused(tmp_path: Path) -> None:
    torch.save({"w": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(checkpoint.CorruptCheckpointError, match=re.escape("pytorch_model.bin")):
        checkpoint.open_checkpoint(tmp_path)
    torch.save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="state dict"):
        checkpoint.open_checkpoint(tmp_path)


def _sharded(tmp_path: Path, weight_map: dict[str, str], shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(directory / name))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"]
)
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path: Path, shard: str) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "outside.safetensors"))  # exists, and still refused
    path = _sharded(tmp_path, {"a": shard}, {})
    with pytest.raises(checkpoint.UnsafeShardPathError, match=re.escape(shard)):
        checkpoint.open_checkpoint(path)


def test_an_index_naming_a_missing_shard_names_it(tmp_path: Path) -> None:
    path = _sharded(
        tmp_path, {"a": "one.safetensors", "b": "two.safetensors"}, {"one.safetensors": {"a": torch.ones(1)}}
    )
    with pytest.raises(checkpoint.MissingShardError, match=re.escape("two.safetensors")):
        checkpoint.open_checkpoint(path)


def test_a_key_in_two_shards_is_refused(tmp_path: Path) -> None:
    shards = {"one.safetensors": {"a": torch.ones(1)}, "two.safetensors": {"a": torch.zeros(1), "b": torch.ones(1)}}
    path = _sharded(tmp_path, {"a": "one.safetensors", "b": "two.safetensors"}, shards)
    with pytest.raises(checkpoint.DuplicateTensorError, match=r"'a' in one.safetensors and two.safetensors"):
        checkpoint.open_checkpoint(path)


def test_a_key_listed_twice_in_an_index_is_refused(tmp_path: Path) -> None:
    path = _sharded(tmp_path, {"a": "one.safetensors"}, {"one.safetensors": {"a": torch.ones(1)}})
    (path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "one.safetensors", "a": "one.safetensors"}}'
    )
    with pytest.raises(checkpoint.DuplicateTensorError, match="'a'"):
        checkpoint.open_checkpoint(path)


def test_an_index_placing_a_key_in_the_wrong_shard_is_refused(tmp_path: Path) -> None:
    shards = {"one.safetensors": {"a": torch.ones(1)}, "two.safetensors": {"b": torch.ones(1)}}
    path = _sharded(tmp_path, {"a": "two.safetensors", "b": "two.safetensors"}, shards)
    with pytest.raises(checkpoint.IndexMismatchError, match="'a'"):
        checkpoint.open_checkpoint(path)


def test_an_index_without_a_weight_map_is_corrupt(tmp_path: Path) -> None:
    path = _sharded(tmp_path, {}, {})
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(checkpoint.CorruptCheckpointError, match="weight_map"):
        checkpoint.open_checkpoint(path)


def test_write_safetensors_is_atomic_and_handles_shared_tensors(tmp_path: Path) -> None:
    embed = torch.randn(4, 3)
    tensors = {"embed": embed, "lm_head": embed, "q": embed[:2], "t": torch.randn(3, 4).t()}
    target = checkpoint.write_safetensors(tmp_path / "out" / "w.safetensors", tensors, metadata={"k": "v"})
    assert [p.name for p in target.parent.iterdir()] == ["w.safetensors"], "no temporary file is left behind"
    with checkpoint.open_checkpoint(target) as ckpt:
        for k, v in tensors.items():
            assert torch.equal(ckpt.read(k), v)
    before = target.read_bytes()
    with pytest.raises(AttributeError):
        checkpoint.write_safetensors(target, {"bad": "not a tensor"})  # type: ignore[dict-item]
    assert target.read_bytes() == before, "a failed write leaves the old file intact"
    assert [p.name for p in target.parent.iterdir()] == ["w.safetensors"]


# --- every checkpoint file resolves to a regular file ------------------------------------------------


def _bounded(action: Callable[[], Any]) -> BaseException | None:
    """Run `action` in a daemon thread: opening a FIFO by mistake blocks forever, which must fail
    the test rather than hang it. Returns what it raised (None when it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert outcome, "the reader blocked (it opened something that is not a regular file)"
    return outcome[0]


IRREGULAR = {
    "symlink-to-dev-zero": (
        lambda p: os.symlink("/dev/zero", p),
        "a symlink to /dev/zero, which is a character device",
    ),
    "fifo": (os.mkfifo, "a FIFO (named pipe)"),
    "directory": (os.mkdir, "a directory"),
    "broken-symlink": (lambda p: os.symlink(p.parent / "gone.safetensors", p), "a broken symlink"),
}


@pytest.mark.parametrize("kind", list(IRREGULAR))
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused_saying_what_it_is(
    kind: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    make, what = IRREGULAR[kind]
    path = _copy(tiny_checkpoint("llama", SaveFormat.BIN), tmp_path / "ckpt")  # a fallback exists
    make(path / "model.safetensors")
    before = _digests(path)
    caught = _bounded(lambda: checkpoint.open_checkpoint(path))
    assert isinstance(caught, checkpoint.NotARegularFileError) and isinstance(caught, ValueError)
    message = str(caught)
    assert f"model.safetensors is {what}" in message and "must be regular files" in message
    assert "no checkpoint" not in message, "not mistaken for a missing checkpoint, nor skipped for the .bin"
    assert _digests(path) == before


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo", "directory"])
def test_an_index_shard_that_is_not_a_regular_file_is_refused_naming_it(kind: str, tmp_path: Path) -> None:
    make, what = IRREGULAR[kind]
    path = _sharded(
        tmp_path, {"a": "one.safetensors", "b": "two.safetensors"}, {"one.safetensors": {"a": torch.ones(1)}}
    )
    make(path / "two.safetensors")
    caught = _bounded(lambda: checkpoint.open_checkpoint(path))
    assert isinstance(caught, checkpoint.NotARegularFileError)
    assert f"two.safetensors is {what}" in str(caught) and "model.safetensors.index.json" in str(caught)
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # a FIFO passed as the checkpoint itself
    caught = _bounded(lambda: checkpoint.find_checkpoint(fifo))
    assert isinstance(caught, checkpoint.NotARegularFileError) and "pipe.safetensors is a FIFO" in str(caught)


def test_symlinks_to_regular_files_elsewhere_are_read(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The Hugging Face cache layout: snapshot entries are symlinks into a blobs folder elsewhere."""
    for fmt in (SaveFormat.SAFETENSORS, SaveFormat.SAFETENSORS_SHARDED):
        src = tiny_checkpoint("llama", fmt)
        blobs, snapshot = tmp_path / fmt.value / "blobs", tmp_path / fmt.value / "snapshots" / "abc"
        blobs.mkdir(parents=True)
        snapshot.mkdir(parents=True)
        for f in src.iterdir():
            blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, blob)
            os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
        assert checkpoint.read_state_dict(snapshot).keys() == checkpoint.read_state_dict(src).keys()

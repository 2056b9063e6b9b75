"""The checkpoint reader: every layout, preference order, laziness, and one clear error per bad input."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
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

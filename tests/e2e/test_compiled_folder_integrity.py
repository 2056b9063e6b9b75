"""compile() / load() through the shell: every file of the folder that cannot be read back is an
ArtifactIntegrityError naming it (even when its manifest hash was rewritten to match), and a
re-compile that fails keeps the previous compile."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from nxdi.effects import artifacts, backends
from nxdi.shell.exceptions import ArtifactIntegrityError
from nxdi.shell.models import NeuronLlamaForCausalLM
from nxdi.testing import checkpoints
from tests.support import compile_server

CONFIG = "neuron_config.json"
SHARD = "weights/tp0_sharded_checkpoint.safetensors"
PROGRAM = "programs/token_generation_32.pt2"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = checkpoints.build_checkpoint(
        tmp_path_factory.mktemp("llama"), "llama", checkpoints.SaveFormat.SAFETENSORS
    )
    return path


@pytest.fixture(scope="module")
def compiled(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compiled") / "compiled"
    NeuronLlamaForCausalLM(checkpoint, compile_server.config(checkpoint, "A")).compile(folder)
    return folder


@pytest.fixture
def copy(compiled: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(compiled, tmp_path / "copy"))


def _rewrite(folder: Path, rel: str, data: bytes) -> Path:
    """Replace `folder/rel` with `data` and make its manifest entry match."""
    path = folder / rel
    path.write_bytes(data)
    manifest = folder / artifacts.MANIFEST
    doc = json.loads(manifest.read_text())
    doc["files"][rel] = {"sha256": artifacts.sha256_file(path), "size": path.stat().st_size}
    manifest.write_text(json.dumps(doc))
    return path


def _json(change: Callable[[dict[str, object]], object]) -> Callable[[bytes], bytes]:
    return lambda data: json.dumps(change(json.loads(data))).encode()


def _neuron(key: str, value: object) -> Callable[[bytes], bytes]:
    return _json(lambda doc: {**doc, "neuron_config": {**doc["neuron_config"], key: value}})  # type: ignore[dict-item]


CONFIGS: dict[str, Callable[[bytes], bytes]] = {
    "garbage bytes": lambda data: bytes(range(256)) * 4,
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "a JSON list": lambda data: b"[1, 2]",
    "neuron_config not an object": _json(lambda doc: {**doc, "neuron_config": 5}),
    "no neuron_config": _json(lambda doc: {k: v for k, v in doc.items() if k != "neuron_config"}),
    "batch_size a string": _neuron("batch_size", "one"),
    "tp_degree a list": _neuron("tp_degree", [1]),
    "hidden_size a string": _json(lambda doc: {**doc, "hidden_size": "64"}),
    "attribute_map a number": _json(lambda doc: {**doc, "attribute_map": 5}),
}


@pytest.mark.parametrize("corrupt", CONFIGS.values(), ids=CONFIGS.keys())
def test_an_unreadable_neuron_config_is_named(copy: Path, corrupt: Callable[[bytes], bytes]) -> None:
    path = _rewrite(copy, CONFIG, corrupt((copy / CONFIG).read_bytes()))
    with pytest.raises(ArtifactIntegrityError, match=rf"{path}.*cannot be read as a configuration.*compile"):
        NeuronLlamaForCausalLM(copy)


def _header(data: bytes, change: Callable[[dict[str, object]], object]) -> bytes:
    """A safetensors file with its JSON header passed through `change` (the data bytes kept)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.dumps(change(json.loads(data[8 : 8 + n]))).encode()
    return struct.pack("<Q", len(header)) + header + data[8 + n :]


SHARDS: dict[str, Callable[[bytes], bytes]] = {
    "garbage bytes": lambda data: bytes(range(256)) * 4,
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "a header of the wrong types": lambda data: _header(
        data, lambda h: {k: (v if k == "__metadata__" else {**v, "shape": "4x4"}) for k, v in h.items()}
    ),
    "a header that is not an object": lambda data: _header(data, lambda h: [1]),
}


@pytest.mark.parametrize("corrupt", SHARDS.values(), ids=SHARDS.keys())
def test_an_unreadable_weights_shard_is_named(copy: Path, corrupt: Callable[[bytes], bytes]) -> None:
    path = _rewrite(copy, SHARD, corrupt((copy / SHARD).read_bytes()))
    with pytest.raises(ArtifactIntegrityError, match=rf"{path}.*cannot be read as weights.*compile again"):
        NeuronLlamaForCausalLM(copy).load(copy)


def test_an_unreadable_program_is_named(copy: Path) -> None:
    path = _rewrite(copy, PROGRAM, b"PK\x03\x04" + bytes(100))
    with pytest.raises(ArtifactIntegrityError, match=rf"{path}.*cannot be read as a cpu program.*compile again"):
        NeuronLlamaForCausalLM(copy).load(copy)


def test_a_failed_recompile_keeps_the_previous_compile(
    checkpoint: Path, copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (copy / "tokenizer.json").write_text("{}")  # the user's own file
    cpu = type(backends.backend_named("cpu"))

    def interrupted(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu, "compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        NeuronLlamaForCausalLM(checkpoint, compile_server.config(checkpoint, "B")).compile(copy)
    monkeypatch.undo()
    model = NeuronLlamaForCausalLM(copy)
    model.load(copy)
    assert list(model.neuron_config.token_generation_buckets) == compile_server.VARIANTS["A"]
    assert [p.name for p in copy.parent.iterdir() if ".nxdi-build-" in p.name] == []
    NeuronLlamaForCausalLM(checkpoint, compile_server.config(checkpoint, "B")).compile(copy)
    assert (copy / "tokenizer.json").read_text() == "{}"
    assert json.loads((copy / CONFIG).read_text())["neuron_config"]["token_generation_buckets"] == [24, 32]

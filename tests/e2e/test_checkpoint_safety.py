"""Nothing silently wrong with a checkpoint, through the documented API: non-floating or non-finite
weights are refused at compile() and to_cpu(); a folder that reads its weights from the original
checkpoint refuses it once changed (re-pinning accepts it); checkpoint files that are not regular
files are refused saying so. Every case names the tensor or file, and leaves the user's files as
they were."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi import NeuronConfig, load_pretrained_config
from nxdi.effects.checkpoint import NotARegularFileError
from nxdi.shell.exceptions import ArtifactIntegrityError, CheckpointValidationError
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi.testing.checkpoints import write_checkpoint_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q0 = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
IDS = torch.tensor([[1, 5, 7, 9]])
ALLOW = "NXDI_ALLOW_NONFINITE_WEIGHTS"


def _model(path: Path, **kw: Any) -> NeuronLlamaForCausalLM:
    neuron = NeuronConfig(batch_size=1, seq_len=32, max_context_length=16, torch_dtype="float32", **kw)
    return NeuronLlamaForCausalLM(path, LlamaInferenceConfig(neuron, load_config=load_pretrained_config(path)))


def _checkpoint(tiny_checkpoint: Callable[..., Path], tiny_model: Any, path: Path, **changes: Any) -> Path:
    """A copy of the tiny llama checkpoint at `path`, with `changes(state)` applied to its tensors."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_checkpoint("llama") / "config.json", path / "config.json")
    state = {k: v.detach().clone() for k, v in tiny_model("llama").state_dict().items()}
    for key, change in changes.items():
        state[key] = change(state[key])
    write_checkpoint_file(path / "model.safetensors", state)
    return path


def _snapshot(path: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in path.iterdir()}


def _logits(model: NeuronLlamaForCausalLM) -> torch.Tensor:
    return model(IDS).logits


def _poison(t: torch.Tensor) -> torch.Tensor:
    t[0, 0], t[1, 2] = float("nan"), float("inf")
    return t


@pytest.mark.parametrize(
    ("change", "dtype"),
    [(lambda t: (t * 100).to(torch.int32), "int32"), (lambda t: t > 0, "bool")],
    ids=["int32", "bool"],
)
def test_non_floating_weights_are_refused_at_compile_and_to_cpu(
    change: Callable[[torch.Tensor], torch.Tensor],
    dtype: str,
    tiny_checkpoint: Callable[..., Path],
    tiny_model: Any,
    tmp_path: Path,
) -> None:
    path = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "ckpt", **{Q0: change})
    before = _snapshot(path)
    expected = rf"{Q0}='{dtype}': has dtype {dtype}; model weights must be floating point"
    with pytest.raises(CheckpointValidationError, match=expected):
        _model(path).compile(tmp_path / "compiled")
    assert not (tmp_path / "compiled" / "manifest.json").exists(), "nothing compiled"
    with pytest.raises(CheckpointValidationError, match=expected):
        _model(path).to_cpu()
    assert _snapshot(path) == before


def test_nan_and_inf_weights_are_refused_unless_the_user_opts_in(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "ckpt", **{Q0: _poison, NORM: _poison_norm})
    before = _snapshot(path)
    compiled = tmp_path / "compiled"
    for bring_up in (lambda m: m.compile(compiled), lambda m: m.to_cpu()):
        with pytest.raises(CheckpointValidationError) as caught:
            bring_up(_model(path))
        assert caught.value.error is not None
        assert {p.field: p.value for p in caught.value.error.problems} == {
            Q0: "'1 NaN and 1 inf of 4096 values'",
            NORM: "'1 NaN of 64 values'",
        }
        assert f"{ALLOW}=1" in str(caught.value)
    assert not (compiled / "manifest.json").exists()

    monkeypatch.setenv(ALLOW, "1")
    with pytest.warns(UserWarning, match=rf"{ALLOW}=1: .*{Q0} \(1 NaN and 1 inf of 4096 values\)"):
        _model(path).compile(compiled)
    loaded = NeuronLlamaForCausalLM(compiled)
    loaded.load(compiled)
    assert _logits(loaded).isnan().all(), "accepted, and as poisoned as promised"
    eager = _model(path)
    eager.to_cpu()
    assert _logits(eager).isnan().all()
    assert _snapshot(path) == before


def _poison_norm(t: torch.Tensor) -> torch.Tensor:
    t[3] = float("nan")
    return t


@pytest.fixture
def pinned(tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path) -> tuple[Path, Path]:
    """A private checkpoint and a folder compiled from it without save_sharded_checkpoint."""
    path = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "ckpt")
    _model(path).compile(tmp_path / "compiled")
    return path, tmp_path / "compiled"


def test_a_checkpoint_changed_after_compile_is_refused_until_repinned(
    pinned: tuple[Path, Path], tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    path, compiled = pinned
    model = NeuronLlamaForCausalLM(compiled)
    model.load(compiled)
    original = _logits(model)
    size = (path / "model.safetensors").stat().st_size
    _checkpoint(tiny_checkpoint, tiny_model, path, **{Q0: lambda t: t * 2})  # same size, new content
    assert (path / "model.safetensors").stat().st_size == size
    before = _snapshot(path)
    with pytest.raises(ArtifactIntegrityError) as caught:
        NeuronLlamaForCausalLM(compiled).load(compiled)
    message = str(caught.value)
    assert f"{path / 'model.safetensors'}='sha256 mismatch': content changed since compile" in message
    assert "repin_checkpoint=True" in message

    repinned = NeuronLlamaForCausalLM(compiled)
    repinned.load(compiled, repin_checkpoint=True)
    eager = _model(path)
    eager.to_cpu()
    assert not torch.equal(_logits(repinned), original)
    torch.testing.assert_close(_logits(repinned), _logits(eager))
    again = NeuronLlamaForCausalLM(compiled)
    again.load_weights(compiled)  # the new pin holds
    torch.testing.assert_close(_logits(again), _logits(eager))
    source = json.loads((compiled / "manifest.json").read_text())["source"]
    assert source == [
        {
            "path": "model.safetensors",
            "size": size,
            "mtime_ns": (path / "model.safetensors").stat().st_mtime_ns,
            "sha256": before["model.safetensors"][0],
        }
    ]
    assert _snapshot(path) == before, "loading and re-pinning leave the checkpoint as it was"


def test_repinning_checks_the_values_again(
    pinned: tuple[Path, Path], tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    path, compiled = pinned
    manifest = (compiled / "manifest.json").read_bytes()
    _checkpoint(tiny_checkpoint, tiny_model, path, **{Q0: _poison})
    with pytest.raises(CheckpointValidationError, match=rf"{Q0}='1 NaN and 1 inf of 4096 values'"):
        NeuronLlamaForCausalLM(compiled).load(compiled, repin_checkpoint=True)
    assert (compiled / "manifest.json").read_bytes() == manifest, "nothing re-pinned"
    with pytest.raises(ArtifactIntegrityError, match="content changed since compile"):
        NeuronLlamaForCausalLM(compiled).load(compiled)


def test_a_touched_but_unchanged_checkpoint_loads(pinned: tuple[Path, Path]) -> None:
    path, compiled = pinned
    os.utime(path / "model.safetensors", ns=(1, 10**18))  # new mtime, same bytes: re-hashed, accepted
    NeuronLlamaForCausalLM(compiled).load(compiled)


def test_a_folder_with_its_own_weights_does_not_read_the_checkpoint_again(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path
) -> None:
    path = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "ckpt")
    compiled = tmp_path / "compiled"
    _model(path, save_sharded_checkpoint=True).compile(compiled)
    model = NeuronLlamaForCausalLM(compiled)
    model.load(compiled)
    original = _logits(model)
    _checkpoint(tiny_checkpoint, tiny_model, path, **{Q0: lambda t: t * 2})
    model.load(compiled)  # its weights are in the folder, checked there
    torch.testing.assert_close(_logits(model), original)


def test_a_model_file_linking_to_a_device_is_refused_saying_so(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", path / "config.json")
    os.symlink("/dev/zero", path / "model.safetensors")
    for bring_up in (lambda m: m.to_cpu(), lambda m: m.compile(tmp_path / "compiled")):
        with pytest.raises(
            NotARegularFileError, match=r"model\.safetensors is a symlink to /dev/zero, which is a character"
        ):
            bring_up(_model(path))


def test_shards_of_an_earlier_compile_are_never_loaded_as_this_compiles_weights(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path
) -> None:
    """Checkpoint A compiled with its shards saved, then checkpoint B (same shapes) compiled into the
    same folder without: loading gives B's weights. Shards count only when the manifest lists them."""
    a = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "a")
    b = _checkpoint(tiny_checkpoint, tiny_model, tmp_path / "b", **{Q0: lambda t: t * 2})
    folder = tmp_path / "compiled"
    _model(a, save_sharded_checkpoint=True).compile(folder)
    _model(b).compile(folder)
    assert not (folder / "weights").exists(), "the earlier compile's shards are dropped with it"
    (folder / "weights").mkdir()  # a stray shard of A put back by hand is not read either
    shutil.copy(tmp_path / "a" / "model.safetensors", folder / "weights" / "tp0_sharded_checkpoint.safetensors")
    loaded = NeuronLlamaForCausalLM(folder)
    loaded.load(folder)
    eager_b = _model(b)
    eager_b.to_cpu()
    torch.testing.assert_close(_logits(loaded), _logits(eager_b))

    _model(b).shard_weights(folder)  # listed in the manifest now: load reads them, not the checkpoint
    shutil.rmtree(b)
    again = NeuronLlamaForCausalLM(folder)
    again.load(folder)
    torch.testing.assert_close(_logits(again), _logits(eager_b))

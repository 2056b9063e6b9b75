"""A compiled Medusa model pins its heads file: `<model>/medusa_heads.pt` is recorded in the
compiled folder's manifest beside the checkpoint's files, so load() refuses heads changed since
compile (naming the file, with the fix: compile again or re-pin), unless the folder holds the
weights (save_sharded_checkpoint), and load(repin_checkpoint=True) accepts the heads as they are now.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell.exceptions import ArtifactIntegrityError
from nxdi.shell.models import NeuronLlamaForCausalLM
from nxdi.testing import checkpoints
from nxdi.testing import medusa as testing_medusa
from tests.support.engine_fixtures import PROMPTS, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS = 4
MEDUSA = {
    "is_medusa": True,
    "medusa_speculation_length": 12,
    "num_medusa_heads": HEADS,
    "medusa_tree": [list(p) for p in testing_medusa.DEFAULT_TREE],
}


def _construct(path: Path, **kwargs: Any) -> Any:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import LlamaInferenceConfig

    config = LlamaInferenceConfig(
        NeuronConfig(seq_len=64, torch_dtype="float32", batch_size=1, **MEDUSA, **kwargs),
        load_config=load_pretrained_config(path),
    )
    return NeuronLlamaForCausalLM(path, config, backend="cpu")


def _candidates(model: Any) -> torch.Tensor:
    """The heads' candidate tokens of one context-encoding forward: they change with the heads."""
    ids, mask = padded(PROMPTS[:1], "right")
    model.reset()
    return model.forward(ids, attention_mask=mask).medusa_tokens


def _save_heads(hf: Any, path: Path, seed: int) -> None:
    testing_medusa.save_medusa_heads(testing_medusa.random_medusa_heads(hf.config, HEADS, seed=seed), path)


@pytest.mark.parametrize("sharded", [False, True], ids=["pinned-heads", "heads-in-folder"])
def test_heads_changed_since_compile_are_refused_until_repinned(sharded: bool, tmp_path: Path) -> None:
    path, hf = checkpoints.build_checkpoint(tmp_path / "model", "llama", checkpoints.SaveFormat.SAFETENSORS, seed=0)
    _save_heads(hf, path, seed=1)
    folder = tmp_path / "compiled"
    model = _construct(path, save_sharded_checkpoint=sharded)
    model.compile(folder)
    pinned = [f["path"] for f in json.loads((folder / "manifest.json").read_text())["source"]]
    assert "medusa_heads.pt" in pinned, pinned
    model.load(folder)
    compiled = _candidates(model)
    model.close()

    _save_heads(hf, path, seed=2)  # other heads: other candidates
    fresh = _construct(path, save_sharded_checkpoint=sharded)
    if sharded:  # the folder's own weights hold the heads as compiled: the file is not read
        fresh.load(folder)
        assert torch.equal(_candidates(fresh), compiled)
        return
    with pytest.raises(ArtifactIntegrityError) as caught:
        fresh.load(folder)
    message = str(caught.value)
    assert str(path / "medusa_heads.pt") in message and "changed since compile" in message, message
    assert "compile again" in message and "repin_checkpoint=True" in message, message

    fresh.load(folder, repin_checkpoint=True)
    eager = _construct(path)
    eager.to_cpu()
    repinned = _candidates(fresh)
    assert not torch.equal(repinned, compiled)
    assert torch.equal(repinned, _candidates(eager))


def test_a_heads_file_gone_since_compile_is_named(tmp_path: Path) -> None:
    path, hf = checkpoints.build_checkpoint(tmp_path / "model", "llama", checkpoints.SaveFormat.SAFETENSORS, seed=0)
    _save_heads(hf, path, seed=1)
    folder = tmp_path / "compiled"
    _construct(path).compile(folder)
    (path / "medusa_heads.pt").unlink()
    with pytest.raises(ArtifactIntegrityError, match=r"model/medusa_heads.pt: is gone since compile"):
        _construct(path).load(folder)

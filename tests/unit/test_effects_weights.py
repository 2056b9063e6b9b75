"""Running weight plans against checkpoint files: same tensors from every layout, casts, ties, and bad keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from returns.result import Failure

from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.effects import checkpoint
from nxdi.effects import weight_loader as weight_io
from nxdi.testing.checkpoints import SaveFormat, write_checkpoint_file
from nxdi.testing.strategies.decoders import plan_of


def _spec(path: Path) -> ModelSpec:
    return families.parse_model_spec(json.loads((path / "config.json").read_text())).unwrap()


@pytest.mark.parametrize("fmt", list(SaveFormat))
def test_every_layout_gives_the_in_memory_conversion(
    fmt: SaveFormat, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    path = tiny_checkpoint("qwen2", fmt)
    plan = plan_of(_spec(path))
    got = weight_io.get_state_dict(path, plan).unwrap()
    want = weight_ops.convert(plan, tiny_model("qwen2").state_dict()).unwrap()
    assert tuple(got) == plan.names() == tuple(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("cast_type", "dtype"), [("config", torch.bfloat16), ("as-declared", torch.float32)])
def test_cast_type_and_tied_embeddings(
    cast_type: str, dtype: torch.dtype, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    path = tiny_checkpoint("llama3-tied", SaveFormat.SAFETENSORS_SHARDED)
    plan = plan_of(_spec(path), cast_type=cast_type, torch_dtype="bfloat16")
    with checkpoint.open_checkpoint(path) as ckpt:
        names = [
            name
            for name, _ in weight_io.iter_weights(plan, ckpt, weights.check_checkpoint(plan, ckpt.shapes()).unwrap())
        ]
        out = weight_io.load_weights(plan, ckpt).unwrap()
    assert names == list(plan.names())
    assert {t.dtype for t in out.values()} == {dtype}
    assert out["lm_head.weight"] is out["embed_tokens.weight"], "a tied weight is stored once"
    ref = tiny_model("llama3-tied").state_dict()["model.embed_tokens.weight"]
    assert torch.equal(out["embed_tokens.weight"], ref.to(dtype))


def test_a_bad_checkpoint_lists_every_problem_and_reads_no_tensor(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {k: v for k, v in tiny_model("llama").state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    state["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    write_checkpoint_file(tmp_path / "model.safetensors", state)
    reads: list[str] = []
    monkeypatch.setattr(checkpoint.Checkpoint, "read", lambda self, key: reads.append(key))
    plan = plan_of(_spec(tiny_checkpoint("llama")))
    result = weight_io.get_state_dict(tmp_path, plan)
    assert isinstance(result, Failure)
    err = result.failure()
    assert err.fields() == {
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.7.self_attn.q_proj.weight",
    }
    assert "has shape (5, 64), expected (32, 64)" in err.render()
    assert reads == [], "nothing is read from a checkpoint that fails the check"

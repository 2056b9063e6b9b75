"""Running weight plans against checkpoint files: same tensors from every layout, casts, ties, and bad keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from returns.result import Failure, Success

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


# --- dtypes and values --------------------------------------------------------------------------------


def _llama_with(tiny_model: Any, tmp_path: Path, **changes: torch.Tensor) -> Path:
    state = {k: v.detach().clone() for k, v in tiny_model("llama").state_dict().items()} | changes
    write_checkpoint_file(tmp_path / "model.safetensors", state)
    return tmp_path


Q0 = "model.layers.0.self_attn.q_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"
NORM = "model.norm.weight"


def test_non_floating_weights_are_all_refused_from_the_headers(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tiny_model("llama").state_dict()
    path = _llama_with(
        tiny_model,
        tmp_path,
        **{Q0: (state[Q0] * 100).to(torch.int32), NORM: state[NORM] > 0, UP1: torch.zeros(3, 3)},
    )
    before = (path / "model.safetensors").read_bytes()
    reads: list[str] = []
    monkeypatch.setattr(checkpoint.Checkpoint, "read", lambda self, key: reads.append(key))
    plan = plan_of(_spec(tiny_checkpoint("llama")))
    for result in (
        weight_io.get_state_dict(path, plan),
        weight_io.example_weights(plan, path),
        weight_io.scan_source(path, plan),
    ):
        err = result.failure()
        assert [(p.field, p.value) for p in err.problems if "floating" in p.reason] == [
            (Q0, "'int32'"),
            (NORM, "'bool'"),
        ]
        assert UP1 in err.fields(), "shape and dtype problems are listed together"
    assert reads == [], "refused from the headers: no tensor read"
    assert (path / "model.safetensors").read_bytes() == before


def test_nan_and_inf_weights_are_refused_when_asked_naming_each_tensor(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path
) -> None:
    state = tiny_model("llama").state_dict()
    q, norm = state[Q0].clone(), state[NORM].clone()
    q[0, 0], q[3, 5], norm[7] = float("nan"), float("inf"), float("-inf")
    path = _llama_with(tiny_model, tmp_path, **{Q0: q, NORM: norm})
    plan = plan_of(_spec(tiny_checkpoint("llama")))
    assert isinstance(weight_io.get_state_dict(path, plan), Success), "not checked unless asked (get_state_dict)"
    for result in (weight_io.get_state_dict(path, plan, refuse_nonfinite=True), weight_io.scan_source(path, plan)):
        err = result.failure()
        assert {p.field: p.value for p in err.problems} == {
            Q0: "'1 NaN and 1 inf of 4096 values'",
            NORM: "'1 inf of 64 values'",
        }
        assert "NXDI_ALLOW_NONFINITE_WEIGHTS=1" in err.render()
    with pytest.warns(
        UserWarning, match=r"NXDI_ALLOW_NONFINITE_WEIGHTS=1: .* accepted.*q_proj\.weight \(1 NaN and 1 inf"
    ):
        scan = weight_io.scan_source(path, plan, allow_nonfinite=True).unwrap()
    assert dict(scan.nonfinite)[Q0].nan == 1


def test_values_a_float16_cast_would_make_inf_are_refused_naming_each_tensor(
    tiny_checkpoint: Callable[..., Path], tiny_model: Any, tmp_path: Path
) -> None:
    """float16's largest finite value is 65504 (65519 still rounds to it): a float32 checkpoint
    holding more loads as a float16 model only by silently turning them into inf, so it is refused,
    from the file and in memory, each tensor named once; bfloat16 (the float32 range) takes it."""
    state = {k: v.detach().clone() for k, v in tiny_model("llama").state_dict().items()}
    q, norm, up = state[Q0].clone(), state[NORM].clone(), state[UP1].clone()
    q[2, 3], norm[5], up[0, 0] = 70000.0, -1.0e6, 65519.0
    changed = {Q0: q, NORM: norm, UP1: up}
    path = _llama_with(tiny_model, tmp_path, **changed)
    spec = _spec(tiny_checkpoint("llama"))
    fp16 = plan_of(spec, torch_dtype="float16")
    for result in (weight_io.get_state_dict(path, fp16), weight_ops.convert(fp16, state | changed)):
        err = result.failure()
        assert [(p.field, p.value) for p in err.problems] == [(Q0, "70000.0"), (NORM, "1000000.0")]
        assert "float16's largest finite value 65504" in err.problems[0].reason
        assert "torch_dtype" in err.problems[1].fix
    from_bf16 = weight_ops.convert(fp16, {k: v.bfloat16() for k, v in (state | changed).items()}).failure()
    # a bfloat16 checkpoint run in float16 too; there 65519 is stored as 65536, past the limit
    assert [p.field for p in from_bf16.problems] == [Q0, UP1, NORM]
    loaded = weight_io.get_state_dict(path, plan_of(spec, torch_dtype="bfloat16")).unwrap()
    assert loaded["norm.weight"][5] == -1.0e6
    # a value that is already inf is the non-finite check's to report, not an overflow
    inf_norm = norm.clone()
    inf_norm[5] = float("inf")
    assert isinstance(weight_ops.convert(fp16, state | {NORM: inf_norm}), Success)

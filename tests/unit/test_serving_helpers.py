"""The helpers a serving client calls: sampling_params tensors, pad/unpad, and LoraCheckpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from nxdi import IncompatibleConfigError, OnDeviceSamplingConfig
from nxdi.shell import causal_lm
from nxdi.shell.lora_serving import LoraCheckpoint, LoraServingConfig
from nxdi.shell.sampling_inputs import infer_sampling_params, prepare_sampling_params, validate_sampling_params
from nxdi.shell.tensor_padding import pad_tensor, pad_with_first_batchline, unpad_tensor

# --- sampling_params ------------------------------------------------------------------------------


def test_prepare_is_the_documented_one_and_broadcasts() -> None:
    assert prepare_sampling_params is causal_lm.prepare_sampling_params
    params = prepare_sampling_params(3, top_k=[5], top_p=[0.5], temperature=[0.7])
    torch.testing.assert_close(params, torch.tensor([[5.0, 0.5, 0.7]] * 3))
    rows = prepare_sampling_params(2, top_k=[1, 50], top_p=[1.0, 0.9], temperature=[1.0, 0.6])
    torch.testing.assert_close(rows, torch.tensor([[1.0, 1.0, 1.0], [50.0, 0.9, 0.6]]))
    with pytest.raises(ValueError, match="top_p"):
        prepare_sampling_params(3, top_k=[1, 2, 3], top_p=[1.0, 0.5], temperature=[1.0])


@pytest.mark.parametrize("config", [OnDeviceSamplingConfig(global_topk=8), {"global_topk": 8}], ids=["object", "dict"])
def test_validate_accepts_every_valid_row(config: object) -> None:
    rows = [[-1, 1.0, 1.0], [0, 0.5, 0.3], [8, 1e-6, 0.0], [1, 1.0, 0.0], [3, 0.99, 2.5]]
    assert validate_sampling_params(torch.tensor(rows), config) is None


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ([9, 1.0, 1.0], "sampling_params[1].top_k"),  # above global_topk=8
        ([-2, 1.0, 1.0], "sampling_params[1].top_k"),
        ([2.5, 1.0, 1.0], "sampling_params[1].top_k"),  # not an integer
        ([1, 0.0, 1.0], "sampling_params[1].top_p"),
        ([1, 1.01, 1.0], "sampling_params[1].top_p"),
        ([1, 1.0, -0.1], "sampling_params[1].temperature"),
        ([1, 1.0, float("nan")], "sampling_params[1].temperature"),
        ([0, 1.0, 0.0], "sampling_params[1]="),  # greedy with the whole vocabulary
        ([-1, 1.0, 0.0], "sampling_params[1]="),
    ],
)
def test_validate_names_the_bad_row_and_field(row: list[float], field: str) -> None:
    params = torch.tensor([[1, 1.0, 1.0], row])
    with pytest.raises(ValueError, match=r"Invalid sampling parameters") as caught:
        validate_sampling_params(params, OnDeviceSamplingConfig(global_topk=8))
    assert isinstance(caught.value, IncompatibleConfigError) and field in str(caught.value)
    assert "sampling_params[0]" not in str(caught.value)  # the good row is not blamed


def test_validate_lists_every_problem_and_defaults_to_256() -> None:
    params = torch.tensor([[300, 0.0, -1.0], [256, 1.0, 1.0]])
    with pytest.raises(IncompatibleConfigError) as caught:
        validate_sampling_params(params, None)
    message = str(caught.value)
    assert "3 problems" in message and "[0, 256]" in message and "sampling_params[1]" not in message
    assert validate_sampling_params(params[1:], {}) is None  # a dict without global_topk: 256


@pytest.mark.parametrize("bad", [torch.ones(3), torch.ones(2, 4), torch.ones(1, 2, 3)])
def test_validate_and_infer_refuse_other_shapes(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"shape \(batch_size, 3\)"):
        validate_sampling_params(bad, None)
    with pytest.raises(ValueError, match=r"shape \(batch_size, 3\)"):
        infer_sampling_params(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_infer_makes_temperature_zero_rows_greedy(dtype: torch.dtype) -> None:
    params = torch.tensor([[-1, 0.5, 0.0], [40, 0.9, 0.7], [0, 0.3, 0.0]], dtype=dtype)
    before = params.clone()
    out = infer_sampling_params(params)
    expected = torch.tensor([[1, 1.0, 0.0], [40, 0.9, 0.7], [1, 1.0, 0.0]], dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(params, before)  # not modified (NxDI writes into it; use the result)


# --- pad / unpad ----------------------------------------------------------------------------------


@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    grow=st.data(),
    pad_value=st.one_of(st.none(), st.integers(-3, 3)),
)
def test_pad_then_unpad_round_trips(shape: list[int], grow: st.DataObject, pad_value: int | None) -> None:
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) - 2
    target = [n + grow.draw(st.integers(-2, 3)) for n in shape]  # some dims smaller: never cut
    target = [max(t, 0) for t in target]
    padded, slices = pad_tensor(x, target, pad_value)
    assert list(padded.shape) == [max(n, t) for n, t in zip(shape, target, strict=True)]
    assert slices == [[0, n] for n in shape]
    assert torch.equal(unpad_tensor(padded, slices), x)
    fill = (x.max().item() if x.numel() else 0) if pad_value is None else pad_value
    mask = torch.ones_like(padded, dtype=torch.bool)
    mask[tuple(slice(0, n) for n in shape)] = False
    assert bool((padded[mask] == fill).all())


def test_pad_values_and_unpad_of_a_result() -> None:
    x = torch.tensor([[1, 7], [3, 4]])
    padded, slices = pad_tensor(x, [3, 3])
    assert torch.equal(padded, torch.tensor([[1, 7, 7], [3, 4, 7], [7, 7, 7]]))  # default: the max
    assert torch.equal(pad_tensor(x, [2, 4], 0)[0], torch.tensor([[1, 7, 0, 0], [3, 4, 0, 0]]))
    assert torch.equal(unpad_tensor(padded * 10, slices), x * 10)


def test_pad_refuses_a_target_of_another_rank() -> None:
    with pytest.raises(ValueError, match=r"target_shape=\[2, 3, 4\].*2 dimensions"):
        pad_tensor(torch.ones(2, 3), [2, 3, 4])
    with pytest.raises(ValueError, match="original_idx_slices"):
        unpad_tensor(torch.ones(2), [[0, 1], [0, 1]])


def test_pad_with_first_batchline() -> None:
    x = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(pad_with_first_batchline(x, [4, 2]), torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2]]))
    with pytest.raises(ValueError, match="target_shape"):
        pad_with_first_batchline(x, [1, 2])


# --- LoraCheckpoint ------------------------------------------------------------------------------

A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _tensors(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {A_KEY: torch.randn(rank, 16, generator=g), B_KEY: torch.randn(16, rank, generator=g)}


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    """A PEFT folder (safetensors + adapter_config.json), an NxD `.pt` file with its lora_config, and
    a `.bin` folder without a config."""
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file(_tensors(0), str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    nxd = tmp_path / "nxd.pt"
    torch.save({"lora_config": {"lora_alpha": 16, "use_rslora": True}, **_tensors(1)}, nxd)
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save(_tensors(2, rank=2), plain / "adapter_model.bin")
    return {"peft": peft, "nxd": nxd, "plain": plain}


def test_lora_checkpoint_lists_and_reads_every_adapter(adapters: dict[str, Path]) -> None:
    config = LoraServingConfig(
        max_loras=2,
        max_cpu_loras=1,
        lora_ckpt_paths={"peft": str(adapters["peft"]), "nxd": str(adapters["nxd"])},
        lora_ckpt_paths_cpu={"cpu0": str(adapters["plain"])},
    )
    ckpt = LoraCheckpoint(config)
    assert ckpt.lora_config is config and ckpt.adapter_ids == (
        "peft",
        "nxd",
        "cpu0",
    )  # device ones first, in the order given
    assert ckpt.ckpt_paths == {"peft": str(adapters["peft"]), "nxd": str(adapters["nxd"])}
    assert ckpt.adapter_path("cpu0") == str(adapters["plain"])
    with pytest.raises(KeyError, match="peft, nxd, cpu0"):
        ckpt.adapter_path("missing")

    peft = ckpt.load_adapter("peft")
    assert peft["lora_scaling"] == (8.0, False) and set(peft["state_dict"]) == {A_KEY, B_KEY}
    torch.testing.assert_close(peft["state_dict"][A_KEY], _tensors(0)[A_KEY])
    nxd = ckpt.load_adapter("nxd")
    assert nxd["lora_scaling"] == (16.0, True) and set(nxd["state_dict"]) == {A_KEY, B_KEY}  # lora_config popped
    assert ckpt.lora_ckpts is None
    ckpt.load()
    assert ckpt.lora_ckpts is not None and sorted(ckpt.lora_ckpts) == ["nxd", "peft"]
    assert ckpt.lora_ckpts_cpu is not None and ckpt.lora_ckpts_cpu["cpu0"]["lora_scaling"] is None
    torch.testing.assert_close(ckpt.lora_ckpts_cpu["cpu0"]["state_dict"][B_KEY], _tensors(2, rank=2)[B_KEY])


def test_lora_scaling_follows_alpha_rank_and_rslora(adapters: dict[str, Path]) -> None:
    ckpt = LoraCheckpoint(
        LoraServingConfig(lora_ckpt_paths={"peft": str(adapters["peft"]), "nxd": str(adapters["nxd"])})
    )
    assert LoraCheckpoint.scaling((8.0, False), 4) == 2.0 and LoraCheckpoint.scaling((16.0, True), 4) == 8.0
    assert LoraCheckpoint.scaling(None, 4) == 1.0 and LoraCheckpoint.scaling((0.0, False), 4) == 1.0
    scaled = ckpt.scaled_state_dict("peft")
    torch.testing.assert_close(scaled[A_KEY], _tensors(0)[A_KEY] * 2.0)
    torch.testing.assert_close(scaled[B_KEY], _tensors(0)[B_KEY])  # only A matrices are scaled
    torch.testing.assert_close(ckpt.scaled_state_dict("nxd")[A_KEY], _tensors(1)[A_KEY] * 8.0)
    assert LoraCheckpoint.is_lora_module("layers.0.q_proj.lora_B") and not LoraCheckpoint.is_lora_module("q_proj")


def test_lora_checkpoint_without_a_config() -> None:
    ckpt = LoraCheckpoint(None)
    assert ckpt.adapter_ids == () and ckpt.load_lora_state_dicts(None) is None
    ckpt.load()
    assert ckpt.lora_ckpts is None and ckpt.lora_ckpts_cpu is None


def test_lora_checkpoint_read_errors_name_the_file(tmp_path: Path) -> None:
    ckpt = LoraCheckpoint(None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_lora_state_dicts({"x": str(tmp_path / "missing")})
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"notes\.txt.*\.safetensors"):
        ckpt.load_lora_state_dicts({"x": str(tmp_path / "notes.txt")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no LoRA adapter checkpoint"):
        ckpt.load_lora_state_dicts({"x": str(tmp_path / "empty")})
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"broken\.safetensors"):
        ckpt.load_lora_state_dicts({"x": str(tmp_path / "broken.safetensors")})
    torch.save({"step": 3, A_KEY: torch.ones(2, 2)}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="not tensors: step"):
        ckpt.load_lora_state_dicts({"x": str(tmp_path / "odd.pt")})

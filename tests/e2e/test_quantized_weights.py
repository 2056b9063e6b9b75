"""Weight quantization end to end: save_quantized_state_dict, then compile/load of the quantized checkpoint.

- The saved checkpoint has the reference's layout (base-model keys without `model.`, `lm_head.*`,
  int8/fp8 values beside a float32 `.scale` of the scheme's shape) and the source checkpoint is
  left byte for byte as it was.
- Not a no-op: the stored values are 1-byte, dequantize to within half a step of the float weight,
  and the model's logits differ from the float model's.
- Accuracy on a briefly trained checkpoint: int8 per-channel greedy tokens (free running) match the
  float model for >= 95% of 64 positions; every other scheme's teacher-forced argmax does; the
  logit error (teacher forcing on the float model's tokens) is reported and bounded.
- The CPU backend runs decode linears of a bf16 int8 model through the int8 kernel, with the
  tokens of the eager (dequantizing) model; tensor parallelism at tp 2 gives tp 1's tokens.
- Bad input: a missing scale, a scale of another quantization_type, a fused Q/K/V half excluded, a
  missing quantized_checkpoints_path, and a target that would overwrite the source are refused,
  naming the tensor or field.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.effects.backends import cpu_passes
from nxdi.shell.exceptions import CheckpointValidationError, IncompatibleConfigError
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES
from nxdi.testing import checkpoints
from nxdi.testing.training import train_briefly
from tests.support.engine_fixtures import load_model, nxdi_generate, teacher_forced

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ((1, 5, 9, 13, 17, 21, 25, 29), (4, 6, 8, 10))
NEW = 64
BLOCKWISE = {"quantization_block_axis": [1], "quantization_block_size": [8]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly trained fp32 llama (greedy tokens follow its training data, so they mean something)."""
    model = checkpoints.build_model("llama", initializer_range=0.02)
    train_briefly(model, steps=150)
    return checkpoints.save_checkpoint(model, tmp_path_factory.mktemp("trained"), checkpoints.SaveFormat.SAFETENSORS)


@pytest.fixture(scope="module")
def float_run(trained: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The float model's greedy tokens [B, NEW] and teacher-forced logits [B, NEW, V]."""
    model = load_model(trained, "llama", batch_size=2, seq_len=96)
    tokens = nxdi_generate(model, PROMPTS, max_new_tokens=NEW)
    return tokens, teacher_forced(model, PROMPTS, tokens[:, :-1])


def _config(path: Path, **neuron: Any) -> Any:
    from nxdi import NeuronConfig, load_pretrained_config

    kwargs = {"torch_dtype": "float32", "batch_size": 2, "seq_len": 96, **neuron}
    return CONFIG_TYPES["llama"](NeuronConfig(**kwargs), load_config=load_pretrained_config(path))


def _save(path: Path, out: Path, **quant: Any) -> Path:
    config = _config(path, quantized=True, quantized_checkpoints_path=str(out), **quant)
    MODEL_TYPES["llama"]["causal-lm"].save_quantized_state_dict(path, config)
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    ("quant", "dtype", "scale_shape"),
    [
        ({"quantization_type": "per_channel_symmetric"}, torch.int8, lambda w: (w[0], 1)),
        ({"quantization_type": "per_tensor_symmetric"}, torch.int8, lambda w: (1,)),
        ({"quantization_type": "blockwise_symmetric", **BLOCKWISE}, torch.int8, lambda w: (w[0], w[1] // 8)),
        ({"quantization_dtype": "f8e4m3", "quantization_type": "per_channel_symmetric"}, torch.float8_e4m3fn, None),
    ],
)
def test_saved_layout_is_the_references_and_the_source_is_untouched(
    trained: Path, tmp_path: Path, quant: dict[str, Any], dtype: torch.dtype, scale_shape: Any
) -> None:
    before = _digest(trained)
    out = tmp_path / "q"
    out.mkdir()
    _save(trained, out, **quant)
    assert _digest(trained) == before
    saved, source = load_file(out / "model.safetensors"), load_file(trained / "model.safetensors")
    assert not any(k.startswith("model.") for k in saved)
    assert saved["embed_tokens.weight"].dtype == torch.float32 and "norm.weight" in saved
    for key in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "lm_head.weight"):
        values, scale = saved[key], saved[key.removesuffix("weight") + "scale"]
        assert values.dtype == dtype and scale.dtype == torch.float32
        if scale_shape is not None:
            assert tuple(scale.shape) == scale_shape(values.shape)
        w = source.get("model." + key, source.get(key))
        assert w is not None
        assert not torch.equal(values.float(), w)  # really quantized (stored bytes differ)
        if dtype == torch.int8:  # dequantized values lie within half a quantization step
            groups = [n // s for n, s in zip(values.shape, scale.shape, strict=True)] if scale.dim() == 2 else None
            step = scale.repeat_interleave(groups[0], 0).repeat_interleave(groups[1], 1) if groups else scale
            assert ((values.float() * step - w).abs() <= step / 2 + 1e-6).all()


def test_int8_per_channel_accuracy(trained: Path, tmp_path: Path, float_run: tuple[torch.Tensor, torch.Tensor]) -> None:
    """>= 95% of 64 greedy positions equal the float model's (both prompts); the logit error is
    reported, and is not zero (quantization took effect)."""
    out = tmp_path / "q"
    out.mkdir()
    quant = {"quantization_type": "per_channel_symmetric"}
    _save(trained, out, **quant)
    model = load_model(
        trained, "llama", batch_size=2, seq_len=96, quantized=True, quantized_checkpoints_path=str(out), **quant
    )
    tokens, logits = float_run
    got = nxdi_generate(model, PROMPTS, max_new_tokens=NEW)
    match = (got == tokens).float().mean().item()
    error = max_relative_logit_error(logits, teacher_forced(model, PROMPTS, tokens[:, :-1]))
    print(f"int8 per-channel: {match:.1%} of greedy tokens equal, max relative logit error {error:.4f}")
    assert match >= 0.95, f"only {match:.1%} of greedy tokens match (logit error {error:.4f})"
    assert 0 < error < 0.05, f"max relative logit error {error}"


@pytest.mark.parametrize(
    "quant",
    [
        {"quantization_type": "per_tensor_symmetric"},
        {"quantization_type": "blockwise_symmetric", **BLOCKWISE},
        {"quantization_type": "per_channel_symmetric", "quantization_dtype": "f8e4m3"},
        {"quantization_type": "per_channel_symmetric", "quantization_scale_dtype": "bf16"},
    ],
    ids=["per-tensor", "blockwise", "f8e4m3", "bf16-scales"],
)
def test_other_schemes_run_and_stay_close(
    trained: Path, tmp_path: Path, float_run: tuple[torch.Tensor, torch.Tensor], quant: dict[str, Any]
) -> None:
    out = tmp_path / "q"
    out.mkdir()
    _save(trained, out, **quant)
    model = load_model(
        trained, "llama", batch_size=2, seq_len=96, quantized=True, quantized_checkpoints_path=str(out), **quant
    )
    tokens, logits = float_run
    forced = teacher_forced(model, PROMPTS, tokens[:, :-1])
    error = max_relative_logit_error(logits, forced)
    # Position by position on the float model's tokens: one near-tie flipped early would otherwise
    # make every later free-running token differ.
    match = (forced.argmax(-1) == tokens).float().mean().item()
    print(f"{quant}: {match:.1%} of teacher-forced greedy tokens equal, max relative logit error {error:.4f}")
    assert 0 < error < 0.05 and match >= 0.95, (match, error)


def test_pickle_file_and_modules_to_not_convert(trained: Path, tmp_path: Path) -> None:
    """A quantized_checkpoints_path that is no folder gets a torch pickle file (the reference's
    choice); modules_to_not_convert keeps lm_head and layer 0's MLP in float, and the model runs."""
    out = tmp_path / "llama-quantized.pt"
    quant = {"quantization_type": "per_channel_symmetric", "modules_to_not_convert": ["lm_head", "layers.0.mlp"]}
    _save(trained, out, **quant)
    saved = torch.load(out, weights_only=True)
    assert saved["lm_head.weight"].dtype == torch.float32 and "lm_head.scale" not in saved
    assert saved["layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert saved["layers.1.mlp.up_proj.weight"].dtype == torch.int8
    model = load_model(
        trained, "llama", batch_size=2, seq_len=96, quantized=True, quantized_checkpoints_path=str(out), **quant
    )
    assert nxdi_generate(model, PROMPTS, max_new_tokens=8).shape == (2, 8)


def test_tied_model_reads_its_quantized_lm_head(tmp_path: Path) -> None:
    """With tied embeddings the reference saves the lm_head module's weight; quantized, it is read
    as its own int8 weight (no longer the embedding)."""
    path, _ = checkpoints.build_checkpoint(tmp_path / "ck", "llama3-tied", checkpoints.SaveFormat.SAFETENSORS)
    out = tmp_path / "q"
    out.mkdir()
    _save(path, out, quantization_type="per_channel_symmetric")
    saved = load_file(out / "model.safetensors")
    assert saved["lm_head.weight"].dtype == torch.int8
    model = load_model(
        path, "llama3-tied", batch_size=2, quantized=True, quantized_checkpoints_path=str(out),
        quantization_type="per_channel_symmetric",
    )  # fmt: skip
    float_tokens = nxdi_generate(load_model(path, "llama3-tied", batch_size=2), PROMPTS, max_new_tokens=8)
    assert nxdi_generate(model, PROMPTS, max_new_tokens=8).shape == float_tokens.shape


@pytest.mark.parametrize(
    "scheme",
    [
        {"quantization_type": "per_channel_symmetric"},
        {"quantization_type": "per_channel_symmetric", "quantization_dtype": "f8e4m3"},
        {"quantization_type": "blockwise_symmetric", "quantization_block_axis": [1], "quantization_block_size": [32]},
    ],
    ids=["int8", "f8e4m3", "int8-blockwise-32"],
)
def test_bf16_compiled_decode_uses_nxdis_quantized_kernels(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: dict[str, Any]
) -> None:
    out = tmp_path / "q"
    out.mkdir()
    quant = {**scheme, "torch_dtype": "bfloat16"}
    _save(trained, out, **quant)
    kw = {"batch_size": 2, "seq_len": 96, "quantized": True, "quantized_checkpoints_path": str(out), **quant}
    eager = nxdi_generate(load_model(trained, "llama", **kw), PROMPTS, max_new_tokens=32)
    rewrites: list[int] = []
    original = cpu_passes.quantized_weight_linears
    monkeypatch.setattr(
        cpu_passes, "quantized_weight_linears", lambda *a: rewrites.append(original(*a)) or rewrites[-1]
    )
    compiled = load_model(trained, "llama", workdir=tmp_path, backend="cpu", **kw)
    # 2 layers x (qkv, o, gate, up, down) + lm_head in each decode program; the prompt's lm_head row.
    assert max(rewrites) == 11
    assert torch.equal(nxdi_generate(compiled, PROMPTS, max_new_tokens=32), eager)


@pytest.mark.parametrize(
    "quant",
    [{"quantization_type": "per_tensor_symmetric"}, {"quantization_type": "blockwise_symmetric", **BLOCKWISE}],
    ids=["per-tensor", "blockwise"],
)
def test_tensor_parallel_gives_tp1_tokens(trained: Path, tmp_path: Path, quant: dict[str, Any]) -> None:
    """Each rank reads the scales of its own rows (per tensor: the repeated one) or, blockwise, of
    its own blocks (o_proj and down_proj split along their input columns, in blocks of 8)."""
    out = tmp_path / "q"
    out.mkdir()
    _save(trained, out, **quant)
    kw = {"batch_size": 2, "seq_len": 96, "quantized": True, "quantized_checkpoints_path": str(out), **quant}
    one = nxdi_generate(load_model(trained, "llama", **kw), PROMPTS, max_new_tokens=16)
    model = load_model(trained, "llama", tp_degree=2, **kw)
    try:
        assert torch.equal(nxdi_generate(model, PROMPTS, max_new_tokens=16), one)
    finally:
        model.close()


# --- bad input ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def per_channel(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("per-channel")
    return _save(trained, out, quantization_type="per_channel_symmetric")


def _edited(per_channel: Path, tmp_path: Path, edit: Any) -> Path:
    tensors = load_file(per_channel / "model.safetensors")
    edit(tensors)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    return out


def _load_quantized(trained: Path, out: Path, **quant: Any) -> Any:
    kw = {"quantization_type": "per_channel_symmetric", **quant}
    return load_model(trained, "llama", batch_size=2, quantized=True, quantized_checkpoints_path=str(out), **kw)


def test_missing_scale_is_named(trained: Path, per_channel: Path, tmp_path: Path) -> None:
    out = _edited(per_channel, tmp_path, lambda t: t.pop("layers.1.mlp.up_proj.scale"))
    with pytest.raises(CheckpointValidationError, match=r"layers\.1\.mlp\.up_proj\.scale") as e:
        _load_quantized(trained, out)
    assert "every quantized weight needs its scale" in str(e.value)


def test_other_quantization_type_is_named(trained: Path, per_channel: Path) -> None:
    with pytest.raises(CheckpointValidationError, match="implies quantization_type='per_channel_symmetric'") as e:
        _load_quantized(trained, per_channel, quantization_type="per_tensor_symmetric")
    assert "layers.0.self_attn.q_proj.scale" in str(e.value)


def test_wrong_values_dtype_is_named(trained: Path, per_channel: Path) -> None:
    with pytest.raises(
        CheckpointValidationError, match=r"layers\.0\.mlp\.gate_proj\.weight.*f8e4m3|int8.*quantization_dtype"
    ):
        _load_quantized(trained, per_channel, quantization_dtype="f8e4m3")


def test_half_excluded_fused_qkv_is_refused(trained: Path, per_channel: Path) -> None:
    with pytest.raises(IncompatibleConfigError, match=r"modules_to_not_convert.*fuses"):
        _load_quantized(trained, per_channel, modules_to_not_convert=["layers.0.self_attn.q_proj"])


def test_a_rank_cutting_scale_blocks_is_refused(trained: Path, tmp_path: Path) -> None:
    """Blocks of 64 input columns tile every linear; o_proj's 64 split over 2 ranks give each half a block."""
    out = tmp_path / "q"
    out.mkdir()
    quant = {
        "quantization_type": "blockwise_symmetric",
        "quantization_block_axis": [1],
        "quantization_block_size": [64],
    }
    _save(trained, out, **quant)
    with pytest.raises(IncompatibleConfigError, match=r"quantization_block_size.*cuts blocks of layers\.0\."):
        load_model(trained, "llama", tp_degree=2, quantized=True, quantized_checkpoints_path=str(out), **quant)


def test_missing_quantized_checkpoint_names_the_field(trained: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"quantized_checkpoints_path.*save_quantized_state_dict"):
        _load_quantized(trained, tmp_path / "nowhere")


def test_saving_over_the_source_is_refused(trained: Path) -> None:
    before = _digest(trained)
    with pytest.raises(IncompatibleConfigError, match=r"quantized_checkpoints_path.*would overwrite"):
        _save(trained, trained / "model.safetensors", quantization_type="per_channel_symmetric")
    assert _digest(trained) == before


def test_safetensors_header_of_saved_file_is_readable(per_channel: Path) -> None:
    with safe_open(per_channel / "model.safetensors", framework="pt") as f:
        assert "layers.0.self_attn.q_proj.scale" in set(f.keys())


DOCUMENTED_EXAMPLE = """
from neuronx_distributed_inference.models.config import NeuronConfig
from neuronx_distributed_inference.models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM
)
from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

model_path = "{model_path}"
quantized_model_path = "{quantized_model_path}"

neuron_config = NeuronConfig(
    quantized=True,
    quantized_checkpoints_path=quantized_model_path,
    quantization_dtype="int8",
    quantization_type="per_tensor_symmetric"
)

config = LlamaInferenceConfig(
    neuron_config,
    load_config=load_pretrained_config(model_path)
)

# Quantize the model and save it to `quantized_checkpoints_path`.
NeuronLlamaForCausalLM.save_quantized_state_dict(model_path, config)

# Compile, load, and use the model.
model = NeuronLlamaForCausalLM(model_path, config)
"""
"""The feature guide's "Model Weight Quantization" example, verbatim but for the two paths."""


def test_the_feature_guides_example_runs_as_written(trained: Path, tmp_path: Path, compat_package: Path) -> None:
    quantized = tmp_path / "Llama-quantized"  # not a folder: the reference writes a pickle file there
    scope: dict[str, Any] = {}
    exec(DOCUMENTED_EXAMPLE.format(model_path=trained, quantized_model_path=quantized), scope)
    model = scope["model"]
    model.compile(tmp_path / "compiled")
    model.load(tmp_path / "compiled")
    assert (
        quantized.is_file()
        and torch.load(quantized, weights_only=True)["layers.0.mlp.up_proj.weight"].dtype == torch.int8
    )
    assert nxdi_generate(model, PROMPTS[:1], max_new_tokens=8).shape == (1, 8)

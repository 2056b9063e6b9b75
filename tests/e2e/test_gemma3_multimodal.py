"""A multimodal Gemma 3 checkpoint (transformers' Gemma3ForConditionalGeneration) runs its language
model through the documented API, text in and text out.

The checkpoint is a tiny random one with a tiny SigLIP vision tower, saved by transformers'
save_pretrained (keys `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) or
under transformers' module names (`model.language_model.*`, `lm_head.weight`). The model built with
`Gemma3InferenceConfig(load_config=load_pretrained_config(path))` and `NeuronGemma3ForCausalLM`
gives transformers' text-only logits (fp32, within 1e-4 of the largest) and greedy tokens, eagerly
and through compile() + load(); the vision weights are skipped, while a missing, misshapen or
unexpected language-model weight is named; image inputs and language-model attributes set where
nothing reads them are refused; a quantized checkpoint is saved in the text model's layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import nxdi
from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.shell import models
from nxdi.shell.exceptions import CheckpointValidationError, IncompatibleConfigError, MissingAttributesError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.testing import checkpoints
from nxdi.testing.strategies.decoders import plan_of
from tests.support.engine_fixtures import hf_generate, nxdi_generate, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ((1, 5, 7, 9, 11, 3, 4, 5, 6, 7, 8, 9), (3, 4))
"""The first is longer than the tiny text model's window of 5."""
NEW_TOKENS = 8
VISION = ("vision_tower.", "multi_modal_projector.")


def _config(path: Path, **neuron: Any) -> Any:
    kwargs = {"torch_dtype": "float32", "seq_len": 64, "batch_size": 2, **neuron}
    return nxdi.Gemma3InferenceConfig(nxdi.NeuronConfig(**kwargs), load_config=nxdi.load_pretrained_config(path))


def _model(path: Path, **neuron: Any) -> Any:
    """The documented construction, run eagerly (`to_cpu()`)."""
    model = nxdi.MODEL_TYPES["gemma3"]["causal-lm"](path, _config(path, **neuron))
    model.to_cpu()
    return model


def _keys(path: Path) -> set[str]:
    return {k for f in path.glob("*.safetensors") for k in safetensors.torch.load_file(f)}


@pytest.fixture(scope="module")
def hf() -> Any:
    return checkpoints.build_gemma3_multimodal(seed=0)


@pytest.fixture(scope="module")
def saved(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoints.save_checkpoint(hf, tmp_path_factory.mktemp("gemma3-mm"), checkpoints.SaveFormat.SAFETENSORS)


def _hf_logits(hf: Any, sequence: list[int]) -> torch.Tensor:
    """transformers' text-only logits [n, V] (no pixel values) of one sequence."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([sequence])).logits[0].float()


def _check_logits(model: Any, hf: Any) -> None:
    """The prefill of the left-padded PROMPTS and three greedy decode steps after it, each row
    within 1e-4 (of the largest logit) of transformers' logits of the same sequence."""
    ids, mask = padded(PROMPTS, "left")
    model.reset()
    out = model(ids, attention_mask=mask)
    sequences = [list(p) for p in PROMPTS]
    for step in range(4):
        for row, seq in enumerate(sequences):
            expected = _hf_logits(hf, seq)[-1]
            err = (out.logits[row, 0] - expected).abs().max().item()
            assert err <= 1e-4 * expected.abs().max().item(), (step, row, err)
        nxt = out.logits[:, 0].argmax(-1)
        positions = torch.tensor([[len(s)] for s in sequences])
        for seq, t in zip(sequences, nxt.tolist(), strict=True):
            seq.append(t)
        out = model(nxt[:, None], position_ids=positions)


def test_save_pretrained_writes_the_legacy_layout_beside_the_vision_tower(saved: Path) -> None:
    keys = _keys(saved)
    assert "language_model.model.embed_tokens.weight" in keys and "language_model.model.norm.weight" in keys
    assert any(k.startswith(VISION[0]) for k in keys) and any(k.startswith(VISION[1]) for k in keys)
    assert not any("lm_head" in k for k in keys)  # tied
    assert json.loads((saved / "config.json").read_text())["model_type"] == "gemma3"


def test_logits_and_greedy_tokens_match_transformers_text_only_generation(hf: Any, saved: Path) -> None:
    model = _model(saved, output_logits=True)
    assert model.config.model_spec().model_type == "gemma3"
    _check_logits(model, hf)
    ours = nxdi_generate(model, PROMPTS, side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS))


def test_compile_then_load_generates_like_transformers(hf: Any, tmp_path: Path) -> None:
    """A sharded checkpoint, compiled, then loaded from the compiled folder alone (the config read
    back from neuron_config.json, its text_config included)."""
    path = checkpoints.save_checkpoint(hf, tmp_path / "ck", checkpoints.SaveFormat.SAFETENSORS_SHARDED)
    nxdi.NeuronGemma3ForCausalLM(path, _config(path)).compile(tmp_path / "compiled")
    model = nxdi.NeuronGemma3ForCausalLM(tmp_path / "compiled")
    model.load(tmp_path / "compiled")
    assert model.config.get_text_config().vocab_size == hf.config.text_config.vocab_size
    ours = nxdi_generate(model, PROMPTS, side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS))


def test_transformers_module_names_and_an_untied_lm_head_are_read(tmp_path: Path) -> None:
    """The layout of transformers' modules (`model.language_model.*`, `model.vision_tower.*`,
    `lm_head.weight`), with an lm_head of its own."""
    hf = checkpoints.build_gemma3_multimodal(seed=1, tie_word_embeddings=False)
    state = hf.state_dict()
    assert "lm_head.weight" in state and any(k.startswith("model.language_model.") for k in state)
    hf.config.save_pretrained(tmp_path)
    checkpoints.write_checkpoint_file(tmp_path / "model.safetensors", state)
    model = _model(tmp_path, output_logits=True)
    assert not model.config.model_spec().tie_word_embeddings
    _check_logits(model, hf)


def test_a_bad_or_missing_text_weight_is_named_and_the_vision_tower_is_not(saved: Path, tmp_path: Path) -> None:
    state = safetensors.torch.load_file(saved / "model.safetensors")
    del state["language_model.model.layers.1.self_attn.k_proj.weight"]
    state["language_model.model.norm.weight"] = torch.zeros(3)
    state["language_model.model.layers.2.mlp.up_proj.weight"] = torch.zeros(2, 2)
    state["image_newline"] = torch.zeros(4)
    shutil.copy(saved / "config.json", tmp_path / "config.json")
    checkpoints.write_checkpoint_file(tmp_path / "model.safetensors", state)
    with pytest.raises(CheckpointValidationError) as info:
        nxdi.NeuronGemma3ForCausalLM.get_state_dict(tmp_path, _config(tmp_path))
    message = str(info.value)
    for key in (
        "language_model.model.layers.1.self_attn.k_proj.weight: is required but missing",
        "language_model.model.norm.weight=(3,): has shape (3,), expected (64,)",
        "language_model.model.layers.2.mlp.up_proj.weight=(2, 2): is not a weight of this model",
        "image_newline=(4,): is not a weight of this model",
    ):
        assert key in message
    assert "vision_tower" not in message and "multi_modal_projector" not in message
    assert message.count("\n  - ") == 4


def test_missing_keys_are_named_in_the_layout_the_checkpoint_has() -> None:
    """Module names in, module names out: a missing layer weight and an untied lm_head are named
    as this checkpoint would hold them."""
    untied = checkpoints.build_gemma3_multimodal(seed=1, tie_word_embeddings=False)
    spec = families.parse_model_spec(untied.config.to_dict()).unwrap()
    shapes = {k: tuple(v.shape) for k, v in untied.state_dict().items()}
    del shapes["model.language_model.layers.0.mlp.down_proj.weight"], shapes["lm_head.weight"]
    error = weights.check_checkpoint(plan_of(spec), shapes).failure()
    assert error.fields() == {"model.language_model.layers.0.mlp.down_proj.weight", "lm_head.weight"}


def test_image_inputs_are_refused(saved: Path) -> None:
    model = _model(saved)
    ids = torch.tensor([[1, 5, 7]])
    pixels = torch.zeros(1, 3, 28, 28)
    with pytest.raises(TypeError, match=r"pixel_values .*language model only"):
        model(ids, pixel_values=pixels)
    with pytest.raises(ValueError, match="pixel_values"):
        HuggingFaceGenerationAdapter(model).generate(ids, pixel_values=pixels, max_new_tokens=2, do_sample=False)


def test_language_model_attributes_are_read_under_text_config_only(saved: Path) -> None:
    """A top-level override would be read by nothing (transformers reads text_config too): refused."""
    with pytest.raises(IncompatibleConfigError, match="num_hidden_layers=1: is a language-model attribute") as info:
        nxdi.Gemma3InferenceConfig(
            nxdi.NeuronConfig(seq_len=32), load_config=nxdi.load_pretrained_config(saved), num_hidden_layers=1
        )
    assert "set text_config.num_hidden_layers instead" in str(info.value)

    def without_head_dim(config: Any) -> None:
        nxdi.load_pretrained_config(saved)(config)
        del config.text_config.head_dim

    with pytest.raises(MissingAttributesError, match=r"\['text_config.head_dim'\]"):
        nxdi.Gemma3InferenceConfig(nxdi.NeuronConfig(seq_len=32), load_config=without_head_dim)


def test_a_quantized_checkpoint_is_saved_in_the_text_models_layout(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    out.mkdir()
    quant = {"quantized": True, "quantized_checkpoints_path": str(out), "quantization_type": "per_channel_symmetric"}
    nxdi.NeuronGemma3ForCausalLM.save_quantized_state_dict(saved, _config(saved, **quant))
    keys = _keys(out)
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.q_proj.scale"} <= keys
    assert not any(k.startswith(("language_model.", "model.", *VISION)) for k in keys)
    model = _model(saved, **quant)
    assert nxdi_generate(model, PROMPTS, side="left", max_new_tokens=NEW_TOKENS).shape == (2, NEW_TOKENS)


def test_the_text_only_and_multimodal_classes_are_one() -> None:
    assert nxdi.MODEL_TYPES["gemma3"]["causal-lm"] is nxdi.MODEL_TYPES["gemma3_text"]["causal-lm"]
    assert models.CONFIG_TYPES["gemma3"] is nxdi.Gemma3InferenceConfig

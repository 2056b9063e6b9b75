"""Tiny random Hugging Face checkpoints, saved in each format nxdi reads. Effects: writes model directories.

For tests and examples that need a real checkpoint without a model hub:

    model = build_model("mistral", seed=0)            # a transformers model, random weights, eval mode
    path = save_checkpoint(model, tmp / "mistral", SaveFormat.BIN_SHARDED)

`VARIANTS` names small configurations that between them cover what the CPU programs implement:
one per runnable family (its record's `tiny_config`, which picks the features that family adds:
GQA, sliding windows shorter than the test sequences, per-layer windows and RoPEs, q/k/v biases,
q/k norms, an explicit head_dim), plus Gemma 3 with soft-capped logits and Llama-3 RoPE scaling
with tied embeddings. Weights are drawn with a private seeded generator state, so the caller's
global RNG is left as it was.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers

from nxdi.core import families
from nxdi.core.families import gemma3, gpt_neox, opt
from nxdi.effects import checkpoint


class SaveFormat(enum.Enum):
    """The four layouts of a Hugging Face checkpoint directory."""

    SAFETENSORS = "safetensors"
    SAFETENSORS_SHARDED = "safetensors-sharded"
    BIN = "bin"
    BIN_SHARDED = "bin-sharded"


_BASE: Mapping[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 160,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TEST_VARIANTS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "opt-post-ln": ("opt", {**opt.RECORD.tiny_config, "do_layer_norm_before": False}),
    "gpt_neox-sequential": ("gpt_neox", {**gpt_neox.RECORD.tiny_config, "use_parallel_residual": False}),
    "gemma3-softcap": ("gemma3_text", {**gemma3.RECORD.tiny_config, "final_logit_softcapping": 3.0}),
    "llama3-tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}
"""Variants beyond the families' own tiny configs: OPT's post-norm layers (`do_layer_norm_before`
false), GPT-NeoX's sequential residual, Gemma 3 with soft-capped logits (a cap the tiny model's
logits exceed; real Gemma 3 configs have none), Llama-3 RoPE scaling with tied embeddings."""

VARIANTS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    **{r.name: (r.model_type, r.tiny_config) for r in families.runnable()},
    **TEST_VARIANTS,
}
"""Variant name -> (model_type, config overrides on top of the tiny base): every runnable family's
record (`FamilyRecord.tiny_config`), then `TEST_VARIANTS`."""


def tiny_config(variant: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The transformers config of a variant in `VARIANTS` (or a bare model_type), with overrides."""
    model_type, extra = VARIANTS.get(variant, (variant, {}))
    config: transformers.PretrainedConfig = transformers.AutoConfig.for_model(
        model_type, **{**_BASE, **extra, **overrides}
    )
    return config


def build_model(variant: str, *, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A transformers causal LM of `variant` with random fp32 weights drawn from `seed`, in eval mode.

    Norm weights transformers starts at zero (Gemma's, which scale by `1 + w`) are drawn at random
    too: all zero, two swapped norms or a norm scaled by `w` for `1 + w` would look alike."""
    config = tiny_config(variant, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(config)
        _draw_zero_norms(model)
    return model.eval()


def _draw_zero_norms(model: transformers.PreTrainedModel) -> None:
    """Norm weights left at zero drawn from the global RNG (the caller forks and seeds it)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and not p.any():
                p.copy_(torch.randn(p.shape) * 0.5)


TINY_VISION: Mapping[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
"""A SigLIP vision tower of 2 x 2 patches, for tiny multimodal Gemma 3 checkpoints."""


def build_gemma3_multimodal(*, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A multimodal Gemma 3 (transformers' Gemma3ForConditionalGeneration) with random fp32 weights
    drawn from `seed`, in eval mode: the `gemma3` variant's text model (with `overrides`) as its
    language model, `TINY_VISION` as its vision tower, one image as 4 tokens. Its lm_head is tied
    as the text model's is (the outer config's `tie_word_embeddings` is the one transformers
    obeys); its zero-initialised norms are drawn as `build_model` draws them."""
    text = tiny_config("gemma3", **overrides).to_dict()
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(TINY_VISION),
        mm_tokens_per_image=4,
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Gemma3ForConditionalGeneration(config)
        _draw_zero_norms(model)
    return model.eval()


def _checkpoint_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors as Hugging Face saves them (tied `lm_head.weight` left out; mixture-of-experts
    weights per expert, as the hub stores them, where the module holds them fused): what
    `save_pretrained` writes, read back."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {
            k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in safetensors.torch.load_file(f).items()
        }


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    return shards


def _save_bin(tensors: Mapping[str, torch.Tensor], directory: Path, *, max_bytes: int | None) -> None:
    """`pytorch_model.bin`, or `pytorch_model-0000i-of-0000n.bin` shards plus their index."""
    if max_bytes is None:
        torch.save(dict(tensors), directory / "pytorch_model.bin")
        return
    shards = _shards(tensors, max_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, directory / name)
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save_checkpoint(
    model: transformers.PreTrainedModel,
    directory: str | os.PathLike[str],
    fmt: SaveFormat,
    *,
    shard_bytes: int = 20_000,
) -> Path:
    """Save `model` (config.json + weights) into `directory` in `fmt`; returns the directory.

    Safetensors layouts use transformers' own `save_pretrained` (sharded with `max_shard_size`);
    the `.bin` layouts, which current transformers no longer writes, are written with `torch.save`
    in the Hugging Face file names and index format. Sharded layouts split every `shard_bytes`.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if fmt is SaveFormat.SAFETENSORS:
        model.save_pretrained(path)
    elif fmt is SaveFormat.SAFETENSORS_SHARDED:
        model.save_pretrained(path, max_shard_size=shard_bytes)
    else:
        model.config.save_pretrained(path)
        sharded = fmt is SaveFormat.BIN_SHARDED
        _save_bin(_checkpoint_tensors(model), path, max_bytes=shard_bytes if sharded else None)
    return path


def build_checkpoint(
    directory: str | os.PathLike[str], variant: str, fmt: SaveFormat, *, seed: int = 0, **overrides: Any
) -> tuple[Path, transformers.PreTrainedModel]:
    """`build_model` then `save_checkpoint`: the directory and the in-memory reference model."""
    model = build_model(variant, seed=seed, **overrides)
    return save_checkpoint(model, directory, fmt), model


def write_checkpoint_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write raw tensors as one safetensors file (atomically), for hand-made test checkpoints."""
    return checkpoint.write_safetensors(path, tensors, metadata={"format": "pt"})

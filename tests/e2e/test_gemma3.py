"""Gemma 3's parts of the decoder against transformers, one at a time.

The family-parametrized tests (test_families, test_programs_vs_hf, test_tensor_parallel) compare
whole Gemma 3 models; these show that each Gemma field of the spec is needed for that agreement
(without it, the tiny model's logits leave transformers' by far more than the tolerance: the
sliding window is exactly `sliding_window` positions, query included, not one more or less), that
the final logits are soft-capped, and that the norm and embedding scale round as transformers does
in bf16 and fp16. (A multimodal `gemma3` checkpoint's language model: test_gemma3_multimodal.py.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from transformers.models.gemma3 import modeling_gemma3

from nxdi.core import families
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import decoder, inputs, kv_cache, layers
from nxdi.effects import weight_loader as weight_io
from nxdi.testing.checkpoints import build_model
from nxdi.testing.strategies.decoders import plan_of, program_of

PROMPT = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
"""Longer than the tiny config's window of 5, so its sliding layer drops positions."""
BUCKET = 16
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _model(
    variant: str, checkpoint: Callable[..., Path], hf: Callable[[str], Any]
) -> tuple[ModelSpec, Any, torch.Tensor]:
    """The spec of `variant`, its program's weights and transformers' logits of PROMPT [n, V]."""
    path = checkpoint(variant)
    spec = families.parse_model_spec(json.loads((path / "config.json").read_text())).unwrap()
    weights = program_of(spec).weights(weight_io.get_state_dict(path, plan_of(spec)).unwrap(), spec=spec)
    with torch.no_grad():
        expected = hf(variant)(torch.tensor([PROMPT])).logits[0]
    return spec, weights, expected


@pytest.fixture(scope="module")
def gemma(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> tuple[ModelSpec, Any, torch.Tensor]:
    return _model("gemma3", tiny_checkpoint, tiny_model)


def _logits(spec: ModelSpec, weights: Any) -> torch.Tensor:
    """Logits [n, V] of every token of PROMPT."""
    cache = kv_cache.empty_cache(spec, batch=1, length=BUCKET, dtype=torch.float32)
    x = inputs.prompt_inputs([PROMPT], length=BUCKET)
    logits, _ = program_of(spec).forward(weights, cache, x, spec=spec, all_logits=True)
    return logits[0, : len(PROMPT)]


def test_the_final_logits_are_soft_capped(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    spec, weights, expected = _model("gemma3-softcap", tiny_checkpoint, tiny_model)
    assert spec.final_logit_softcap == 3.0
    logits = _logits(spec, weights)
    assert _relative_error(logits, expected) <= 1e-4 and logits.abs().max() < spec.final_logit_softcap
    uncapped = _logits(attrs.evolve(spec, final_logit_softcap=None), weights)
    assert uncapped.abs().max() > spec.final_logit_softcap  # the cap bites on this model
    assert _relative_error(uncapped, expected) > 1e-2


WITHOUT = {
    "a window one longer": {"sliding_window": 6},
    "a window one shorter": {"sliding_window": 4},
    "the local RoPE": {"local_rope": None},
    "query_pre_attn_scalar": {"attention_scale": None},
    "the embedding scale": {"embed_scale": None},
    "the 1 + w norms": {"norm_offset": False},
    "the sandwich norms": {"sandwich_norms": False},
}


@pytest.mark.parametrize("change", list(WITHOUT.values()), ids=list(WITHOUT))
def test_each_gemma_field_is_needed_to_match_transformers(
    change: dict[str, Any], gemma: tuple[ModelSpec, Any, torch.Tensor]
) -> None:
    spec, weights, expected = gemma
    assert _relative_error(_logits(spec, weights), expected) <= 1e-4
    assert _relative_error(_logits(attrs.evolve(spec, **change), weights), expected) > 1e-2


def test_transformers_gemma3_does_not_apply_attn_logit_softcapping() -> None:
    """Why nxdi reads `attn_logit_softcapping` and ignores it: transformers does (Gemma 3 has q/k norm
    instead). Should a later transformers apply it, this fails, and nxdi must follow."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        plain = build_model("gemma3")(ids).logits
        capped = build_model("gemma3", attn_logit_softcapping=0.5)(ids).logits
    assert torch.equal(plain, capped)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_offset_norm_is_transformers_gemma3_rmsnorm_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype)
    norm = modeling_gemma3.Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        expected = norm(x)
    assert torch.equal(layers.rms_norm(x, norm.weight.detach(), 1e-6, offset=True), expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_embedding_scale_rounds_to_the_embedding_dtype_as_transformers_does(dtype: torch.dtype) -> None:
    """sqrt(3072) = 55.43 is 55.5 in bf16: the embeddings are scaled by the rounded value."""
    table = modeling_gemma3.Gemma3TextScaledWordEmbedding(16, 3072, 0, embed_scale=3072**0.5).to(dtype)
    ids = torch.arange(16)
    with torch.no_grad():
        expected = table(ids)
    sizes = {"hidden_size": 3072, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 8}
    spec = families.parse_model_spec({"model_type": "gemma3_text", "vocab_size": 16, **sizes}).unwrap()
    assert spec.embed_scale == 3072**0.5
    assert torch.equal(decoder._scaled_embeddings(table.weight.detach()[ids], spec), expected)

"""The CPU programs against Hugging Face transformers on the same tiny random checkpoints.

Accuracy contract: fp32 logits within 1e-4 of the largest |logit| (NxDI's max-scaled closeness),
and greedy decoding token for token. Our side runs right-padded batches through the programs with
bucketed cache views; the Hugging Face side runs each prompt alone (unpadded) and, for generation,
also as a left-padded batch, so neither padding scheme is trusted blindly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.core import families
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import catalog, inputs, kv_cache, sampling
from nxdi.effects import weight_loader as weight_io
from nxdi.testing.checkpoints import VARIANTS, SaveFormat
from nxdi.testing.strategies.decoders import plan_of, program_of

PROMPTS = [[1, 5, 7, 9, 11, 3, 4, 5, 6, 7], [3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [9, 8]]
NEW_TOKENS = 32
CONTEXT_BUCKET = 16
TOKEN_BUCKETS = (32, 64)


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max |diff| {err} vs max |logit| {expected.abs().max().item()}"


def _program(path: Path, *, torch_dtype: str = "float32") -> tuple[ModelSpec, catalog.Program, Any]:
    """The spec, program and weights of the checkpoint at `path`, read through its family's weight plan."""
    spec = families.parse_model_spec(json.loads((path / "config.json").read_text())).unwrap()
    program = program_of(spec)
    tensors = weight_io.get_state_dict(path, plan_of(spec, torch_dtype=torch_dtype)).unwrap()
    return spec, program, program.weights(tensors, spec=spec)


def _hf_rows(model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]  # [n, V] per prompt


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("batch", [1, 4])
def test_logits_match_hf(variant: str, batch: int, tiny_checkpoint: Callable[..., Path], tiny_model: Any) -> None:
    spec, family, w = _program(tiny_checkpoint(variant))
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[0]]
    expected = _hf_rows(tiny_model(variant), prompts)
    x = inputs.prompt_inputs(prompts, length=CONTEXT_BUCKET)
    cache = kv_cache.empty_cache(spec, batch=len(prompts), length=CONTEXT_BUCKET, dtype=torch.float32)
    last, _ = family.forward(w, cache, x, spec=spec)
    every, _ = family.forward(w, cache, x, spec=spec, all_logits=True)
    assert last.shape == (len(prompts), 1, spec.vocab_size) and last.dtype == torch.float32
    for i, p in enumerate(prompts):
        _close(last[i, 0], expected[i][-1])
        _close(every[i, : len(p)], expected[i])


@pytest.mark.parametrize("fmt", list(SaveFormat))
@pytest.mark.parametrize("variant", ["llama3-tied", "qwen2"])
def test_every_checkpoint_format_loads_to_the_same_model(
    variant: str, fmt: SaveFormat, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    spec, family, w = _program(tiny_checkpoint(variant, fmt))
    expected = _hf_rows(tiny_model(variant), PROMPTS)
    x = inputs.prompt_inputs(PROMPTS, length=CONTEXT_BUCKET)
    cache = kv_cache.empty_cache(spec, batch=len(PROMPTS), length=CONTEXT_BUCKET, dtype=torch.float32)
    logits, _ = family.forward(w, cache, x, spec=spec)
    for i in range(len(PROMPTS)):
        _close(logits[i, 0], expected[i][-1])


def _our_greedy(spec: ModelSpec, family: catalog.Program, w: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill into a context-bucket view, then decode one token per step in the smallest fitting bucket."""
    full = kv_cache.empty_cache(spec, batch=len(prompts), length=TOKEN_BUCKETS[-1], dtype=torch.float32)
    logits, part = family.forward(
        w, full.prefix(CONTEXT_BUCKET), inputs.prompt_inputs(prompts, length=CONTEXT_BUCKET), spec=spec
    )
    full = full.splice(part)
    token, position = sampling.greedy(logits[:, 0]), torch.tensor([len(p) for p in prompts])
    out = [token]
    for _ in range(NEW_TOKENS - 1):
        bucket = next(b for b in TOKEN_BUCKETS if int(position.max()) < b)
        logits, part = family.forward(w, full.prefix(bucket), inputs.token_inputs(token, position), spec=spec)
        full = full.splice(part)
        token, position = sampling.greedy(logits[:, 0]), position + 1
        out.append(token)
    return torch.stack(out, dim=1)


def _hf_greedy(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """transformers generate() on a left-padded batch (its own convention), EOS disabled."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[:, width:]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_decoding_matches_hf_generate(
    variant: str, batch: int, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    spec, family, w = _program(tiny_checkpoint(variant))
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[2]]
    ours = _our_greedy(spec, family, w, prompts)
    model = tiny_model(variant)
    row_by_row = torch.cat([_hf_greedy(model, [p]) for p in prompts])
    assert ours.shape == (len(prompts), NEW_TOKENS)
    assert torch.equal(ours, row_by_row), (ours, row_by_row)
    if batch > 1:
        assert torch.equal(ours, _hf_greedy(model, prompts))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_logits_stay_within_bf16_tolerance(
    variant: str, tiny_checkpoint: Callable[..., Path], tiny_model: Any
) -> None:
    """Cast by the plan (cast_type="config"), run in bf16: within 0.05 of the fp32 reference (NxDI's bf16 rtol)."""
    spec, family, w = _program(tiny_checkpoint(variant), torch_dtype="bfloat16")
    cache = kv_cache.empty_cache(spec, batch=len(PROMPTS), length=CONTEXT_BUCKET, dtype=torch.bfloat16)
    logits, new = family.forward(w, cache, inputs.prompt_inputs(PROMPTS, length=CONTEXT_BUCKET), spec=spec)
    assert logits.dtype == torch.float32 and new.k[0].dtype == torch.bfloat16
    for i, expected in enumerate(_hf_rows(tiny_model(variant), PROMPTS)):
        _close(logits[i, 0], expected[-1], rel=0.05)

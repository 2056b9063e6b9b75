"""Shared checks of the decoder-program property tests."""

from __future__ import annotations

import torch

from nxdi.core.model_spec import ModelSpec


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """Within `rel` of the largest |expected| (NxDI's max-scaled closeness)."""
    scale = max(expected.abs().max().item(), 1e-6)
    assert (actual - expected).abs().max().item() <= rel * scale, (actual - expected).abs().max()


def random_tokens(spec: ModelSpec, seed: int, n: int) -> list[int]:
    """`n` token ids of `spec`'s vocabulary, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (n,), generator=g).tolist()

"""Shared checks of the decoder-program property tests."""

from __future__ import annotations

import torch

from nxdi.core.model_spec import ModelSpec

DTYPE = torch.float64
"""The dtype of the structural properties (padding, cache layouts, prefill/decode splits, ranks,
adapters): each holds exactly in exact arithmetic, so it is checked in float64 to a tight `close`
(the programs hand out fp32 logits, so a few fp32 ulps of the largest logit).
In fp32 the rounding differs between batch shapes, and an ill-conditioned random draw amplifies it
past any fixed tolerance: a gemma3 draw (final_logit_softcap 1.0) differed batched against alone by
4e-5 of its largest logit in fp32 and by nothing in float64."""


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """Within `rel` of the largest |expected| (NxDI's max-scaled closeness; the default is for
    float64 programs, see `DTYPE`)."""
    scale = max(expected.abs().max().item(), 1e-6)
    assert (actual - expected).abs().max().item() <= rel * scale, (actual - expected).abs().max()


def random_tokens(spec: ModelSpec, seed: int, n: int) -> list[int]:
    """`n` token ids of `spec`'s vocabulary, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (n,), generator=g).tolist()

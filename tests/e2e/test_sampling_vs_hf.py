"""The sampler's filtered distribution against transformers' temperature -> top-k -> top-p warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nxdi.core.programs import sampling

CASES = [(50, 0.9, 0.7), (5, 1.0, 1.0), (0, 0.5, 1.3), (20, 0.3, 0.5), (1, 0.8, 2.0), (100, 0.95, 1.0)]


@pytest.mark.parametrize(("top_k", "top_p", "temperature"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_distribution_matches_hf_warpers(top_k: int, top_p: float, temperature: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 100, generator=g, dtype=torch.float64).float() * 3
    params = torch.tensor([[top_k, top_p, temperature]] * 3)
    probs, ids = sampling.filtered_probs(logits, params, global_topk=0)
    ours = torch.zeros_like(logits).scatter(1, ids, probs / probs.sum(-1, keepdim=True))
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())  # type: ignore[arg-type]
    if top_k > 0:
        warped = TopKLogitsWarper(top_k)(None, warped)  # type: ignore[arg-type]
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)  # type: ignore[arg-type]
    theirs = torch.softmax(warped, dim=-1)
    assert torch.equal(ours > 0, theirs > 0), "the same tokens survive"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)

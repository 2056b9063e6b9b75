"""Properties of the logit-validation scheme."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.core.host import logit_validation as accuracy


def _logits(seed: int, n: int = 3, v: int = 64) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 5


@settings(deadline=None)
@given(st.integers(0, 10_000), st.floats(-50, 50))
def test_identical_or_shifted_logits_pass(seed: int, shift: float) -> None:
    expected = _logits(seed)
    results = accuracy.compare_logits(expected, expected + shift)
    assert all(r.passed for r in results) and len(results) == expected.shape[0]


@settings(deadline=None)
@given(st.integers(0, 10_000))
def test_large_noise_fails(seed: int) -> None:
    expected = _logits(seed)
    noise = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1)) * 2
    assert not all(r.passed for r in accuracy.compare_logits(expected, expected + noise))


def test_masked_entries_are_ignored() -> None:
    expected = _logits(0)
    actual = expected.clone()
    expected[:, -3:] = float("-inf")
    actual[:, -3:] = 123.0
    assert all(r.passed for r in accuracy.compare_logits(expected, actual))


def test_divergence_stops_and_is_reported() -> None:
    expected = torch.zeros(3, 8)
    expected[:, 1] = 5.0
    actual = expected.clone()
    actual[1, 2] = 9.0  # position 1 picks token 2 by a wide margin
    results = accuracy.compare_logits(expected, actual)
    assert len(results) == 2 and results[1].diverged and (results[1].expected_token, results[1].actual_token) == (1, 2)


def test_near_tie_is_not_divergence_but_stops_the_comparison() -> None:
    expected = torch.zeros(3, 8)
    expected[:, 1] = 5.0
    expected[:, 2] = 4.9998
    actual = expected.clone()
    actual[0, 2] = 5.0003  # a near-tie flips the argmax
    results = accuracy.compare_logits(expected, actual)
    assert len(results) == 1 and results[0].token_mismatch and not results[0].diverged and results[0].passed


def test_error_is_scaled_by_largest_expected_magnitude() -> None:
    expected = torch.tensor([10.0, 1.0, 0.0])
    assert accuracy.relative_error(expected, expected + torch.tensor([0.0, 0.5, 0.0]), atol=0.0) == pytest.approx(0.05)

"""Logit validation: does a run's logits match golden logits within tolerance? Pure tensor math.

The scheme (REFERENCE §10), per generated position:
1. Drop vocabulary entries that are -inf on either side (masked padding, banned tokens).
2. Remove a constant shift: fit `actual ~= a * expected + b` by least squares and subtract `b`
   (softmax is shift-invariant, so a shift is not an error).
3. For every `k` in the tolerance map (None = the whole vocabulary), take the expected top-k
   entries and require `(|actual - expected| - atol) / max|expected| <= rtol` on each; the error
   is scaled by the largest expected magnitude among them, not per element.
4. Divergence: where the argmaxes differ, the actual logits of the two tokens must be within
   `divergence_tol` (a near-tie, not a wrong answer). Either way the first position whose tokens
   differ is where the caller restarts generation from the expected tokens (teacher forcing).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

DEFAULT_TOL_MAP: Mapping[int | None, tuple[float, float]] = {
    None: (1e-5, 0.05),
    1000: (1e-5, 0.03),
    50: (1e-5, 0.02),
    5: (1e-5, 0.01),
}
"""top-k -> (atol, rtol); None means every vocabulary entry."""
DEFAULT_DIVERGENCE_TOL = 0.001


@attrs.frozen(kw_only=True)
class PositionResult:
    """How one generated position compares."""

    index: int
    passed: bool
    max_error: Mapping[str, float]
    """Worst scaled error per top-k group (`"all"`, `"1000"`, ...), to compare with its rtol."""
    expected_token: int
    actual_token: int
    diverged: bool
    """The argmaxes differ by more than a near-tie (a failure)."""

    @property
    def token_mismatch(self) -> bool:
        """The argmaxes differ at all; later positions need the expected tokens (teacher forcing)."""
        return self.expected_token != self.actual_token


def _shift_removed(expected: Tensor, actual: Tensor) -> Tensor:
    """`actual` minus the intercept of the least-squares fit actual ~= a * expected + b. [V']"""
    e, a = expected.double(), actual.double()
    e_mean, a_mean = e.mean(), a.mean()
    var = ((e - e_mean) ** 2).sum()
    slope = ((e - e_mean) * (a - a_mean)).sum() / var if var > 0 else torch.tensor(1.0, dtype=torch.float64)
    return (a - (a_mean - slope * e_mean)).to(actual.dtype)


def relative_error(expected: Tensor, actual: Tensor, *, atol: float) -> float:
    """max over entries of `(|actual - expected| - atol) / max|expected|` (0 for empty input)."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float(((actual - expected).abs() - atol).div(scale).max().clamp_min(0.0))


def compare_position(
    index: int,
    expected: Tensor,
    actual: Tensor,
    *,
    tol_map: Mapping[int | None, tuple[float, float]] = DEFAULT_TOL_MAP,
    divergence_tol: float = DEFAULT_DIVERGENCE_TOL,
) -> PositionResult:
    """Compare one position's logits, expected [V] and actual [V]."""
    expected, actual = expected.double(), actual.double()
    keep = torch.isfinite(expected) & torch.isfinite(actual)
    e, a = expected[keep], _shift_removed(expected[keep], actual[keep])
    errors: dict[str, float] = {}
    passed = True
    for k, (atol, rtol) in tol_map.items():
        top = e.topk(min(k, e.numel())).indices if k is not None else torch.arange(e.numel())
        err = relative_error(e[top], a[top], atol=atol)
        errors["all" if k is None else str(k)] = err
        passed &= err <= rtol
    # Tokens masked on either side can be neither the expected nor the actual choice.
    exp_tok = int(expected.masked_fill(~keep, float("-inf")).argmax())
    act_tok = int(actual.masked_fill(~keep, float("-inf")).argmax())
    diverged = exp_tok != act_tok and float((actual[act_tok] - actual[exp_tok]).abs()) >= divergence_tol
    return PositionResult(
        index=index,
        passed=passed and not diverged,
        max_error=errors,
        expected_token=exp_tok,
        actual_token=act_tok,
        diverged=diverged,
    )


def compare_logits(
    expected: Tensor,
    actual: Tensor,
    *,
    tol_map: Mapping[int | None, tuple[float, float]] = DEFAULT_TOL_MAP,
    divergence_tol: float = DEFAULT_DIVERGENCE_TOL,
) -> tuple[PositionResult, ...]:
    """Compare logits position by position, expected and actual [N, V], stopping after the first
    position whose tokens differ (later positions were generated from a different prefix, so they
    say nothing; the caller restarts from the expected tokens there)."""
    if expected.shape != actual.shape:
        raise ValueError(f"logits shapes differ: expected {tuple(expected.shape)}, actual {tuple(actual.shape)}")
    out: list[PositionResult] = []
    for i in range(expected.shape[0]):
        result = compare_position(i, expected[i], actual[i], tol_map=tol_map, divergence_tol=divergence_tol)
        out.append(result)
        if result.token_mismatch:
            break
    return tuple(out)


def max_relative_logit_error(expected: Tensor, actual: Tensor) -> float:
    """max |actual - expected| / max |expected|: the simple fp32 check (e.g. within 1e-4)."""
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    return float((actual.float() - expected.float()).abs().max() / scale)

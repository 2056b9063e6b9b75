"""What a checkpoint's tensors must be for a model to run on them: floating dtypes, finite values. Pure.

A weight plan (`nxdi.core.weight_plan`) checks keys and shapes; these rules check what the
headers and the values say:

- Every tensor a plan reads must have a floating-point dtype. An integer or bool weight would be
  cast or type-promoted without a word (a bool matrix becomes 0.0/1.0), or fail deep inside a
  program; so it is refused up front, every such tensor named.
- Every value must be finite. One NaN or inf in a weight makes every logit it reaches NaN, so a
  checkpoint holding them is refused unless the user opts in (`NXDI_ALLOW_NONFINITE_WEIGHTS=1`,
  read by `nxdi.effects.env`), and named either way.

The callers (`nxdi.effects.weight_loader`, `nxdi.effects.checkpoint_scan`) read the dtypes from
the files' headers and count the non-finite values while streaming the data; the rules are here.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import CheckpointError, Problem

FLOATING_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
)
"""torch dtype names (`str(dtype)` without `torch.`) a weight may have."""

ALLOW_NONFINITE = "NXDI_ALLOW_NONFINITE_WEIGHTS"
"""The environment variable that accepts non-finite weights (named in messages; read by effects)."""


@attrs.frozen(kw_only=True)
class NonFinite:
    """The non-finite values found in one tensor."""

    nan: int
    """NaN values."""
    inf: int
    """+inf and -inf values."""
    numel: int
    """Values looked at."""

    def describe(self) -> str:
        """`2 NaN and 1 inf of 4096 values`."""
        parts = [f"{n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "inf")) if n]
        return f"{' and '.join(parts) or 'no non-finite values'} of {self.numel} values"


def check_dtypes(dtypes: Mapping[str, str]) -> Result[None, CheckpointError]:
    """Refuse every tensor whose dtype is not floating point.

    Args:
        dtypes: checkpoint key -> torch dtype name (`"int32"`, `"bool"`, ...), for the tensors
            a plan reads.

    Returns:
        `Success(None)`, or `Failure(CheckpointError)` naming every non-floating tensor.
    """
    fix = "re-save the checkpoint with floating-point weights (float32, bfloat16 or float16)"
    problems = tuple(
        Problem.of(key, dtype, f"has dtype {dtype}; model weights must be floating point", fix)
        for key, dtype in dtypes.items()
        if dtype not in FLOATING_DTYPES
    )
    return Failure(CheckpointError(problems=problems)) if problems else Success(None)


def check_finite(found: Mapping[str, NonFinite], *, allowed: bool = False) -> Result[None, CheckpointError]:
    """Refuse tensors holding NaN or inf, unless `allowed`.

    Args:
        found: checkpoint key -> its non-finite counts (keys with none may be left out).
        allowed: the user opted in (`NXDI_ALLOW_NONFINITE_WEIGHTS=1`).

    Returns:
        `Success(None)`, or `Failure(CheckpointError)` naming every tensor with non-finite values.
    """
    problems = () if allowed else nonfinite_problems(found)
    return Failure(CheckpointError(problems=problems)) if problems else Success(None)


def nonfinite_problems(found: Mapping[str, NonFinite]) -> tuple[Problem, ...]:
    """One problem per tensor holding NaN or inf (for a refusal, or a warning when allowed)."""
    fix = f"repair or re-download the checkpoint; or set {ALLOW_NONFINITE}=1 to run it anyway"
    why = "holds non-finite values; every logit they reach would be NaN"
    return tuple(
        Problem.of(key, counts.describe(), why, fix) for key, counts in found.items() if counts.nan or counts.inf
    )

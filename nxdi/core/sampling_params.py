"""Per-row sampling parameters: the `[B, 3]` `(top_k, top_p, temperature)` rows, built and checked. Pure.

Rules (the reference's `prepare_sampling_params` / `validate_sampling_params` / `infer_sampling_params`):
- Each of top_k, top_p and temperature is a scalar or a list; a length-1 list is broadcast to the
  batch, any other length must equal the batch size. Rows are plain tuples; the shell makes the tensor.
- top_k is -1 or an integer in `[0, global_topk]` (-1 and 0 mean the whole vocabulary), top_p lies in
  `(0, 1]`, temperature is `>= 0`, and temperature 0 (greedy) cannot go with top_k -1 or 0.
- Rows with temperature 0 are greedy: they get top_k 1 and top_p 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem

SamplingRow = tuple[float, float, float]
"""`(top_k, top_p, temperature)` of one sequence."""

DEFAULT_ROW: SamplingRow = (1.0, 1.0, 1.0)
FIELDS = ("top_k", "top_p", "temperature")


def _as_list(value: float | Sequence[float]) -> list[float]:
    return [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]


def prepare_sampling_params(
    batch_size: int,
    top_k: float | Sequence[float] = (1,),
    top_p: float | Sequence[float] = (1.0,),
    temperature: float | Sequence[float] = (1.0,),
) -> Result[tuple[SamplingRow, ...], ConfigError]:
    """`batch_size` rows of `(top_k, top_p, temperature)`, broadcasting scalars and length-1 lists.

    Returns:
        `Failure` listing a non-positive batch size and every parameter whose length is neither 1 nor
        `batch_size` (values are not checked here; see `validate_sampling_params`).
    """
    columns = {name: _as_list(v) for name, v in zip(FIELDS, (top_k, top_p, temperature), strict=True)}
    problems: list[Problem] = []
    if batch_size < 1:
        problems.append(Problem.of("batch_size", batch_size, "must be a positive integer"))
    problems.extend(
        Problem.of(name, col, f"has {len(col)} values for a batch of {batch_size}", "give 1 value or one per row")
        for name, col in columns.items()
        if len(col) not in (1, batch_size)
    )
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    full = [col * batch_size if len(col) == 1 else col for col in columns.values()]
    return Success(tuple((k, p, t) for k, p, t in zip(*full, strict=True)))


def _row_problems(i: int, row: Sequence[float], global_topk: int) -> list[Problem]:
    k, p, t = row
    at = f"sampling_params[{i}]"
    problems: list[Problem] = []
    if not (k == -1 or 0 <= k <= global_topk):
        problems.append(Problem.of(f"{at}.top_k", k, f"invalid top-k value: must be -1 or in [0, {global_topk}]"))
    if not float(k).is_integer():
        problems.append(Problem.of(f"{at}.top_k", k, "top-k values must be represented as integers"))
    if not (0.0 < p <= 1.0):
        problems.append(Problem.of(f"{at}.top_p", p, "invalid top-p value: must be in (0, 1]"))
    if not t >= 0.0:  # also catches NaN
        problems.append(Problem.of(f"{at}.temperature", t, "invalid temperature value: must be >= 0"))
    if t == 0.0 and k in (-1, 0):
        problems.append(
            Problem.of(
                f"{at}",
                tuple(row),
                "invalid sampling parameters: temperature 0 (greedy) with top_k -1 or 0 (whole vocabulary)",
                "set top_k >= 1, or a temperature above 0",
            )
        )
    return problems


def validate_sampling_params(
    rows: Sequence[Sequence[float]], global_topk: int = 256
) -> Result[tuple[SamplingRow, ...], ConfigError]:
    """Check every row (see the module rules).

    Returns:
        `Success(rows as tuples)`, or `Failure` listing every bad row and value: a row that is not
        3 values (expected shape `(batch_size, 3)`), and each top_k, top_p, temperature problem.
    """
    problems: list[Problem] = []
    for i, row in enumerate(rows):
        if len(row) != 3:
            problems.append(Problem.of(f"sampling_params[{i}]", tuple(row), "expected shape (batch_size, 3)"))
        else:
            problems.extend(_row_problems(i, row, global_topk))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    return Success(tuple((float(k), float(p), float(t)) for k, p, t in rows))


def infer_sampling_params(rows: Sequence[SamplingRow]) -> tuple[SamplingRow, ...]:
    """Rows with temperature 0 become greedy: top_k 1, top_p 1 (temperature stays 0)."""
    return tuple((1.0, 1.0, t) if t == 0.0 else (k, p, t) for k, p, t in rows)

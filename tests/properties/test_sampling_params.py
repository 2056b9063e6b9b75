"""Properties of the `[B, 3]` sampling-parameter rows: broadcasting, validation of every row, greedy inference."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core import sampling_params as sampling

GLOBAL_TOPK = 64
good_k = st.one_of(st.just(-1), st.integers(0, GLOBAL_TOPK)).map(float)
good_p = st.floats(min_value=1e-6, max_value=1.0)
good_t = st.floats(min_value=1e-3, max_value=10.0)
any_k = st.one_of(good_k, st.floats(-5, 100), st.integers(-5, 100).map(float))
any_p = st.one_of(st.floats(-1, 2), st.just(float("nan")))
any_t = st.one_of(st.just(0.0), st.floats(-1, 3), st.just(float("nan")), st.just(float("inf")))


def _ok(k: float, p: float, t: float) -> bool:
    k_ok = (k == -1 or 0 <= k <= GLOBAL_TOPK) and float(k).is_integer()
    return k_ok and 0 < p <= 1 and t >= 0 and not (t == 0 and k in (-1, 0))


@given(st.integers(1, 16), st.data())
def test_prepare_broadcasts_scalars_and_length_one_lists(batch: int, data: st.DataObject) -> None:
    def column(values: st.SearchStrategy[float]) -> float | list[float]:
        return data.draw(
            st.one_of(
                values, st.lists(values, min_size=1, max_size=1), st.lists(values, min_size=batch, max_size=batch)
            )
        )

    k, p, t = column(good_k), column(good_p), column(good_t)
    rows = sampling.prepare_sampling_params(batch, top_k=k, top_p=p, temperature=t).unwrap()
    assert len(rows) == batch and all(len(r) == 3 for r in rows)
    for i, (rk, rp, rt) in enumerate(rows):
        for given_value, got in ((k, rk), (p, rp), (t, rt)):
            expected = given_value if isinstance(given_value, float) else given_value[0 if len(given_value) == 1 else i]
            assert got == expected
    assert isinstance(sampling.validate_sampling_params(rows, GLOBAL_TOPK), Success)


@given(st.integers(2, 8), st.integers(2, 8))
def test_prepare_rejects_other_lengths(batch: int, n: int) -> None:
    result = sampling.prepare_sampling_params(batch, top_p=[0.5] * n)
    assert isinstance(result, Failure) == (n != batch)


@given(st.lists(st.tuples(any_k, any_p, any_t), min_size=1, max_size=10))
def test_validation_reports_every_bad_row(rows: list[tuple[float, float, float]]) -> None:
    bad = {i for i, r in enumerate(rows) if not _ok(*r)}
    match sampling.validate_sampling_params(rows, GLOBAL_TOPK):
        case Success(checked):
            assert not bad and list(checked) == rows
        case Failure(err):
            reported = {int(f.split("[")[1].split("]")[0]) for f in err.fields()}
            assert reported == bad


@given(st.lists(st.tuples(good_k, good_p, st.one_of(st.just(0.0), good_t)), min_size=1, max_size=10))
def test_inference_makes_zero_temperature_rows_greedy(rows: list[tuple[float, float, float]]) -> None:
    out = sampling.infer_sampling_params(rows)
    assert sampling.infer_sampling_params(out) == out
    for (k, p, t), (ok, op, ot) in zip(rows, out, strict=True):
        assert ot == t
        assert (ok, op) == ((1.0, 1.0) if t == 0 else (k, p))

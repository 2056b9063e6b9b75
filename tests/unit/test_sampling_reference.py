"""Sampling-parameter rows against REFERENCE §7 (prepare, validate, infer)."""

from __future__ import annotations

from returns.result import Success

from nxdi.core import sampling_params as sampling


def test_prepare_defaults_and_broadcast() -> None:
    assert sampling.prepare_sampling_params(2) == Success(((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)))
    rows = sampling.prepare_sampling_params(3, top_k=[5, 10, 1], top_p=0.9, temperature=[0.7])
    assert rows == Success(((5.0, 0.9, 0.7), (10.0, 0.9, 0.7), (1.0, 0.9, 0.7)))
    err = sampling.prepare_sampling_params(3, top_k=[5, 10]).failure()
    assert err.fields() == {"top_k"} and "2 values for a batch of 3" in err.problems[0].reason


def test_validation_lists_every_bad_row_and_value() -> None:
    rows = [(1, 1.0, 1.0), (-1, 0.5, 0.8), (300, 1.0, 1.0), (2.5, 0.0, -1.0), (0, 1.0, 0.0), (1, 1.0)]
    err = sampling.validate_sampling_params(rows, global_topk=256).failure()
    assert [p.field for p in err.problems] == [
        "sampling_params[2].top_k",
        "sampling_params[3].top_k",
        "sampling_params[3].top_p",
        "sampling_params[3].temperature",
        "sampling_params[4]",
        "sampling_params[5]",
    ]
    reasons = [p.reason for p in err.problems]
    assert "invalid top-k" in reasons[0] and "[0, 256]" in reasons[0]
    assert "integers" in reasons[1] and "invalid top-p" in reasons[2] and "invalid temperature" in reasons[3]
    assert "invalid sampling parameters" in reasons[4] and "(batch_size, 3)" in reasons[5]


def test_valid_rows_pass_and_greedy_rows_are_inferred() -> None:
    rows = ((-1.0, 0.9, 1.0), (0.0, 1.0, 0.5), (256.0, 1.0, 0.0), (50.0, 0.3, 0.0))
    assert sampling.validate_sampling_params(rows, global_topk=256) == Success(rows)
    assert sampling.infer_sampling_params(rows) == ((-1.0, 0.9, 1.0), (0.0, 1.0, 0.5), (1.0, 1.0, 0.0), (1.0, 1.0, 0.0))

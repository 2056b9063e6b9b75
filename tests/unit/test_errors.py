"""Problems and error values: rendering, accumulation, and value semantics."""

from __future__ import annotations

import attrs
import pytest
from returns.result import Failure, Result, Success

from nxdi.core.errors import CheckpointError, ConfigError, Problem, collect, problems_result

TP = Problem.of("tp_degree", 3, "does not divide num_kv_heads=8", "use 1, 2, 4 or 8")
BATCH = Problem.missing("batch_size", "pass batch_size")


def test_problem_of_shows_the_repr_of_the_value() -> None:
    assert TP.value == "3"
    assert Problem.of("padding_side", "middle", "must be left or right").value == "'middle'"
    assert Problem.of("buckets", (128, 64), "must be sorted").value == "(128, 64)"


def test_render_names_field_value_reason_and_fix() -> None:
    assert TP.render() == "tp_degree=3: does not divide num_kv_heads=8. Fix: use 1, 2, 4 or 8"
    assert BATCH.render() == "batch_size: is required but missing. Fix: pass batch_size"
    assert Problem.of("seq_len", 0, "must be positive").render() == "seq_len=0: must be positive"


def test_prefixed_puts_the_field_under_a_parent() -> None:
    assert TP.prefixed("neuron_config").field == "neuron_config.tp_degree"
    assert TP.prefixed("neuron_config").render().startswith("neuron_config.tp_degree=3: ")


def test_config_error_lists_every_problem() -> None:
    error = ConfigError(problems=[TP, BATCH])
    assert error.problems == (TP, BATCH)  # the converter makes a tuple
    assert error.fields() == {"tp_degree", "batch_size"}
    assert error.render() == (
        "Invalid configuration: 2 problems:\n"
        "  - tp_degree=3: does not divide num_kv_heads=8. Fix: use 1, 2, 4 or 8\n"
        "  - batch_size: is required but missing. Fix: pass batch_size"
    )
    assert ConfigError.of("seq_len", 0, "must be positive").render("Bad plan") == (
        "Bad plan: 1 problem:\n  - seq_len=0: must be positive"
    )
    assert error.prefixed("neuron_config").fields() == {"neuron_config.tp_degree", "neuron_config.batch_size"}


def test_checkpoint_error_lists_every_problem() -> None:
    error = CheckpointError(
        problems=[Problem.missing("model.norm.weight"), Problem.of("lm_head.weight", (3, 4), "bad shape")]
    )
    assert error.fields() == {"model.norm.weight", "lm_head.weight"}
    assert error.render().startswith("Invalid checkpoint: 2 problems:\n  - model.norm.weight: is required but missing")
    assert CheckpointError.of("a", 1, "b") == CheckpointError(problems=(Problem(field="a", value="1", reason="b"),))


def test_errors_are_values_so_failures_compare_equal() -> None:
    # Exceptions compare by identity; these compare by value, so Failure(x) == Failure(x).
    assert Failure(ConfigError(problems=[TP])) == Failure(ConfigError(problems=(TP,)))
    assert hash(ConfigError(problems=[TP, BATCH])) == hash(ConfigError(problems=(TP, BATCH)))
    assert ConfigError(problems=[TP]) != CheckpointError(problems=[TP])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        TP.field = "x"  # type: ignore[misc]


def test_problems_result() -> None:
    assert problems_result(42, []) == Success(42)
    assert problems_result(42, iter([TP, BATCH])) == Failure(ConfigError(problems=(TP, BATCH)))


def test_collect_keeps_every_value_or_every_problem() -> None:
    ok: list[Result[object, ConfigError]] = [Success(1), Success("two")]
    assert collect(*ok) == Success((1, "two"))
    assert collect() == Success(())
    mixed = [Success(1), Failure(ConfigError(problems=(TP,))), Success(3), Failure(ConfigError(problems=(BATCH, TP)))]
    assert collect(*mixed) == Failure(ConfigError(problems=(TP, BATCH, TP)))

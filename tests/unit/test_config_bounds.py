"""Every integer setting has a documented range; a value outside it is refused with the field, the
value and the bound (no more `batch_size=2**63`)."""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest
from returns.result import Failure

from nxdi.core.config.fields import MAX_BATCH, field_types, info_of, sub_spec_fields
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.config.sub_specs import MoESpec, parse_sub
from nxdi.shell.cli import reference
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError

SPEC_CLASSES = (NeuronSpec, MoESpec, *sub_spec_fields(NeuronSpec).values(), *sub_spec_fields(MoESpec).values())


def _holds_ints(tp: Any) -> bool:
    """An annotation of int, int | None, or (nested) tuples of ints."""
    if tp is int:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_holds_ints(a) for a in args if a is not type(None))
    return origin is tuple and bool(args) and _holds_ints(args[0])


def _shaped(tp: Any, value: int) -> Any:
    """`value` in the shape of annotation `tp` (a list for tuple fields, nested as deep)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _shaped(next(a for a in args if a is not type(None)), value)
    return [_shaped(args[0], value)] if origin is tuple else value


INT_FIELDS = [(cls, name, tp) for cls in SPEC_CLASSES for name, tp in field_types(cls).items() if _holds_ints(tp)]


@pytest.mark.parametrize(("cls", "name", "tp"), INT_FIELDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_integer_setting_declares_a_range(cls: type, name: str, tp: Any) -> None:
    bounds = info_of(cls, name).bounds
    assert bounds is not None, f"{cls.__name__}.{name}: declare bounds=(low, high)"
    low, high = bounds
    assert low < high <= 1 << 24


def _problems(cls: type, name: str, value: Any) -> tuple[Any, ...]:
    if cls is NeuronSpec:
        result = parse_neuron_spec({name: value})
    else:
        result = parse_sub(cls, {name: value}, prefix=cls.__name__)
    assert isinstance(result, Failure), f"{cls.__name__}.{name}={value!r} was accepted"
    return result.failure().problems


@pytest.mark.parametrize(("cls", "name", "tp"), INT_FIELDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_value_outside_the_range_names_field_value_and_bound(cls: type, name: str, tp: Any) -> None:
    info = info_of(cls, name)
    assert info.bounds is not None
    low, high = info.bounds
    for value, bound in ((high + 1, f"must be <= {high}"), (low - 1, f"must be >= {low}")):
        problems = _problems(cls, name, _shaped(tp, value))
        mine = [p for p in problems if p.field.endswith(name)]
        assert mine and bound in mine[0].reason and str(value) in mine[0].value, problems


def test_a_huge_batch_size_is_an_incompatible_config_error() -> None:
    with pytest.raises(IncompatibleConfigError, match=r"batch_size=9223372036854775808: must be <= 65536"):
        NeuronConfig(batch_size=2**63)
    config = NeuronConfig(batch_size=MAX_BATCH)  # the bound itself is accepted
    with pytest.raises(IncompatibleConfigError, match=r"tp_degree=4096: must be <= 512"):
        config.tp_degree = 4096
    assert config.batch_size == MAX_BATCH and config.tp_degree == 1


def test_the_reference_states_every_range() -> None:
    rows = {r.name: r for r in reference.reference_rows()}
    assert reference.describe(rows["batch_size"].info).endswith("Range: 1..65536.")
    assert reference.describe(rows["on_device_sampling_config.top_k"].info).endswith("Range: -1..16777216.")
    assert "Range: 1..512." in reference.field_help("tp_degree")

"""Properties of NeuronSpec parsing, the JSON codec and graph_key."""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core import graph_key
from nxdi.core.config import codec, neuron_parse
from nxdi.core.config.fields import info_of
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.testing.strategies.neuron_configs import invalid_neuron_kwargs, neuron_kwargs, neuron_specs


@given(neuron_specs())
def test_json_round_trip_is_lossless(spec: NeuronSpec) -> None:
    text = codec.dumps(codec.neuron_spec_to_dict(spec))
    assert "Infinity" not in text and "NaN" not in text
    parsed = codec.parse_neuron_dict(codec.loads(text).unwrap())
    assert parsed.unwrap().spec == spec


@given(neuron_specs())
def test_evolve_without_changes_is_identity(spec: NeuronSpec) -> None:
    assert attrs.evolve(spec) == spec


@given(neuron_specs())
def test_reparsing_own_fields_gives_same_spec(spec: NeuronSpec) -> None:
    assert neuron_parse.parse_neuron_spec(neuron_parse.spec_kwargs(spec)).unwrap().spec == spec


@given(neuron_kwargs(), st.data())
def test_construct_equals_construct_then_assign(kwargs: dict[str, Any], data: st.DataObject) -> None:
    from nxdi.shell.config import NeuronConfig

    name = data.draw(st.sampled_from(sorted(kwargs)))
    partial = {k: v for k, v in kwargs.items() if k != name}
    assume(isinstance(neuron_parse.parse_neuron_spec(partial), Success))  # the first step must be valid too
    later = NeuronConfig(**partial)
    setattr(later, name, kwargs[name])
    assert later.spec == NeuronConfig(**kwargs).spec


@given(neuron_kwargs())
def test_derived_defaults_hold(kwargs: dict[str, Any]) -> None:
    spec = neuron_parse.parse_neuron_spec(kwargs).unwrap().spec
    ctx = kwargs.get("max_context_length", kwargs["seq_len"])
    assert spec.max_context_length == ctx
    assert spec.max_length == spec.n_positions == spec.n_active_tokens == kwargs["seq_len"]
    assert spec.max_new_tokens == ((kwargs["seq_len"] - ctx) or None)
    b = kwargs["batch_size"]
    assert spec.ctx_batch_size == spec.tkg_batch_size == spec.max_batch_size == spec.kv_cache_batch_size == b
    assert spec.overrides_torch_dtype == ("torch_dtype" in kwargs)
    assert spec.torch_dtype == kwargs.get("torch_dtype", "bfloat16")
    assert spec.world_size == spec.local_ranks_size == kwargs["tp_degree"]


@given(invalid_neuron_kwargs())
def test_every_invalid_draw_fails_naming_its_field(case: tuple[dict[str, Any], str]) -> None:
    kwargs, field = case
    match neuron_parse.parse_neuron_spec(kwargs):
        case Failure(error):
            assert field in error.fields(), error.render()
        case Success(value):
            raise AssertionError(f"accepted invalid kwargs {kwargs}: {value}")


_INDEPENDENT = {
    "batch_size": {"batch_size": 0},
    "tp_degre": {"tp_degre": 2},
    "torch_dtype": {"torch_dtype": "float64"},
    "padding_side": {"padding_side": "middle"},
    "on_device_sampling_config.top_p": {"on_device_sampling_config": {"top_p": 1.5}},
    "quantized_checkpoints_path": {"quantized": True},
    "max_context_length": {"max_context_length": 10**6},
}


@given(neuron_kwargs(), st.sets(st.sampled_from(sorted(_INDEPENDENT)), min_size=2))
def test_several_problems_are_all_reported(kwargs: dict[str, Any], broken: set[str]) -> None:
    bad = dict(kwargs)
    for field in broken:
        bad.update(_INDEPENDENT[field])
    result = neuron_parse.parse_neuron_spec(bad)
    assert isinstance(result, Failure)
    assert broken <= result.failure().fields(), result.failure().render()


_FLIPPABLE = tuple(
    f.name for f in attrs.fields(NeuronSpec) if f.type in ("bool", bool) and f.name not in ("is_prefill_stage",)
)


@given(neuron_specs(), st.sampled_from(_FLIPPABLE))
def test_graph_key_changes_iff_a_graph_field_changes(spec: NeuronSpec, name: str) -> None:
    flipped = attrs.evolve(spec, **{name: not getattr(spec, name)})
    changed = graph_key.graph_key(spec) != graph_key.graph_key(flipped)
    assert changed == info_of(NeuronSpec, name).graph


@given(neuron_specs())
def test_graph_key_is_stable(spec: NeuronSpec) -> None:
    again = codec.parse_neuron_dict(codec.neuron_spec_to_dict(spec)).unwrap().spec
    assert graph_key.graph_key(spec) == graph_key.graph_key(again)

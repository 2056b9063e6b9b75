"""Properties of `parse_model_spec`: valid dicts parse to the spec they describe; every broken field is named."""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.families import parse_model_spec
from nxdi.core.model_spec import ModelSpec
from nxdi.testing.strategies.hf_configs import broken_configs, llama_like_cases, model_specs


@given(llama_like_cases())
def test_valid_llama_like_configs_parse_to_the_spec_they_describe(case: tuple[dict[str, Any], ModelSpec]) -> None:
    raw, expected = case
    assert parse_model_spec(raw) == Success(expected)


@given(llama_like_cases(), st.dictionaries(st.text(min_size=1).map(lambda s: f"x_{s}"), st.integers()))
def test_unknown_keys_are_ignored(case: tuple[dict[str, Any], ModelSpec], extra: dict[str, int]) -> None:
    raw, expected = case
    assert parse_model_spec(extra | raw) == Success(expected)


@given(llama_like_cases())
def test_parsing_does_not_mutate_its_input(case: tuple[dict[str, Any], ModelSpec]) -> None:
    raw, _ = case
    snapshot = repr(raw)
    parse_model_spec(raw)
    assert repr(raw) == snapshot


@given(broken_configs(min_breaks=1, max_breaks=1))
def test_one_broken_field_is_named_exactly(case: tuple[dict[str, Any], frozenset[str]]) -> None:
    raw, fields = case
    match parse_model_spec(raw):
        case Failure(error):
            assert [p.field for p in error.problems] == list(fields)
        case other:
            raise AssertionError(f"expected a Failure naming {sorted(fields)}, got {other}")


@given(broken_configs(min_breaks=2, max_breaks=5))
def test_every_broken_field_is_reported_once(case: tuple[dict[str, Any], frozenset[str]]) -> None:
    raw, fields = case
    match parse_model_spec(raw):
        case Failure(error):
            assert sorted(p.field for p in error.problems) == sorted(fields)
            assert all(p.reason for p in error.problems)
        case other:
            raise AssertionError(f"expected a Failure naming {sorted(fields)}, got {other}")


@given(model_specs())
def test_specs_are_hashable_values(spec: ModelSpec) -> None:
    assert attrs.evolve(spec) == spec
    assert hash(attrs.evolve(spec)) == hash(spec)
    assert spec.q_size == spec.num_attention_heads * spec.head_dim
    assert spec.num_attention_heads % spec.num_kv_heads == 0


@given(model_specs(), st.integers(1, 8))
def test_num_params_grows_by_one_layer_per_layer(spec: ModelSpec, extra: int) -> None:
    one_more = attrs.evolve(spec, num_layers=spec.num_layers + 1)
    more = attrs.evolve(spec, num_layers=spec.num_layers + extra)
    per_layer = one_more.num_params() - spec.num_params()
    assert per_layer > 0
    assert more.num_params() - spec.num_params() == extra * per_layer


@given(model_specs())
def test_tying_embeddings_saves_exactly_one_embedding_matrix(spec: ModelSpec) -> None:
    tied = attrs.evolve(spec, tie_word_embeddings=True)
    untied = attrs.evolve(spec, tie_word_embeddings=False)
    assert untied.num_params() - tied.num_params() == spec.vocab_size * spec.hidden_size

"""A config dict and its standard-JSON form (what neuron_config.json holds) parse alike, so compile()
and load() apply one check: a NaN, an infinity or a non-positive epsilon is refused by both."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure

from nxdi.core.config.fields import to_json
from nxdi.core.families import parse_model_spec
from nxdi.testing.strategies.hf_configs import llama_like_cases

FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
"""Top-level float fields of every llama-like config."""

ODD_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1e-6, 1e-300, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@given(llama_like_cases(), st.sampled_from(FLOAT_FIELDS), ODD_FLOATS)
def test_a_dict_and_its_json_form_parse_alike(case: tuple[dict[str, Any], object], field: str, value: float) -> None:
    raw = dict(case[0])
    if field == "rope_theta":  # read from the top level only when no RoPE block holds one
        raw.pop("rope_parameters", None)
        raw.pop("rope_scaling", None)
    raw[field] = value
    live, saved = parse_model_spec(raw), parse_model_spec(to_json(raw))
    assert isinstance(live, Failure) == isinstance(saved, Failure)
    if isinstance(live, Failure) and isinstance(saved, Failure):
        assert live.failure().fields() == saved.failure().fields()
    if not math.isfinite(value) or value <= 0:
        assert isinstance(live, Failure) and field in live.failure().fields(), live

"""neuron_config.json: the reference layout, written as standard JSON and read leniently. Pure.

Layout (REFERENCE §2.3): the Hugging Face config keys at the top level (without `torch_dtype` /
`dtype`), plus `attribute_map`, `fused_spec_config`, `metadata`, `num_cores_per_group`, and
`neuron_config` holding every NeuronConfig attribute, including the derived ones the reference
writes (`buckets`, `world_size`, ...), with dtypes as bare names and MoE attributes flattened in.

We write standard JSON: non-finite floats become the strings "inf"/"-inf"/"nan" (the reference
writes the non-standard `Infinity`). We read both. Derived attributes are recomputed on read,
never trusted, so a file cannot claim a `world_size` its degrees do not give.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config import neuron_parse
from nxdi.core.config.fields import to_json
from nxdi.core.config.neuron_spec import DERIVED, NeuronSpec
from nxdi.core.config.sub_specs import MoESpec
from nxdi.core.errors import ConfigError
from nxdi.core.platform import Platform

# Written like the reference does, but nxdi keeps them out of NeuronSpec (the reference's own
# `is_prefill_stage` is a field; these are the derived properties plus the deprecated alias).
_IGNORED_ON_READ = (*DERIVED, "logical_neuron_cores")


def neuron_spec_to_dict(spec: NeuronSpec) -> dict[str, Any]:
    """Every attribute of `spec` (derived ones included, MoE flattened) as standard-JSON values."""
    out: dict[str, Any] = {}
    for f in attrs.fields(NeuronSpec):
        value = getattr(spec, f.name)
        if f.name == "moe":
            if value is not None:
                out.update({m.name: to_json(getattr(value, m.name)) for m in attrs.fields(MoESpec)})
            continue
        out[f.name] = to_json(value)
    out.update({name: to_json(getattr(spec, name)) for name in DERIVED})
    return out


def parse_neuron_dict(
    data: Mapping[str, Any], *, moe: bool = False, env_lnc: int | None = None, platform: Platform = Platform.TRN1
) -> Result[neuron_parse.ParsedNeuronSpec, ConfigError]:
    """Parse the `neuron_config` object of a neuron_config.json (ours or the reference's).

    Returns a Failure naming every unknown or invalid attribute, each under `neuron_config.`.
    """
    if not isinstance(data, Mapping):
        return Failure(ConfigError.of("neuron_config", data, "must be a JSON object"))
    kwargs = {k: v for k, v in data.items() if k not in _IGNORED_ON_READ}
    if moe and "normalize_top_k_affinities" in kwargs:
        kwargs.pop("disable_normalize_top_k_affinities", None)
    return neuron_parse.parse_neuron_spec(kwargs, env_lnc=env_lnc, platform=platform, moe=moe).alt(
        lambda e: e.prefixed("neuron_config")
    )


def dumps(document: Mapping[str, Any]) -> str:
    """Deterministic standard JSON: sorted keys, indent 2 (clients hash it to name artifact folders)."""
    return json.dumps(to_json(document), indent=2, sort_keys=True, allow_nan=False)


def loads(text: str, *, source: str = "neuron_config.json") -> Result[dict[str, Any], ConfigError]:
    """Parse JSON text, accepting the reference's `Infinity`/`NaN`.

    Returns a Failure naming `source` with the line and column of a syntax error, or when the
    document is not a JSON object.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return Failure(
            ConfigError.of(source, f"line {exc.lineno} column {exc.colno}", f"is not valid JSON ({exc.msg})")
        )
    if not isinstance(data, dict):
        return Failure(ConfigError.of(source, type(data).__name__, "must hold a JSON object"))
    return Success(data)

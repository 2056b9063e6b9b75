"""NeuronConfig attributes as kebab-case command-line flags, derived from NeuronSpec's fields.

Every simple attribute (bool, int, float, string, choice, list of ints) gets a flag named like
the reference's inference demo (`--tp-degree 8`, `--enable-bucketing`, `--no-fused-qkv`,
`--context-encoding-buckets 128 256`); the parsed values come back as NeuronConfig kwargs, with
only the flags the user actually gave.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import attrs

from nxdi.core.config.fields import Group, field_types, info_of
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.config.sub_specs import HybridShardingSpec, MoESpec
from nxdi.shell.cli import reference

_SKIP = frozenset({"moe", "is_prefill_stage", "overrides_torch_dtype"})
"""Attributes without a flag: the MoE options' holder (its attributes get flags of their own) and
two that nxdi sets itself."""


def _scalar(tp: Any) -> tuple[Any, Any, str] | None:
    """(argparse type, choices, nargs) for a simple annotation, or None when it has no flag."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _scalar(rest[0]) if len(rest) == 1 else None
    if typing.get_origin(tp) is typing.Literal:
        return str, args, ""
    if typing.get_origin(tp) is tuple and args and args[0] is int:
        return int, None, "+"
    if tp in (int, float, str):
        return tp, None, ""
    return None


def add_neuron_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per simple NeuronConfig attribute (default: not given), grouped as the
    reference groups them, each with its description as help (`nxdi config --list` has the rest)."""
    groups = {g: parser.add_argument_group(f"NeuronConfig: {g.value}") for g in Group}
    moe_group = parser.add_argument_group("MoENeuronConfig (mixture-of-experts models only)")
    fields = [(NeuronSpec, f) for f in attrs.fields(NeuronSpec)] + [(MoESpec, f) for f in attrs.fields(MoESpec)]
    types_ = {**field_types(NeuronSpec), **field_types(MoESpec)}
    for cls, field in fields:
        if field.name in _SKIP:
            continue
        group = moe_group if cls is MoESpec else groups[info_of(NeuronSpec, field.name).group or Group.GENERAL]
        help_ = reference.field_help(field.name, cls)
        flag = "--" + field.name.replace("_", "-")
        tp = types_[field.name]
        if tp is bool or tp == (bool | None):
            group.add_argument(
                flag, dest=f"nc_{field.name}", action=argparse.BooleanOptionalAction, default=None, help=help_
            )
            continue
        simple = _scalar(tp)
        if simple is None:
            continue
        kind, choices, nargs = simple
        kw: dict[str, Any] = {
            "type": kind,
            "default": None,
            "dest": f"nc_{field.name}",
            "help": help_,
            "metavar": field.name.upper(),
        }
        if choices:
            kw["choices"] = choices
            kw.pop("metavar")  # argparse shows the choices
        if nargs:
            kw["nargs"] = nargs
        group.add_argument(flag, **kw)
    for field in attrs.fields(HybridShardingSpec):  # `--moe-cte-tp-degree 4` fills hybrid_sharding_config
        help_ = f"hybrid_sharding_config.{field.name}: {reference.field_help(field.name, HybridShardingSpec)}"
        flag = "--" + field.name.replace("_", "-")
        moe_group.add_argument(flag, type=int, default=None, dest=f"{_HYBRID}{field.name}", help=help_)


_HYBRID = "nc_hybrid__"
"""The namespace prefix of the hybrid_sharding_config flags."""


def neuron_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The NeuronConfig kwargs the user gave on the command line (the hybrid sharding flags as one
    `hybrid_sharding_config` dict)."""
    given = {k: v for k, v in vars(args).items() if k.startswith("nc_") and v is not None}
    hybrid = {k.removeprefix(_HYBRID): v for k, v in given.items() if k.startswith(_HYBRID)}
    out = {k.removeprefix("nc_"): v for k, v in given.items() if not k.startswith(_HYBRID)}
    return out | ({"hybrid_sharding_config": hybrid} if hybrid else {})

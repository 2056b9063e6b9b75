"""Typed coercion of raw config values (user kwargs, JSON) into spec field values. Pure.

Specs declare their fields with ordinary type annotations; `coerce` checks a raw value against
such an annotation (bool, int, float, str, Literal, X | None, tuple[X, ...], JsonMap) and returns
the converted value or a `Problem` naming the field. This keeps one door for untrusted input.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from nxdi.core.errors import Problem

_FLOAT_WORDS = {"inf": math.inf, "infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf, "nan": math.nan}


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return JsonMap(items=tuple((str(k), _freeze(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, JsonMap):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@attrs.frozen(kw_only=True)
class JsonMap:
    """An immutable, hashable JSON object (for free-form config dicts such as `token_tree_config`)."""

    items: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, Any]) -> JsonMap:
        frozen = _freeze(mapping)
        assert isinstance(frozen, JsonMap)
        return frozen

    def to_dict(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.items}

    def get(self, key: str, default: Any = None) -> Any:
        return next((v for k, v in self.items if k == key), default)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """A ' Did you mean ...?' suffix with the closest known names, or empty."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Bad(Exception):
    """Internal: a raw value does not fit its annotation."""


def _coerce(value: Any, tp: Any) -> Any:  # one branch per kind of annotation
    origin = typing.get_origin(tp)
    if tp is Any:
        return _freeze(value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg)
            except _Bad:
                continue
        raise _Bad
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise _Bad
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Bad
        (item, *_) = typing.get_args(tp)
        return tuple(_coerce(v, item) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _Bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value.strip().lower() in _FLOAT_WORDS:
            return _FLOAT_WORDS[value.strip().lower()]
        raise _Bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Bad
    if tp is JsonMap:
        if isinstance(value, JsonMap):
            return value
        if isinstance(value, Mapping):
            return JsonMap.of(value)
        raise _Bad
    raise TypeError(f"no coercion for annotation {tp!r}")


def coerce(field: str, value: Any, tp: Any) -> tuple[Any, Problem | None]:
    """Convert `value` to annotation `tp`; on mismatch return a problem naming `field` and the expected type."""
    try:
        return _coerce(value, tp), None
    except _Bad:
        return None, Problem.of(field, value, f"must be {_type_name(tp)}")


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotation of every attrs field of `cls`, by name."""
    return typing.get_type_hints(cls)


def json_value(value: Any) -> Any:
    """A spec field value as standard JSON: tuples to lists, JsonMap to dict, inf/nan to strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, JsonMap):
        return {k: json_value(v) for k, v in value.items}
    if isinstance(value, tuple):
        return [json_value(v) for v in value]
    return value

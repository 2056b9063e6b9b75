"""Config fields: how they are declared (docs and facts as metadata) and how raw values are coerced. Pure.

Declaration: every field of a config value is declared once with `setting(default, doc, ...)`,
which stores a `FieldInfo` in the attrs metadata: the one-line documentation, the group it is
listed under, whether it changes a compiled graph, what it does on the CPU backend, and whether it
holds a dtype name. Everything else (the graph key, dtype conversion in the shell, the CPU checks,
the CLI help, `nxdi config --list`, docs/neuron-config.md) is derived from that metadata.

Coercion: `coerce` checks a raw value (user kwargs, JSON) against a field's type annotation (bool,
int, float, str, Literal, X | None, tuple[X, ...], JsonMap) and returns the converted value or a
`Problem` naming the field. This keeps one door for untrusted input.
"""

from __future__ import annotations

import difflib
import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from nxdi.core.errors import Problem


class Group(enum.Enum):
    """The groups the NeuronConfig attributes are listed in (the seeds' grouping)."""

    GENERAL = "General"
    DISTRIBUTED = "Distributed"
    ATTENTION = "Attention"
    BATCHING = "Continuous batching"
    SAMPLING = "On-device sampling"
    BUCKETING = "Bucketing"
    QUANTIZATION = "Quantization"
    SPECULATION = "Speculative decoding"
    PAGED = "Paged attention, prefix caching and chunked prefill"
    LORA = "Multi-LoRA serving"
    KERNELS = "Kernels"
    COMPILER = "Compiler"
    DEBUGGING = "Debugging"
    MOE = "Mixture of experts"


class OnCpu(enum.Enum):
    """What a setting does on the CPU backend."""

    YES = "yes"
    """It takes effect."""
    NO = "no effect"
    """Accepted and saved, but the CPU backend cannot honour it; a model warns when it is set."""
    REFUSED = "refused"
    """Not implemented on the CPU engine yet; a model refuses any value but the default."""
    WITH_TP = "with tp_degree > 1"
    """It takes effect when tp_degree > 1; with one rank it has none (a model warns, as for NO)."""
    WITH_QUANTIZED = "with quantized=True"
    """It takes effect when quantized=True; without it it has none (a model warns, as for NO)."""
    WITH_MEDUSA = "with is_medusa=True"
    """It takes effect when is_medusa=True; without it it has none (a model warns, as for NO)."""
    WITH_FUSED = "with enable_fused_speculation=True"
    """It takes effect under fused speculation; without it it has none (a model warns, as for NO)."""


@attrs.frozen(kw_only=True)
class FieldInfo:
    """What nxdi declares about one config field (attrs metadata under `INFO`)."""

    doc: str
    """One line: what it does, its unit, its default (derived defaults named), its range."""
    group: Group | None = None
    """Where it is listed (sub-config fields are listed under their config)."""
    graph: bool = True
    """Whether changing it changes a compiled graph (what the graph key hashes)."""
    cpu: OnCpu = OnCpu.YES
    cpu_note: str = ""
    """Why it has no effect on the CPU backend, when it has none."""
    dtype: bool = False
    """It holds a dtype name (the shell shows it as a torch.dtype)."""
    bounds: tuple[int, int] | None = None
    """The inclusive range of an integer setting (of each integer of a list), enforced by its validator."""


INFO = "nxdi"

# Upper bounds of the integer settings. Far above any deployment (the largest instances have 128
# NeuronCores, contexts reach millions of tokens), low enough that a typo or an overflowed value
# (`batch_size=2**63`) is refused by the parser instead of reaching an allocation.
MAX_BATCH = 1 << 16
"""Most sequences in any batch setting (batch_size, kv_cache_batch_size, ...): 65536."""
MAX_TOKENS = 1 << 24
"""Most tokens in any length setting (seq_len, buckets, tile sizes, thresholds, ...): 16777216."""
MAX_DEGREE = 512
"""Largest parallel degree (tp_degree, cp_degree, ...), in ranks: 512."""
MAX_COUNT = 1 << 16
"""Most items in any count setting (adapters, heads, draft tokens, blocks per tile, ...): 65536."""
MAX_SIZE = 1 << 20
"""Largest size of a tensor dimension or memory unit (padded hidden size, block size, page size): 1048576."""
MAX_VOCAB = 1 << 24
"""Largest token count of a sampling setting (top_k, global_topk): 16777216."""
MAX_LNC = 8
"""Most physical NeuronCores per logical core (logical_nc_config; platforms use 1 or 2): 8."""
MAX_AXES = 64
"""Largest tensor axis index, either sign, of an axis setting (quantization_block_axis): 64."""


@attrs.frozen
class Within:
    """An attrs validator: the value lies in [low, high]. None passes (optional settings), and for a
    list (nested or not) every integer in it must."""

    low: int
    high: int

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        for v in _ints(value):
            if v < self.low:
                raise ValueError(f"'{attribute.name}' must be >= {self.low}: {value!r}")
            if v > self.high:
                raise ValueError(f"'{attribute.name}' must be <= {self.high}: {value!r}")


def _ints(value: Any) -> Iterable[int]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _ints(v)
    elif isinstance(value, int) and not isinstance(value, bool):
        yield value


"""The attrs metadata key of a field's FieldInfo."""


def setting(
    default: Any,
    doc: str,
    *,
    group: Group | None = None,
    graph: bool = True,
    cpu: OnCpu | str = OnCpu.YES,
    cpu_note: str = "",
    dtype: bool = False,
    validator: Callable[..., Any] | list[Callable[..., Any]] | None = None,
    bounds: tuple[int, int] | None = None,
) -> Any:
    """An attrs field declared with its documentation and facts (see `FieldInfo`).

    `cpu` given as a string means "no effect on the CPU backend, because <string>" (OnCpu.NO).
    `bounds` (low, high) adds a `Within` validator and is listed in the reference.
    """
    effect, note = (OnCpu.NO, cpu) if isinstance(cpu, str) else (cpu, cpu_note)
    info = FieldInfo(doc=doc, group=group, graph=graph, cpu=effect, cpu_note=note, dtype=dtype, bounds=bounds)
    if bounds is not None:
        given = [] if validator is None else validator if isinstance(validator, list) else [validator]
        validator = [*given, Within(*bounds)]
    return attrs.field(default=default, validator=validator, metadata={INFO: info})


def info_of(cls: type, name: str) -> FieldInfo:
    """The FieldInfo of field `name` of attrs class `cls` (a bare FieldInfo when it declares none)."""
    found = attrs.fields_dict(cls)[name].metadata.get(INFO)
    return found if isinstance(found, FieldInfo) else FieldInfo(doc="")


def infos(cls: type) -> dict[str, FieldInfo]:
    """FieldInfo of every field of `cls`, in declaration order."""
    return {f.name: info_of(cls, f.name) for f in attrs.fields(cls)}


_FLOAT_WORDS = {"inf": math.inf, "infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf, "nan": math.nan}


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return JsonMap(items=tuple((str(k), _freeze(v)) for k, v in value.items()))
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
    """An immutable, hashable JSON object (for free-form config dicts such as `token_tree_config`).
    Its keys keep the order they were given in, as a JSON object's do: some settings number their
    entries by it (`lora_ckpt_paths`: the i-th adapter is NxDI's adapter index i)."""

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


def sub_spec_fields(cls: type) -> dict[str, type]:
    """The fields of `cls` that hold another attrs value (a sub-spec, possibly optional), by name."""
    out: dict[str, type] = {}
    for name, tp in field_types(cls).items():
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and isinstance(inner[0], type) and attrs.has(inner[0]) and inner[0] is not JsonMap:
            out[name] = inner[0]
    return out


def to_json(value: Any, *, graph_only: bool = False) -> Any:
    """A config value as standard JSON (the one converter the core has).

    attrs values become dicts of their fields (with `graph_only`, without the fields declared
    `graph=False`), JsonMaps and mappings dicts, tuples and lists lists, enums their values, and
    non-finite floats the strings "inf", "-inf" and "nan" (standard JSON has no Infinity).
    """
    if isinstance(value, JsonMap):
        return {k: to_json(v, graph_only=graph_only) for k, v in value.items}
    if attrs.has(type(value)):
        names = [f.name for f in attrs.fields(type(value)) if not graph_only or info_of(type(value), f.name).graph]
        return {n: to_json(getattr(value, n), graph_only=graph_only) for n in names}
    if isinstance(value, Mapping):
        return {str(k): to_json(v, graph_only=graph_only) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, graph_only=graph_only) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value

"""NeuronConfig and its sub-configs: NxDI's mutable-looking classes over immutable core specs.

Each object holds a validated frozen spec plus the kwargs the user gave. Reading an attribute
reads the spec (dtypes come back as `torch.dtype`, bucket tuples as lists, as in NxDI).
Assigning one (`cfg.speculation_length = 0`) re-parses the given kwargs with the new value and
swaps the spec, so derived defaults follow. A value bad on its own raises IncompatibleConfigError
at once and leaves the object unchanged; a broken cross-field rule waits for the next assignment
(see `NeuronConfig.__setattr__`); `update()` checks everything at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
from returns.result import Failure

from nxdi.core.config import codec, neuron_checks, neuron_parse
from nxdi.core.config.fields import JsonMap, did_you_mean, sub_spec_fields, to_json
from nxdi.core.config.neuron_spec import DERIVED, NeuronSpec
from nxdi.core.config.sub_specs import (
    ChunkedPrefillSpec,
    HybridShardingSpec,
    LoraSpec,
    MoESpec,
    OnDeviceSamplingSpec,
    RouterSpec,
    parse_sub,
)
from nxdi.core.errors import ConfigError
from nxdi.core.platform import Platform
from nxdi.effects import env as env_mod
from nxdi.effects import lora_adapters as lora_io
from nxdi.shell.exceptions import exception_for, unwrap

_SUB_SPECS: dict[str, type] = {**sub_spec_fields(NeuronSpec), **sub_spec_fields(MoESpec)}


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def to_torch_dtype(name: str) -> Any:
    """`"bfloat16"` -> `torch.bfloat16` (torch is imported only when a dtype is read)."""
    import torch

    return getattr(torch, name)


def _platform() -> Platform:
    return env_mod.read_env().platform_target or Platform.TRN1


def present(value: Any, *, dtype: bool = False) -> Any:
    """A spec value as NxDI users read it (the shell's one presentation function): a torch dtype for
    a dtype name, lists for tuples, dicts for JsonMaps and for nested sub-specs."""
    if dtype and value is not None:
        return to_torch_dtype(value)
    if isinstance(value, JsonMap):
        return value.to_dict()
    if attrs.has(type(value)):
        return to_json(value)
    if isinstance(value, tuple):
        return [present(v) for v in value]
    return value


def _dtype_name(value: Any) -> Any:
    """A torch dtype as the name core takes (`torch.bfloat16` -> "bfloat16"); anything else unchanged."""
    return str(value).removeprefix("torch.") if _is_torch_dtype(value) else value


class _SubConfig:
    """Shared behaviour of the shell sub-configs: a spec, an owner to re-validate, attribute access."""

    _spec_cls: ClassVar[type]
    _dtype_fields: ClassVar[frozenset[str]] = frozenset()
    """Attributes read back as torch dtypes."""

    def __init__(self, spec: Any) -> None:
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_owner", None)

    @property
    def spec(self) -> Any:
        return self._spec

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in attrs.fields_dict(self._spec_cls):
            return present(getattr(self._spec, name), dtype=name in self._dtype_fields)
        if name in ("effective_max_loras",):
            return getattr(self._spec, name)
        known = attrs.fields_dict(self._spec_cls)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; {did_you_mean(name, known)}")

    def __setattr__(self, name: str, value: Any) -> None:
        field = _field_of(self._spec_cls)
        data = {**to_json(self._spec), name: _dtype_name(value)}
        new = unwrap(parse_sub(self._spec_cls, data, prefix=field))
        if self._owner is not None:
            self._owner._replace_sub(field, new)
        object.__setattr__(self, "_spec", new)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = to_json(self._spec)
        return out

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._spec == self._spec  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()})"


class OnDeviceSamplingConfig(_SubConfig):
    """Sampling inside the compiled model. Attributes: do_sample, top_k, top_p, temperature,
    dynamic, deterministic, global_topk, top_k_kernel_enabled, sampling_dp_degree.

    Raises:
        IncompatibleConfigError: an unknown attribute or an out-of-range value (all listed).
    """

    _spec_cls = OnDeviceSamplingSpec

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(unwrap(neuron_parse.parse_on_device_sampling(kwargs, platform=_platform())))


class ChunkedPrefillConfig(_SubConfig):
    """Chunked prefill: max_num_seqs, tkg_model_enabled, kernel_q_tile_size, kernel_kv_tile_size."""

    _spec_cls = ChunkedPrefillSpec

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(unwrap(parse_sub(ChunkedPrefillSpec, kwargs, prefix=_field_of(ChunkedPrefillSpec))))


class LoraServingConfig(_SubConfig):
    """Multi-LoRA serving. Checkpoint paths may be a list of `"id : path"` strings, a dict
    `{id: path}`, or a JSON file (`lora_ckpt_json`) with `lora-ckpt-dir`, `lora-ckpt-paths` and
    `lora-ckpt-paths-cpu`. Adapter configs on disk widen `target_modules` and `max_lora_rank`.

    Raises:
        FileNotFoundError: a path file or adapter checkpoint does not exist.
        IncompatibleConfigError: duplicate adapter ids, too many CPU adapters, bad values.
    """

    _spec_cls = LoraSpec

    def __init__(self, **kwargs: Any) -> None:
        raw = dict(kwargs)
        if raw.get("lora_ckpt_json"):
            for key, value in lora_io.read_paths_json(raw["lora_ckpt_json"]).items():
                raw.setdefault(key, value)
        parsed = unwrap(neuron_parse.parse_neuron_spec({"lora_config": raw})).spec.lora_config
        assert parsed is not None
        infos = []
        for key in ("lora_ckpt_paths", "lora_ckpt_paths_cpu"):
            paths = getattr(parsed, key)
            if paths is not None:
                lora_io.check_paths_exist(paths.to_dict(), f"lora_config.{key}")
                infos.extend(lora_io.read_adapter_info(p) for p in paths.to_dict().values())
        modules, rank = lora_io.merge_adapter_infos(
            infos, target_modules=parsed.target_modules, max_rank=parsed.max_lora_rank
        )
        super().__init__(attrs.evolve(parsed, target_modules=modules, max_lora_rank=rank))


class RouterConfig(_SubConfig):
    """The MoE router (NxD `RouterConfig`): `act_fn` ("softmax" or "sigmoid") and `dtype` (a torch
    dtype or its name; read back as a torch dtype). A `MoENeuronConfig(router_config=...)` takes one,
    or a dict, which wins over the `router_act_fn` / `router_dtype` kwargs.

    Raises:
        IncompatibleConfigError: another activation, or a dtype that is not a float type.
    """

    _spec_cls = RouterSpec
    _dtype_fields = frozenset({"dtype"})

    def __init__(self, act_fn: str = "softmax", dtype: Any = "float32") -> None:
        raw = {"act_fn": act_fn, "dtype": _dtype_name(dtype)}
        super().__init__(unwrap(parse_sub(RouterSpec, raw, prefix=_field_of(RouterSpec))))

    @staticmethod
    def from_kwargs(**kwargs: Any) -> RouterConfig:
        """From the `router_act_fn` / `router_dtype` kwargs, as NxD builds it."""
        return RouterConfig(act_fn=kwargs.pop("router_act_fn", "softmax"), dtype=kwargs.pop("router_dtype", "float32"))


class HybridShardingConfig(_SubConfig):
    """Separate MoE degrees for context encoding and token generation (NxD `HybridShardingConfig`):
    `moe_cte_tp_degree` x `moe_cte_ep_degree` and `moe_tkg_tp_degree` x `moe_tkg_ep_degree` each
    equal tp_degree (checked with the config). When the two layouts differ every rank holds both,
    as NxD's `mlp_op` and `mlp_op_tkg` do. All default to 1, as in NxD.

    Raises:
        IncompatibleConfigError: an unknown attribute or a degree that is not a positive integer.
    """

    _spec_cls = HybridShardingSpec

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(unwrap(parse_sub(HybridShardingSpec, kwargs, prefix=_field_of(HybridShardingSpec))))


_SUB_CLASSES: Mapping[type, type[_SubConfig]] = {
    c._spec_cls: c
    for c in (OnDeviceSamplingConfig, LoraServingConfig, ChunkedPrefillConfig, RouterConfig, HybridShardingConfig)
}
"""The shell class of each sub-spec users configure through an object."""


def _field_of(spec_cls: type) -> str:
    """The NeuronConfig attribute holding a `spec_cls` value."""
    return next(name for name, cls in _SUB_SPECS.items() if cls is spec_cls)


def _normalize(value: Any) -> Any:
    """User values as core accepts them: dtype names, sub-specs instead of shell sub-configs."""
    if _is_torch_dtype(value):
        return str(value)
    if isinstance(value, _SubConfig):
        return value.spec
    if isinstance(value, Mapping):  # a sub-config as a dict: kv_quant_config={"quant_dtype": torch.float8_e5m2}
        return {k: _dtype_name(v) for k, v in value.items()}
    return value


class NeuronConfig:
    """Compile-time configuration for inference (every documented NeuronConfig attribute).

    Raises:
        IncompatibleConfigError: unknown attribute names (with suggestions), bad values, or
            violated cross-field rules, all listed in one message.
    """

    _moe: ClassVar[bool] = False
    _pending: ConfigError | None = None
    """The cross-field rules the assignments since the last consistent state break (None: none)."""
    _unsettled: tuple[str, ...] = ()
    """The attributes assigned since the last consistent state, for the message."""

    def __init__(self, **kwargs: Any) -> None:
        given = {k: _normalize(v) for k, v in kwargs.items()}
        self._install(given, self._parse(given))

    def _parse(self, given: Mapping[str, Any], *, rules: bool = True) -> neuron_parse.ParsedNeuronSpec:
        env = env_mod.read_env()
        result = neuron_parse.parse_neuron_spec(
            given,
            env_lnc=env.logical_nc_config,
            platform=env.platform_target or Platform.TRN1,
            moe=self._moe,
            rules=rules,
        )
        return unwrap(result, f"Invalid {type(self).__name__}")

    def _install(
        self,
        given: dict[str, Any],
        parsed: neuron_parse.ParsedNeuronSpec,
        pending: ConfigError | None = None,
        unsettled: tuple[str, ...] = (),
    ) -> None:
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_spec", parsed.spec)
        object.__setattr__(self, "_subs", {})
        object.__setattr__(self, "_pending", pending)
        object.__setattr__(self, "_unsettled", unsettled)
        for note in parsed.notes:
            warnings.warn(note, DeprecationWarning if "deprecated" in note else UserWarning, stacklevel=3)

    @classmethod
    def from_spec(cls, spec: NeuronSpec) -> NeuronConfig:
        """A NeuronConfig over an existing spec; every field counts as given."""
        self = cls.__new__(cls)
        self._install(neuron_parse.spec_kwargs(spec), neuron_parse.ParsedNeuronSpec(spec=spec))
        return self

    @property
    def spec(self) -> NeuronSpec:
        """The validated, immutable core spec.

        Raises:
            IncompatibleConfigError: assignments left a cross-field rule broken (see `__setattr__`).
        """
        self._settled()
        return self._spec

    def _settled(self) -> None:
        """Raise the rules that the assignments since the last consistent state break, if any."""
        if self._pending is not None:
            raise exception_for(
                self._pending,
                f"{type(self).__name__} is inconsistent after assigning {', '.join(self._unsettled)} "
                "(assign the related attributes too, or set them together with update(...))",
            )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        self._settled()
        spec = self._spec
        if _SUB_SPECS.get(name) in _SUB_CLASSES:
            return self._sub(name)
        if name in neuron_parse.FIELD_NAMES or name in DERIVED:
            return present(getattr(spec, name), dtype=name in neuron_parse.DTYPE_FIELDS)
        if self._moe and name in neuron_parse.MOE_FIELD_NAMES and spec.moe is not None:
            return self._sub(name) if _SUB_SPECS.get(name) in _SUB_CLASSES else present(getattr(spec.moe, name))
        if name == "logical_neuron_cores":
            warnings.warn("logical_neuron_cores is deprecated; use logical_nc_config", DeprecationWarning, stacklevel=2)
            return spec.logical_nc_config
        known = neuron_parse.known_names(moe=self._moe)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; {did_you_mean(name, known)}")

    def _sub(self, name: str) -> Any:
        value = getattr(self._spec.moe if name in neuron_parse.MOE_FIELD_NAMES else self._spec, name)
        if value is None:
            return None
        cached = self._subs.get(name)
        if cached is None or cached.spec != value:
            sub_cls = _SUB_CLASSES[type(value)]
            cached = sub_cls.__new__(sub_cls)
            _SubConfig.__init__(cached, value)
            object.__setattr__(cached, "_owner", self)
            self._subs[name] = cached
        return cached

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign one attribute (`cfg.seq_len = 512`); derived defaults follow.

        A value bad on its own (unknown name, wrong type, out of range) raises
        IncompatibleConfigError at once and leaves the config unchanged. A broken cross-field rule
        does not: clients set related attributes one at a time (vLLM's Neuron worker sets a fused
        speculation draft's `speculation_length = 0` before `enable_fused_speculation = False`), so
        the config takes the value and refuses every read and use, naming the rule, until a later
        assignment mends it.
        """
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._assign(name, value)

    def _assign(self, name: str, value: Any) -> None:
        given = {**self._given, name: _normalize(value)}
        parsed = self._parse(given, rules=False)
        match neuron_checks.check_neuron_spec(parsed.spec):
            case Failure(err):
                self._install(given, parsed, err, (*dict.fromkeys((*self._unsettled, name)),))
            case _:
                self._install(given, parsed)

    def update(self, **changes: Any) -> None:
        """Assign several attributes at once, re-validating once, cross-field rules included
        (all or nothing: on IncompatibleConfigError the config is unchanged)."""
        given = {**self._given, **{k: _normalize(v) for k, v in changes.items()}}
        parsed = self._parse(given)
        self._install(given, parsed)

    def _without_effect_on_cpu(self) -> tuple[str, ...]:
        """The settings given that the CPU backend accepts but cannot honour (see `OnCpu.NO`)."""
        env = env_mod.read_env()
        return neuron_parse.without_effect_on_cpu(
            self._given,
            self.spec,
            env_lnc=env.logical_nc_config,
            platform=env.platform_target or Platform.TRN1,
            moe=self._moe,
        )

    def _replace_sub(self, name: str, spec: Any) -> None:
        self._assign(name, spec)

    def to_dict(self) -> dict[str, Any]:
        """Every attribute, as neuron_config.json holds it."""
        return codec.neuron_spec_to_dict(self.spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeuronConfig) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._given.items())
        return f"{type(self).__name__}({shown})"


class MoENeuronConfig(NeuronConfig):
    """NeuronConfig plus the mixture-of-experts attributes (capacity_factor, glu_mlp, router, ...)."""

    _moe = True

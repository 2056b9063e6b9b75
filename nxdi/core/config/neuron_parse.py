"""NeuronConfig kwargs -> NeuronSpec: names, types, derived defaults, deprecated aliases. Pure.

Theory of operation:
1. Rewrite deprecated aliases (`logical_neuron_cores`, the old kernel flags, MoE router kwargs) and
   note each rewrite for the shell to warn about.
2. Reject unknown names (with "did you mean") and names the reference computes itself.
3. Coerce each value to its field's annotation; parse sub-spec dicts.
4. Fill derived defaults from what the user gave (max_context_length = seq_len, batch sizes =
   batch_size, LNC from env > kwarg > platform, ...). Re-parsing a spec's own fields gives the same
   spec, so JSON round trips and `cfg.x = y` re-validation are lossless.
5. Run the attrs validators and every cross-field rule; report all problems together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config import neuron_checks
from nxdi.core.config.fields import OnCpu, coerce, did_you_mean, field_types, infos, sub_spec_fields, to_json
from nxdi.core.config.neuron_spec import DERIVED, NeuronSpec
from nxdi.core.config.sub_specs import MoESpec, OnDeviceSamplingSpec, check_field, parse_sub
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.platform import Platform, resolve_lnc

_SUB_SPECS: Mapping[str, type] = sub_spec_fields(NeuronSpec)
"""NeuronSpec fields that hold a sub-spec (on-device sampling, LoRA, ...), by name."""
FIELD_NAMES = tuple(f.name for f in attrs.fields(NeuronSpec) if f.name != "moe")
"""The NeuronConfig attributes (MoE options live in `MOE_FIELD_NAMES`)."""
MOE_FIELD_NAMES = tuple(f.name for f in attrs.fields(MoESpec))
"""The attributes MoENeuronConfig adds."""
DTYPE_FIELDS = tuple(name for name, info in infos(NeuronSpec).items() if info.dtype)
"""Fields holding dtype names (the shell shows them as torch dtypes)."""


@attrs.frozen(kw_only=True)
class ParsedNeuronSpec:
    """A parsed spec plus notes (deprecations, overrides) for the shell to turn into warnings."""

    spec: NeuronSpec
    notes: tuple[str, ...] = ()


def known_names(*, moe: bool) -> tuple[str, ...]:
    """Every kwarg name NeuronConfig (or MoENeuronConfig when `moe`) accepts."""
    aliases = tuple(_ALIASES) + (_MOE_ALIASES + MOE_FIELD_NAMES if moe else ())
    return FIELD_NAMES + aliases


def _rewrite_aliases(raw: dict[str, Any], notes: list[str], problems: list[Problem]) -> None:
    """Apply deprecated and convenience aliases in place on the caller's private copy."""
    if "logical_neuron_cores" in raw:
        value = raw.pop("logical_neuron_cores")
        notes.append("logical_neuron_cores is deprecated; use logical_nc_config")
        raw.setdefault("logical_nc_config", value)
    if raw.pop("mlp_tkg_nki_kernel_enabled", False):
        notes.append("mlp_tkg_nki_kernel_enabled is deprecated; it turns on mlp_kernel_enabled")
        raw["mlp_kernel_enabled"] = True
    for old in ("attn_tkg_nki_kernel_enabled", "attn_tkg_builtin_kernel_enabled"):
        if raw.pop(old, False):
            notes.append(f"{old} is deprecated; it turns on attn_block_tkg_nki_kernel_enabled")
            raw["attn_block_tkg_nki_kernel_enabled"] = True
    if raw.get("attn_block_cte_nki_kernel_enabled"):
        implied = ("qkv_kernel_enabled", "qkv_nki_kernel_enabled", "attn_kernel_enabled", "out_proj_kernel_enabled")
        for name in implied:
            if raw.get(name) is False:
                problems.append(
                    Problem.of(name, False, "conflicts with attn_block_cte_nki_kernel_enabled=True, which needs it")
                )
            raw[name] = True


def _rewrite_moe(raw: dict[str, Any]) -> dict[str, Any]:
    """Pull MoENeuronConfig attributes (and their aliases) out of `raw` into a MoESpec dict."""
    moe = {name: raw.pop(name) for name in MOE_FIELD_NAMES if name in raw}
    if "disable_normalize_top_k_affinities" in raw:
        value = raw.pop("disable_normalize_top_k_affinities")
        moe.setdefault("normalize_top_k_affinities", not value if isinstance(value, bool) else value)
    router = {key: raw.pop(alias) for alias, key in _ROUTER_ALIASES.items() if alias in raw}
    given = moe.get("router_config")
    if router or isinstance(given, Mapping):
        # An explicit router_config takes precedence over the router_* kwargs, as in the reference.
        merged = {**router, **_as_dict(given)}
        if "dtype" in merged:
            merged["dtype"] = _dtype_name(merged["dtype"])
        moe["router_config"] = merged
    if isinstance(moe.get("capacity_factor"), int) and not isinstance(moe["capacity_factor"], bool):
        moe["capacity_factor"] = float(moe["capacity_factor"])
    return moe


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}


_ALIASES: Mapping[str, str] = {
    "logical_neuron_cores": "logical_nc_config",
    "mlp_tkg_nki_kernel_enabled": "mlp_kernel_enabled",
    "attn_tkg_nki_kernel_enabled": "attn_block_tkg_nki_kernel_enabled",
    "attn_tkg_builtin_kernel_enabled": "attn_block_tkg_nki_kernel_enabled",
}
_ROUTER_ALIASES: Mapping[str, str] = {"router_act_fn": "act_fn", "router_dtype": "dtype"}
_MOE_ALIASES = (*_ROUTER_ALIASES, "disable_normalize_top_k_affinities")


def _dtype_name(value: Any) -> Any:
    """Accept `torch.bfloat16`-style names (the shell passes torch dtypes as `str(dtype)`)."""
    return value.removeprefix("torch.") if isinstance(value, str) else value


def _lora_paths(value: Any, problems: list[Problem], field: str) -> Any:
    """`["id : path", ...]` strings -> {id: path}; duplicate ids are problems."""
    if not isinstance(value, (list, tuple)):
        return value
    out: dict[str, str] = {}
    for item in value:
        if not isinstance(item, str) or ":" not in item:
            problems.append(Problem.of(field, item, "entries must look like 'adapter_id : path'"))
            continue
        key, path = (part.strip() for part in item.split(":", 1))
        if key in out:
            problems.append(Problem.of(field, key, "is a duplicate adapter id", "give each adapter a unique id"))
        out[key] = path
    return out


def _parse_lora(value: Any, problems: list[Problem]) -> Any:
    if not isinstance(value, Mapping):
        return value
    raw = dict(value)
    for key in ("lora_ckpt_paths", "lora_ckpt_paths_cpu"):
        if key in raw:
            raw[key] = _lora_paths(raw[key], problems, f"lora_config.{key}")
    paths = raw.get("lora_ckpt_paths")
    if isinstance(paths, Mapping) and isinstance(raw.get("max_loras", 1), int):
        raw["max_loras"] = max(raw.get("max_loras", 1), len(paths))
    cpu = raw.get("lora_ckpt_paths_cpu")
    if isinstance(cpu, Mapping) and len(cpu) > raw.get("max_cpu_loras", 100):
        problems.append(
            Problem.of("lora_config.lora_ckpt_paths_cpu", len(cpu), "holds more adapters than max_cpu_loras")
        )
    if raw.get("dynamic_multi_lora") is None:
        raw.pop("dynamic_multi_lora", None)
    return raw


def parse_on_device_sampling(raw: Any, *, platform: Platform) -> Result[OnDeviceSamplingSpec, ConfigError]:
    """An OnDeviceSamplingSpec from kwargs (or a spec, returned as is).

    `top_k_kernel_enabled` defaults to True on every platform but trn1, as in the reference.

    Returns:
        `Failure` listing every unknown name and bad value under `on_device_sampling_config.`.
    """
    if isinstance(raw, Mapping):
        raw = {"top_k_kernel_enabled": platform is not Platform.TRN1, **raw}
    return parse_sub(OnDeviceSamplingSpec, raw, prefix="on_device_sampling_config")


def _coerce_given(raw: Mapping[str, Any], platform: Platform, problems: list[Problem]) -> dict[str, Any]:
    types_ = field_types(NeuronSpec)
    given: dict[str, Any] = {}
    for name, value in raw.items():
        if name in _SUB_SPECS and value is not None:
            if name == "lora_config":
                value = _parse_lora(value, problems)
            if name == "kv_quant_config" and isinstance(value, Mapping) and "quant_dtype" in value:
                value = {**value, "quant_dtype": _dtype_name(value["quant_dtype"])}
            parsed = (
                parse_on_device_sampling(value, platform=platform)
                if name == "on_device_sampling_config"
                else parse_sub(_SUB_SPECS[name], value, prefix=name)
            )
            match parsed:
                case Success(sub):
                    given[name] = sub
                case Failure(err):
                    problems.extend(err.problems)
            continue
        converted, problem = coerce(name, _dtype_name(value) if name in DTYPE_FIELDS else value, types_[name])
        if problem:
            problems.append(problem)
        else:
            given[name] = converted
    return given


def _derive(given: Mapping[str, Any], *, env_lnc: int | None, platform: Platform, notes: list[str]) -> dict[str, Any]:
    """Fill every default that depends on other fields, from the values the user gave."""
    g = dict(given)
    seq_len = g.setdefault("seq_len", 128)
    batch = g.setdefault("batch_size", 1)
    for name in ("n_active_tokens", "n_positions", "max_context_length", "max_length", "pa_block_size"):
        g.setdefault(name, seq_len)
    g.setdefault("max_new_tokens", (seq_len - g["max_context_length"]) or None)
    for name in ("ctx_batch_size", "tkg_batch_size", "max_batch_size", "spec_batch_size", "pa_num_blocks"):
        g.setdefault(name, batch)
    g.setdefault("overrides_torch_dtype", "torch_dtype" in given)
    if g.get("enable_eagle_speculation") and not g.get("is_eagle_draft"):
        # EAGLE runs as fused speculation; an EAGLE draft's config (a copy of its target's) is not fused itself.
        g["enable_fused_speculation"] = True
    g.setdefault("local_ranks_size", g.get("tp_degree", 1) * g.get("pp_degree", 1) * g.get("ep_degree", 1))
    target = Platform(g["target"]) if g.get("target") else platform
    lnc, lnc_notes = resolve_lnc(env=env_lnc, requested=given.get("logical_nc_config"), platform=target)
    g["logical_nc_config"] = lnc
    notes.extend(lnc_notes)
    if g.get("scratchpad_page_size") is None and g["max_context_length"] >= 32768:
        g["scratchpad_page_size"] = 1024
    if g.get("quantized_mlp_kernel_enabled") or g.get("activation_quantization_type"):
        g.setdefault("quantization_type", "per_channel_symmetric")
        g.setdefault("quantization_dtype", "f8e4m3")
    for name in ("context_encoding_buckets", "token_generation_buckets", "token_generation_batches", "prefix_buckets"):
        if g.get(name) is not None:
            g[name] = tuple(sorted(g[name]))
    _derive_dp(g, target)
    lora = g.get("lora_config")
    if lora is not None and lora.dynamic_multi_lora:
        skip = tuple(g.get("weights_to_skip_layout_optimization", ()))
        g["weights_to_skip_layout_optimization"] = skip if ".*lora.*" in skip else (*skip, ".*lora.*")
    if g.get("tensor_capture_config") is not None:
        g["output_logits"] = True
    g.setdefault("kv_cache_batch_size", batch)
    return g


def _derive_dp(g: dict[str, Any], platform: Platform) -> None:
    """Attention data parallelism resizes the KV cache per DP group (REFERENCE §2.1)."""
    dp = g.get("attention_dp_degree", 1)
    if dp <= 1:
        return
    g.setdefault("kv_cache_batch_size", g["tkg_batch_size"] // dp)
    cascaded = g.get("attn_block_tkg_nki_kernel_cascaded_attention", False)
    if platform is Platform.TRN1 or not cascaded:
        g.setdefault("kv_cache_padding_size", 1)
    else:
        g.setdefault("kv_cache_update_with_kernel", True)
        g.setdefault("kv_cache_padding_size", 0)


def parse_neuron_spec(
    kwargs: Mapping[str, Any],
    *,
    env_lnc: int | None = None,
    platform: Platform = Platform.TRN1,
    moe: bool = False,
    rules: bool = True,
) -> Result[ParsedNeuronSpec, ConfigError]:
    """Build a NeuronSpec from NeuronConfig kwargs (or a neuron_config.json dict).

    Args:
        kwargs: attribute names to values; dtypes as names, sub-configs as specs or dicts.
        env_lnc: NEURON_LOGICAL_NC_CONFIG as read by effects, if set.
        platform: the platform to default LNC and kernel flags for, unless `target` is given.
        moe: accept MoENeuronConfig attributes too.
        rules: also run the cross-field rules (`neuron_checks.check_neuron_spec`); without them
            only each value is checked on its own (what a single attribute assignment refuses).

    Returns:
        `Success(ParsedNeuronSpec)`, or `Failure(ConfigError)` listing every unknown name, bad
        type, out-of-range value and (with `rules`) violated cross-field rule.
    """
    raw = dict(kwargs)
    notes: list[str] = []
    problems: list[Problem] = []
    _rewrite_aliases(raw, notes, problems)
    moe_raw = _rewrite_moe(raw) if moe else {}
    known = known_names(moe=moe)
    for name in [n for n in raw if n not in FIELD_NAMES]:
        value = raw.pop(name)
        if name in DERIVED:
            problems.append(Problem.of(name, value, "is computed by nxdi, not set", "remove it"))
        else:
            problems.append(Problem.of(name, value, "is not a NeuronConfig attribute", did_you_mean(name, known)))
    given = _coerce_given(raw, platform, problems)
    if moe:
        match parse_sub(MoESpec, moe_raw, prefix="moe"):
            case Success(m):
                given["moe"] = m
            case Failure(err):
                problems.extend(attrs.evolve(p, field=p.field.removeprefix("moe.")) for p in err.problems)
    bad = [p for name, v in given.items() if (p := check_field(NeuronSpec, name, v, "")) is not None]
    problems.extend(bad)
    valid = {k: v for k, v in given.items() if k not in {p.field for p in bad}}
    values = _derive(valid, env_lnc=env_lnc, platform=platform, notes=notes)
    derived_bad = [p for name, v in values.items() if (p := check_field(NeuronSpec, name, v, "")) is not None]
    if derived_bad:
        return Failure(ConfigError(problems=tuple(problems or derived_bad)))
    # Cross-field rules run on the valid part too, so one call reports every problem.
    spec = NeuronSpec(**values)
    seen = {p.field for p in problems}
    match neuron_checks.check_neuron_spec(spec) if rules else Success(spec):
        case Failure(err):
            problems.extend(p for p in err.problems if p.field not in seen)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    return Success(ParsedNeuronSpec(spec=spec, notes=tuple(notes)))


def spec_kwargs(spec: NeuronSpec) -> dict[str, Any]:
    """The spec's own fields as kwargs: `parse_neuron_spec(spec_kwargs(s))` gives `s` back."""
    out = {f.name: getattr(spec, f.name) for f in attrs.fields(NeuronSpec) if f.name != "moe"}
    if spec.moe is not None:
        out.update({f.name: getattr(spec.moe, f.name) for f in attrs.fields(MoESpec)})
    return out


def _without(value: Any, names: frozenset[str]) -> Any:
    """A sub-spec value (spec or dict) as a dict without the fields `names`."""
    raw = to_json(value) if attrs.has(type(value)) else value
    return {k: v for k, v in raw.items() if k not in names} if isinstance(raw, Mapping) else raw


def without_effect_on_cpu(
    given: Mapping[str, Any],
    spec: NeuronSpec,
    *,
    env_lnc: int | None = None,
    platform: Platform = Platform.TRN1,
    moe: bool = False,
) -> tuple[str, ...]:
    """The settings of `spec` declared `OnCpu.NO` (and `OnCpu.WITH_TP` when tp_degree is 1,
    `OnCpu.WITH_QUANTIZED` when not quantized, `OnCpu.WITH_MEDUSA` without is_medusa,
    `OnCpu.WITH_FUSED` without fused speculation) that `given` (the kwargs `spec` was parsed from)
    moves off the value they would have had if not given, their derived defaults included;
    sub-spec fields are named `config.field`. The shell warns about them."""
    inert = (OnCpu.NO, *((OnCpu.WITH_TP,) if spec.tp_degree == 1 else ()))
    inert += () if spec.quantized else (OnCpu.WITH_QUANTIZED,)
    inert += () if spec.is_medusa else (OnCpu.WITH_MEDUSA,)
    inert += () if spec.enable_fused_speculation else (OnCpu.WITH_FUSED,)
    no_effect = {n for n, i in infos(NeuronSpec).items() if i.cpu in inert}
    nested = {
        name: frozenset(n for n, i in infos(cls).items() if i.cpu is OnCpu.NO) for name, cls in _SUB_SPECS.items()
    }
    rest = {k: (_without(v, nested[k]) if k in nested and v is not None else v) for k, v in given.items()}
    rest = {k: v for k, v in rest.items() if k not in no_effect}
    parsed = parse_neuron_spec(rest, env_lnc=env_lnc, platform=platform, moe=moe)
    base = parsed.map(lambda p: p.spec).value_or(NeuronSpec())
    found = [n for n in FIELD_NAMES if n in no_effect and getattr(spec, n) != getattr(base, n)]
    for name, fields in nested.items():
        mine, theirs = getattr(spec, name), getattr(base, name)
        if mine is not None and theirs is not None:
            found.extend(f"{name}.{f}" for f in sorted(fields) if getattr(mine, f) != getattr(theirs, f))
    return tuple(found)

"""Reading a Hugging Face `config.json` dict: typed fields, every problem recorded. Pure.

The family records' readers (`FamilyRecord.read`) build ModelSpec fields with a `ConfigReader` and
the shared helpers here (heads, RoPE, experts, special tokens), so raw HF JSON enters nxdi through
one door and every missing or inconsistent key is reported at once, named by its dotted path
(`rope_scaling.rope_type`, `attn_config.kv_n_heads`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.model_spec import ACTIVATIONS, RopeKind, RopeSpec


class ConfigReader:
    """Reads typed fields from a raw Hugging Face config dict, recording every problem instead of stopping.

    A key that is absent or `null` takes its default.
    """

    def __init__(self, raw: Mapping[str, Any], prefix: str = "") -> None:
        self.raw = raw
        self.prefix = prefix
        self.problems: list[Problem] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def sub(self, key: str) -> ConfigReader:
        """A reader over the nested object at `key` (empty when absent), sharing this reader's problems."""
        v = self.raw.get(key)
        if v is not None and not isinstance(v, Mapping):
            self.problems.append(Problem.of(self.name(key), v, "must be an object"))
        return ConfigReader(v if isinstance(v, Mapping) else {}, f"{self.name(key)}.").sharing(self)

    def sharing(self, other: ConfigReader) -> ConfigReader:
        """This reader, recording its problems in `other`'s list."""
        self.problems = other.problems
        return self

    def int_(self, key: str, default: int | None = None, *, required: bool = True) -> int | None:
        v = self.raw.get(key)
        v = default if v is None else v
        if v is None:
            if required:
                self.problems.append(Problem.missing(self.name(key), f"set {key!r} in config.json"))
            return None
        if isinstance(v, float) and v.is_integer() and v > 0:
            return int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            self.problems.append(Problem.of(self.name(key), v, "must be a positive integer"))
            return None
        return v

    def opt_int(self, key: str) -> int | None:
        v = self.raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            self.problems.append(Problem.of(self.name(key), v, "must be a non-negative integer or null"))
            return None
        return v

    def opt_float(self, key: str, *, positive: bool = False) -> float | None:
        """A finite number (NaN and infinities are refused, in either of their JSON spellings), or None
        when absent; with `positive`, also above 0."""
        v = self.raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.problems.append(Problem.of(self.name(key), v, "must be a finite number or null"))
            return None
        if positive and v <= 0:
            self.problems.append(Problem.of(self.name(key), v, "must be a positive number"))
            return None
        return float(v)

    def float_(self, key: str, default: float, *, positive: bool = False) -> float:
        v = self.opt_float(key, positive=positive)
        return default if v is None else v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.raw.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(Problem.of(self.name(key), v, "must be true or false"))
            return default
        return v

    def activation(self, key: str, default: str) -> str:
        v = self.raw.get(key)
        v = default if v is None else v
        if not isinstance(v, str) or v not in ACTIVATIONS:
            known = ", ".join(sorted(ACTIVATIONS))
            self.problems.append(Problem.of(self.name(key), v, f"is not a supported activation ({known})"))
            return default
        return v


def _eos_ids(r: ConfigReader) -> tuple[int, ...]:
    v = r.raw.get("eos_token_id")
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        r.problems.append(Problem.of(r.name("eos_token_id"), v, "must be a non-negative integer or a list of them"))
        return ()
    return tuple(items)


def tokens(r: ConfigReader, defaults: Mapping[str, object] | None = None) -> dict[str, Any]:
    """pad, bos and eos token ids; `defaults` for the keys the config lacks (a null stays None, as in
    transformers' configs)."""
    if defaults:
        r = ConfigReader({**defaults, **r.raw}, r.prefix).sharing(r)
    return dict(
        pad_token_id=r.opt_int("pad_token_id"), bos_token_id=r.opt_int("bos_token_id"), eos_token_ids=_eos_ids(r)
    )


def heads(
    r: ConfigReader,
    *,
    hidden_key: str,
    heads_key: str,
    kv: tuple[ConfigReader, str, int | None] | None = None,
    head_dim_key: str | None = None,
    head_dim_default: int | None = None,
) -> dict[str, Any]:
    """Hidden size, query heads, kv heads and head_dim, with their divisibility rules.

    `kv` is (reader, key, default) for the kv-head count; None means multi-head attention (K = H).
    A head_dim given under `head_dim_key` wins, then `head_dim_default` (Gemma 3's 256); otherwise
    hidden_size must be divisible by the head count.
    """
    hidden, heads = r.int_(hidden_key), r.int_(heads_key)
    k = heads
    if kv is not None:
        kv_reader, kv_key, kv_default = kv
        k = kv_reader.int_(kv_key, heads if kv_default is None else kv_default, required=heads is not None)
        if heads is not None and k is not None and heads % k:
            why = f"does not divide {heads_key}={heads}"
            r.problems.append(Problem.of(kv_reader.name(kv_key), k, why, "use a kv-head count that divides it"))
    head_dim = r.int_(head_dim_key) if head_dim_key and r.raw.get(head_dim_key) is not None else head_dim_default
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            why = f"is not divisible by {heads_key}={heads}"
            fix = f"set {head_dim_key} explicitly" if head_dim_key else f"use a {heads_key} that divides it"
            r.problems.append(Problem.of(r.name(hidden_key), hidden, why, fix))
        head_dim = hidden // heads
    return dict(hidden_size=hidden, num_attention_heads=heads, num_kv_heads=k, head_dim=head_dim)


def experts(r: ConfigReader, *, experts: tuple[str, int], top_k: tuple[str, int]) -> dict[str, Any]:
    """Experts per MoE layer and experts chosen per token, which may not exceed them."""
    n, k = r.int_(*experts), r.int_(*top_k)
    if n is not None and k is not None and k > n:
        r.problems.append(Problem.of(r.name(top_k[0]), k, f"exceeds {r.name(experts[0])}={n}"))
    return dict(num_experts=n, num_experts_per_tok=k)


def rope(r: ConfigReader, *, legacy_theta: tuple[str, object] | None = None) -> RopeSpec | None:
    """RoPE from either the newer `rope_parameters` or the legacy `rope_theta` + `rope_scaling` layout.

    `legacy_theta` is (field name, value) of the base where the legacy layout keeps it; by default the
    top-level `rope_theta` (DBRX passes `attn_config.rope_theta`). Absent everywhere, the base is 10000.
    """
    key = "rope_parameters" if r.raw.get("rope_parameters") is not None else "rope_scaling"
    return rope_block(r.sub(key), theta=legacy_theta or ("rope_theta", r.raw.get("rope_theta")))


def rope_block(src: ConfigReader, *, theta: tuple[str, object], default_theta: float = 10000.0) -> RopeSpec | None:
    """RoPE from one block of RoPE parameters (`src`: its rope_type, factor, ...).

    The block's own `rope_theta` wins over `theta`, the (field name, value) of a base kept outside
    it; with neither, the base is `default_theta`. None when the block is invalid (problems recorded).
    """
    theta_key, value = theta
    if src.raw.get("rope_theta") is not None:
        theta_key, value = src.name("rope_theta"), src.raw["rope_theta"]
    value = default_theta if value is None else value
    base: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        base = float(value)
    if base is None:
        src.problems.append(Problem.of(theta_key, value, "must be a finite positive number"))
    type_key = "rope_type" if "rope_type" in src.raw else "type"
    kind_name = src.raw.get(type_key, "default")
    kind = next((k for k in RopeKind if k.value == kind_name), None)
    if kind is None:
        known = ", ".join(k.value for k in RopeKind)
        src.problems.append(Problem.of(src.name(type_key), kind_name, f"is not a supported RoPE type ({known})"))
    factor = src.float_("factor", 1.0)
    if kind not in (None, RopeKind.DEFAULT) and factor <= 0:
        src.problems.append(Problem.of(src.name("factor"), factor, "must be positive"))
    original = src.opt_int("original_max_position_embeddings")
    if kind is RopeKind.LLAMA3 and original is None:
        src.problems.append(Problem.missing(src.name("original_max_position_embeddings"), "llama3 RoPE needs it"))
    scaling: dict[str, Any] = dict(
        factor=factor,
        low_freq_factor=src.float_("low_freq_factor", 1.0, positive=True),
        high_freq_factor=src.float_("high_freq_factor", 4.0, positive=True),
        original_max_position_embeddings=original,
        beta_fast=src.float_("beta_fast", 32.0),
        beta_slow=src.float_("beta_slow", 1.0),
        attention_factor=src.opt_float("attention_factor", positive=True),
    )
    return None if base is None or kind is None else RopeSpec(theta=base, kind=kind, **scaling)

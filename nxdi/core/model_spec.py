"""Model architecture parsed from a Hugging Face `config.json` dict. Pure.

Raw HF JSON enters nxdi through one door, `parse_model_spec`, which reads the fields of each
supported family (llama, mistral, qwen2, qwen3, mixtral, dbrx for the engine; opt and gpt2 for the
planners), fills the family's defaults, and returns a `ModelSpec` or a `ConfigError` naming every
missing or inconsistent field.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem


class NormKind(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class PositionKind(enum.Enum):
    ROPE = "rope"
    LEARNED = "learned"


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


ACTIVATIONS = frozenset({"silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "swish"})


@attrs.frozen(kw_only=True)
class RopeSpec:
    """Rotary position embedding parameters."""

    theta: float = attrs.field(default=10000.0, validator=attrs.validators.gt(0))
    """Base of the inverse frequencies."""
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    """Context extension factor (linear, dynamic, llama3, yarn)."""
    low_freq_factor: float = 1.0
    """Llama-3 scaling: wavelengths longer than original_max/low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """Llama-3 scaling: wavelengths shorter than original_max/high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    """YaRN attention temperature; None means the standard 0.1*ln(factor)+1."""


@attrs.frozen(kw_only=True)
class ModelSpec:
    """A decoder-only transformer architecture, independent of how it is run."""

    model_type: str
    hidden_size: int = attrs.field(validator=attrs.validators.gt(0))
    num_attention_heads: int = attrs.field(validator=attrs.validators.gt(0))
    num_kv_heads: int = attrs.field(validator=attrs.validators.gt(0))
    head_dim: int = attrs.field(validator=attrs.validators.gt(0))
    num_layers: int = attrs.field(validator=attrs.validators.gt(0))
    vocab_size: int = attrs.field(validator=attrs.validators.gt(0))
    intermediate_size: int = attrs.field(validator=attrs.validators.gt(0))
    """FFN width; for MoE models the width of one expert."""
    max_position_embeddings: int = attrs.field(validator=attrs.validators.gt(0))
    norm: NormKind = NormKind.RMS
    norm_bias: bool = True
    """Whether LayerNorms carry a bias (OPT, GPT-2: yes; DBRX: no). RMS norms never do."""
    norm_eps: float = 1e-6
    activation: str = attrs.field(default="silu", validator=attrs.validators.in_(ACTIVATIONS))
    gated_mlp: bool = True
    """True for SwiGLU-style MLPs (gate, up, down); False for two-matrix MLPs (OPT, GPT-2)."""
    position: PositionKind = PositionKind.ROPE
    position_offset: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Learned positions: rows of the position table before position 0 (OPT reserves 2)."""
    rope: RopeSpec | None = RopeSpec()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3-style RMSNorm over each head of q and k before RoPE."""
    clip_qkv: float | None = None
    """DBRX: q, k and v are clamped to [-clip_qkv, clip_qkv] after projection; None for no clamp."""
    sliding_window: int | None = None
    num_experts: int = 0
    """Experts per MoE layer; 0 for dense models."""
    num_experts_per_tok: int = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def q_size(self) -> int:
        """Width of the query projection output (H * D)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one of the key/value projection outputs (K * D)."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self) -> int:
        """Parameter count of the checkpoint (tied embeddings counted once)."""
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = e * self.q_size + 2 * e * self.kv_size + self.q_size * e
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * e * f
        if self.mlp_bias:
            mlp += (2 * f if self.gated_mlp else f) + e
        if self.is_moe:
            mlp = mlp * self.num_experts + e * self.num_experts
        norm = 2 * e if self.norm is NormKind.LAYER and self.norm_bias else e
        layers = self.num_layers * (attn + mlp + 2 * norm)
        embed = v * e + (0 if self.tie_word_embeddings else v * e)
        rows = self.max_position_embeddings + self.position_offset
        learned = rows * e if self.position is PositionKind.LEARNED else 0
        return layers + embed + learned + norm


# Size note: this module runs past the ~400-line target because the family readers below, and the
# reader they share, are the single door for raw HF JSON; each piece is short, and splitting them
# across modules would split that door.


class _Reader:
    """Reads typed fields from a raw dict, recording every problem instead of stopping.

    A key that is absent or `null` takes its default.
    """

    def __init__(self, raw: Mapping[str, Any], prefix: str = "") -> None:
        self.raw = raw
        self.prefix = prefix
        self.problems: list[Problem] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def sub(self, key: str) -> _Reader:
        """A reader over the nested object at `key` (empty when absent), sharing this reader's problems."""
        v = self.raw.get(key)
        if v is not None and not isinstance(v, Mapping):
            self.problems.append(Problem.of(self.name(key), v, "must be an object"))
        child = _Reader(v if isinstance(v, Mapping) else {}, f"{self.name(key)}.")
        child.problems = self.problems
        return child

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

    def opt_float(self, key: str) -> float | None:
        v = self.raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.problems.append(Problem.of(self.name(key), v, "must be a number or null"))
            return None
        return float(v)

    def float_(self, key: str, default: float) -> float:
        v = self.opt_float(key)
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


def _eos_ids(r: _Reader) -> tuple[int, ...]:
    v = r.raw.get("eos_token_id")
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        r.problems.append(Problem.of("eos_token_id", v, "must be a non-negative integer or a list of them"))
        return ()
    return tuple(items)


def _tokens(r: _Reader) -> dict[str, Any]:
    return dict(
        pad_token_id=r.opt_int("pad_token_id"), bos_token_id=r.opt_int("bos_token_id"), eos_token_ids=_eos_ids(r)
    )


def _heads(
    r: _Reader,
    *,
    hidden_key: str,
    heads_key: str,
    kv: tuple[_Reader, str, int | None] | None = None,
    head_dim_key: str | None = None,
) -> dict[str, Any]:
    """Hidden size, query heads, kv heads and head_dim, with their divisibility rules.

    `kv` is (reader, key, default) for the kv-head count; None means multi-head attention (K = H).
    A head_dim given under `head_dim_key` wins; otherwise hidden_size must be divisible by the head count.
    """
    hidden, heads = r.int_(hidden_key), r.int_(heads_key)
    k = heads
    if kv is not None:
        kv_reader, kv_key, kv_default = kv
        k = kv_reader.int_(kv_key, heads if kv_default is None else kv_default, required=heads is not None)
        if heads is not None and k is not None and heads % k:
            why = f"does not divide {heads_key}={heads}"
            r.problems.append(Problem.of(kv_reader.name(kv_key), k, why, "use a kv-head count that divides it"))
    head_dim = r.int_(head_dim_key) if head_dim_key and r.raw.get(head_dim_key) is not None else None
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            why = f"is not divisible by {heads_key}={heads}"
            fix = f"set {head_dim_key} explicitly" if head_dim_key else f"use a {heads_key} that divides it"
            r.problems.append(Problem.of(r.name(hidden_key), hidden, why, fix))
        head_dim = hidden // heads
    return dict(hidden_size=hidden, num_attention_heads=heads, num_kv_heads=k, head_dim=head_dim)


def _experts(r: _Reader, *, experts: tuple[str, int], top_k: tuple[str, int]) -> dict[str, Any]:
    """Experts per MoE layer and experts chosen per token, which may not exceed them."""
    n, k = r.int_(*experts), r.int_(*top_k)
    if n is not None and k is not None and k > n:
        r.problems.append(Problem.of(r.name(top_k[0]), k, f"exceeds {r.name(experts[0])}={n}"))
    return dict(num_experts=n, num_experts_per_tok=k)


def _parse_rope(r: _Reader, *, legacy_theta: tuple[str, object] | None = None) -> RopeSpec | None:
    """RoPE from either the newer `rope_parameters` or the legacy `rope_theta` + `rope_scaling` layout.

    `legacy_theta` is (field name, value) of the base where the legacy layout keeps it; by default the
    top-level `rope_theta` (DBRX passes `attn_config.rope_theta`). Absent everywhere, the base is 10000.
    """
    key = "rope_parameters" if r.raw.get("rope_parameters") is not None else "rope_scaling"
    src = r.sub(key)
    theta_key, theta = legacy_theta or ("rope_theta", r.raw.get("rope_theta"))
    if src.raw.get("rope_theta") is not None:
        theta_key, theta = src.name("rope_theta"), src.raw["rope_theta"]
    theta = 10000.0 if theta is None else theta
    base = theta if isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0 else None
    if base is None:
        r.problems.append(Problem.of(theta_key, theta, "must be a positive number"))
    type_key = "rope_type" if "rope_type" in src.raw else "type"
    kind_name = src.raw.get(type_key, "default")
    kind = next((k for k in RopeKind if k.value == kind_name), None)
    if kind is None:
        known = ", ".join(k.value for k in RopeKind)
        r.problems.append(Problem.of(src.name(type_key), kind_name, f"is not a supported RoPE type ({known})"))
    factor = src.float_("factor", 1.0)
    if kind not in (None, RopeKind.DEFAULT) and factor <= 0:
        src.problems.append(Problem.of(src.name("factor"), factor, "must be positive"))
    original = src.opt_int("original_max_position_embeddings")
    if kind is RopeKind.LLAMA3 and original is None:
        src.problems.append(Problem.missing(src.name("original_max_position_embeddings"), "llama3 RoPE needs it"))
    scaling: dict[str, Any] = dict(
        factor=factor,
        low_freq_factor=src.float_("low_freq_factor", 1.0),
        high_freq_factor=src.float_("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        beta_fast=src.float_("beta_fast", 32.0),
        beta_slow=src.float_("beta_slow", 1.0),
        attention_factor=src.opt_float("attention_factor"),
    )
    return None if base is None or kind is None else RopeSpec(theta=float(base), kind=kind, **scaling)


def _llama_like(r: _Reader, model_type: str, **family: Any) -> dict[str, Any]:
    """Fields shared by llama, mistral, qwen2, qwen3 and mixtral configs."""
    bias = r.bool_("attention_bias", False)
    common = dict(
        model_type=model_type,
        **_heads(
            r,
            hidden_key="hidden_size",
            heads_key="num_attention_heads",
            kv=(r, "num_key_value_heads", None),
            head_dim_key="head_dim",
        ),
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("intermediate_size"),
        max_position_embeddings=r.int_("max_position_embeddings", 2048),
        norm_eps=r.float_("rms_norm_eps", 1e-6),
        activation=r.activation("hidden_act", "silu"),
        rope=_parse_rope(r),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=r.bool_("mlp_bias", False),
        **_tokens(r),
    )
    return common | family


def _llama(r: _Reader) -> dict[str, Any]:
    return _llama_like(r, "llama")


def _mistral(r: _Reader) -> dict[str, Any]:
    return _llama_like(r, "mistral", sliding_window=r.opt_int("sliding_window"))


def _window_if_used(r: _Reader) -> int | None:
    """Qwen's sliding window, which only applies when `use_sliding_window` is true."""
    return r.opt_int("sliding_window") if r.bool_("use_sliding_window", False) else None


def _qwen2(r: _Reader) -> dict[str, Any]:
    return _llama_like(r, "qwen2", qkv_bias=True, o_bias=False, sliding_window=_window_if_used(r))


def _qwen3(r: _Reader) -> dict[str, Any]:
    return _llama_like(r, "qwen3", qk_norm=True, sliding_window=_window_if_used(r))


def _mixtral(r: _Reader) -> dict[str, Any]:
    moe = _experts(r, experts=("num_local_experts", 8), top_k=("num_experts_per_tok", 2))
    return _llama_like(r, "mixtral", sliding_window=r.opt_int("sliding_window"), **moe)


def _dbrx(r: _Reader) -> dict[str, Any]:
    attn, ffn = r.sub("attn_config"), r.sub("ffn_config")
    clip = attn.opt_float("clip_qkv")
    if clip is not None and clip <= 0:
        attn.problems.append(Problem.of(attn.name("clip_qkv"), clip, "must be positive or null"))
    return dict(
        model_type="dbrx",
        **_heads(r, hidden_key="d_model", heads_key="n_heads", kv=(attn, "kv_n_heads", 1)),
        num_layers=r.int_("n_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=ffn.int_("ffn_hidden_size"),
        max_position_embeddings=r.int_("max_seq_len", 2048),
        norm=NormKind.LAYER,
        norm_bias=False,
        norm_eps=1e-5,
        activation=ffn.sub("ffn_act_fn").activation("name", "silu"),
        rope=_parse_rope(r, legacy_theta=(attn.name("rope_theta"), attn.raw.get("rope_theta"))),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        clip_qkv=clip,
        **_experts(ffn, experts=("moe_num_experts", 4), top_k=("moe_top_k", 1)),
        **_tokens(r),
    )


def _opt(r: _Reader) -> dict[str, Any]:
    bias = r.bool_("enable_bias", True)
    return dict(
        model_type="opt",
        **_heads(r, hidden_key="hidden_size", heads_key="num_attention_heads"),
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("ffn_dim"),
        max_position_embeddings=r.int_("max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=1e-5,
        activation=r.activation("activation_function", "relu"),
        gated_mlp=False,
        position=PositionKind.LEARNED,
        position_offset=2,
        rope=None,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        **_tokens(r),
    )


def _gpt2(r: _Reader) -> dict[str, Any]:
    heads = _heads(r, hidden_key="n_embd", heads_key="n_head")
    hidden = heads["hidden_size"]
    return dict(
        model_type="gpt2",
        **heads,
        num_layers=r.int_("n_layer"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("n_inner", 4 * hidden if hidden else None),
        max_position_embeddings=r.int_("n_positions", 1024),
        norm=NormKind.LAYER,
        norm_eps=r.float_("layer_norm_epsilon", 1e-5),
        activation=r.activation("activation_function", "gelu_new"),
        gated_mlp=False,
        position=PositionKind.LEARNED,
        rope=None,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        **_tokens(r),
    )


FAMILIES: Mapping[str, Callable[[_Reader], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "dbrx": _dbrx,
    "opt": _opt,
    "gpt2": _gpt2,
}
"""Parsers by HF `model_type`."""


def parse_model_spec(hf_config: Mapping[str, Any]) -> Result[ModelSpec, ConfigError]:
    """Parse a Hugging Face `config.json` dict.

    Returns:
        `Success(ModelSpec)`, or `Failure(ConfigError)` listing every missing or inconsistent field,
        each named by its key in the config (nested keys dotted, e.g. `rope_scaling.rope_type`):
        an unknown `model_type`, a missing or non-positive size, heads that do not divide, a bad
        RoPE block, an unsupported activation, more experts per token than experts, ...
    """
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        return Failure(ConfigError.of("model_type", model_type, f"is not a supported model family ({known})"))
    r = _Reader(hf_config)
    fields = family(r)
    if r.problems:
        return Failure(ConfigError(problems=tuple(r.problems)))
    return Success(ModelSpec(**fields))

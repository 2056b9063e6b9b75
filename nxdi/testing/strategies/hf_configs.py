"""Hypothesis strategies for Hugging Face config dicts and the ModelSpecs they describe.

- `llama_like_cases()`: a valid llama/mistral/qwen2/qwen3/mixtral `config.json` dict, in any of the
  RoPE layouts Hugging Face writes, together with the `ModelSpec` it must parse to.
- `model_specs()`: valid `ModelSpec`s (for strategies of other concepts that need a model).
- `llama_configs()`: just the config dicts of `llama_like_cases()`.
- `broken_configs()`: a valid dict with one or more fields broken, and the names of exactly the
  fields the parser must report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from nxdi.core.model_spec import ACTIVATIONS, ModelSpec, RopeKind, RopeSpec

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral")

Draw = Callable[[st.SearchStrategy[Any]], Any]


def _rope(draw: Draw, raw: dict[str, Any], max_positions: int) -> RopeSpec:
    """Write a RoPE block into `raw` in a random layout; return the spec it describes."""
    theta = draw(st.sampled_from([10000.0, 500000.0, 1000000.0]))
    kind = draw(st.sampled_from(list(RopeKind)))
    params: dict[str, Any] = {}
    if kind is not RopeKind.DEFAULT:
        params["factor"] = draw(st.sampled_from([2.0, 4.0, 8.0, 32.0]))
    if kind in (RopeKind.LLAMA3, RopeKind.YARN):
        params["original_max_position_embeddings"] = max(1, max_positions // 4)
    if kind is RopeKind.LLAMA3:
        params |= {"low_freq_factor": 1.0, "high_freq_factor": draw(st.sampled_from([2.0, 4.0]))}
    if kind is RopeKind.YARN:
        params |= {"beta_fast": 32.0, "beta_slow": draw(st.sampled_from([1.0, 2.0]))}
    layout = draw(st.sampled_from(["rope_parameters", "rope_scaling", "omitted"]))
    if layout == "rope_parameters":
        raw["rope_parameters"] = {"rope_type": kind.value, "rope_theta": theta, **params}
    elif layout == "rope_scaling" or kind is not RopeKind.DEFAULT or theta != 10000.0:
        raw["rope_theta"] = theta
        if kind is not RopeKind.DEFAULT or draw(st.booleans()):
            raw["rope_scaling"] = {draw(st.sampled_from(["rope_type", "type"])): kind.value, **params}
    return RopeSpec(theta=theta, kind=kind, **params)


def _heads(draw: Draw, raw: dict[str, Any], model_type: str) -> dict[str, int]:
    kv = draw(st.integers(1, 8))
    heads = kv * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([8, 16, 64, 128]))
    explicit = model_type == "qwen3" or draw(st.booleans())
    hidden = draw(st.integers(1, 64)) * 8 if explicit else heads * head_dim
    raw |= {"hidden_size": hidden, "num_attention_heads": heads}
    if explicit:
        raw["head_dim"] = head_dim
    if kv != heads or draw(st.booleans()):
        raw["num_key_value_heads"] = kv
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_kv_heads": kv, "head_dim": head_dim}


def _window(draw: Draw, raw: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and `full_attention_layers`: Mistral windows every layer; Qwen windows the layers
    from `max_window_layers` on (or those `layer_types` marks), only with `use_sliding_window`."""
    window = draw(st.none() | st.integers(1, 1 << 17))
    if model_type in ("mistral", "mixtral"):
        raw["sliding_window"] = window
        return {"sliding_window": window}
    if model_type not in ("qwen2", "qwen3"):
        return {}
    used = draw(st.booleans())
    raw |= {"use_sliding_window": used, "sliding_window": window}
    if draw(st.booleans()):
        full = sorted(draw(st.sets(st.integers(0, layers - 1))))
        raw["layer_types"] = ["full_attention" if i in full else "sliding_attention" for i in range(layers)]
    else:
        first = draw(st.none() | st.integers(0, layers + 2))
        if first is not None:
            raw["max_window_layers"] = first
        full = list(range(min(28 if first is None else first, layers)))
    if not used or window is None or len(full) == layers:
        return {"sliding_window": None}
    return {"sliding_window": window, "full_attention_layers": tuple(full)}


def _biases(draw: Draw, raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    if model_type == "qwen2":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    attention = draw(st.booleans()) if model_type in ("llama", "qwen3") else False
    mlp = draw(st.booleans()) if model_type == "llama" else False
    if model_type in ("llama", "qwen3"):
        raw["attention_bias"] = attention
    if model_type == "llama":
        raw["mlp_bias"] = mlp
    return {"qkv_bias": attention, "o_bias": attention, "mlp_bias": mlp}


def _experts(draw: Draw, raw: dict[str, Any], model_type: str) -> dict[str, int]:
    if model_type != "mixtral":
        return {}
    n = draw(st.integers(1, 16))
    k = draw(st.integers(1, n))
    raw |= {"num_local_experts": n, "num_experts_per_tok": k}
    return {"num_experts": n, "num_experts_per_tok": k}


def _tokens(draw: Draw, raw: dict[str, Any], vocab: int) -> dict[str, Any]:
    token = st.integers(0, vocab - 1)
    bos, pad = draw(st.none() | token), draw(st.none() | token)
    eos = draw(st.none() | token | st.lists(token, min_size=1, max_size=3))
    raw |= {"bos_token_id": bos, "pad_token_id": pad, "eos_token_id": eos}
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return {"bos_token_id": bos, "pad_token_id": pad, "eos_token_ids": eos_ids}


@st.composite
def llama_like_cases(draw: Draw, families: tuple[str, ...] = LLAMA_LIKE) -> tuple[dict[str, Any], ModelSpec]:
    """A valid `config.json` dict of a llama-like family and the ModelSpec it describes."""
    model_type = draw(st.sampled_from(families))
    raw: dict[str, Any] = {"model_type": model_type}
    layers, vocab = draw(st.integers(1, 96)), draw(st.integers(2, 1 << 18))
    inter, max_pos = draw(st.integers(1, 1 << 16)), draw(st.sampled_from([512, 2048, 32768, 131072]))
    eps, act, tie = draw(st.sampled_from([1e-5, 1e-6])), draw(st.sampled_from(sorted(ACTIVATIONS))), draw(st.booleans())
    raw |= {"num_hidden_layers": layers, "vocab_size": vocab, "intermediate_size": inter}
    raw |= {"max_position_embeddings": max_pos, "rms_norm_eps": eps, "hidden_act": act, "tie_word_embeddings": tie}
    spec = ModelSpec(
        model_type=model_type,
        **_heads(draw, raw, model_type),
        num_layers=layers,
        vocab_size=vocab,
        intermediate_size=inter,
        max_position_embeddings=max_pos,
        norm_eps=eps,
        activation=act,
        rope=_rope(draw, raw, max_pos),
        tie_word_embeddings=tie,
        **_biases(draw, raw, model_type),
        qk_norm=model_type == "qwen3",
        **_window(draw, raw, model_type, layers),
        **_experts(draw, raw, model_type),
        **_tokens(draw, raw, vocab),
    )
    return raw, spec


def llama_configs(families: tuple[str, ...] = LLAMA_LIKE) -> st.SearchStrategy[dict[str, Any]]:
    """Valid Hugging Face config dicts of the llama-like families."""
    return llama_like_cases(families).map(lambda case: case[0])


def model_specs(families: tuple[str, ...] = LLAMA_LIKE) -> st.SearchStrategy[ModelSpec]:
    """Valid ModelSpecs of the llama-like families."""
    return llama_like_cases(families).map(lambda case: case[1])


Breaker = Callable[[Draw, dict[str, Any]], str]
"""Breaks one thing in a valid config dict in place; returns the field name the parser must report."""


def _rope_key(raw: dict[str, Any]) -> str:
    return "rope_parameters" if "rope_parameters" in raw else "rope_scaling"


def _missing(key: str) -> Breaker:
    def brk(draw: Draw, raw: dict[str, Any]) -> str:
        del raw[key]
        return key

    return brk


def _set(key: str, bad: st.SearchStrategy[Any]) -> Breaker:
    def brk(draw: Draw, raw: dict[str, Any]) -> str:
        raw[key] = draw(bad)
        return key

    return brk


def _kv_not_dividing(draw: Draw, raw: dict[str, Any]) -> str:
    raw["num_key_value_heads"] = raw["num_attention_heads"] + draw(st.integers(1, 5))
    return "num_key_value_heads"


def _hidden_not_divisible(draw: Draw, raw: dict[str, Any]) -> str:
    raw.pop("head_dim", None)
    heads = raw["num_attention_heads"] = max(2, raw["num_attention_heads"])
    raw.pop("num_key_value_heads", None)
    raw["hidden_size"] = heads * draw(st.integers(1, 64)) + draw(st.integers(1, heads - 1))
    return "hidden_size"


def _unknown_rope_type(draw: Draw, raw: dict[str, Any]) -> str:
    key = _rope_key(raw)
    block = raw[key] = dict(raw.get(key) or {})
    type_key = "type" if "type" in block else "rope_type"
    block[type_key] = draw(st.sampled_from(["su", "longrope", "mrope", "", "LLAMA3"]))
    return f"{key}.{type_key}"


def _bad_rope_theta(draw: Draw, raw: dict[str, Any]) -> str:
    bad = draw(st.sampled_from([0, -1.0, -500000.0, "10000", True]))
    if "rope_parameters" in raw:
        raw["rope_parameters"] = {**raw["rope_parameters"], "rope_theta": bad}
        return "rope_parameters.rope_theta"
    raw["rope_theta"] = bad
    return "rope_theta"


def _too_many_experts_per_token(draw: Draw, raw: dict[str, Any]) -> str:
    raw["num_experts_per_tok"] = raw["num_local_experts"] + draw(st.integers(1, 4))
    return "num_experts_per_tok"


NOT_POSITIVE = st.sampled_from([0, -1, -4096, 2.5, "4096", True, [8]])

BREAKERS: dict[str, tuple[frozenset[str], Breaker]] = {
    "missing hidden_size": (frozenset({"hidden_size", "head_dim"}), _missing("hidden_size")),
    "missing num_attention_heads": (
        frozenset({"num_attention_heads", "num_key_value_heads", "hidden_size"}),
        _missing("num_attention_heads"),
    ),
    "missing num_hidden_layers": (frozenset({"num_hidden_layers"}), _missing("num_hidden_layers")),
    "missing vocab_size": (frozenset({"vocab_size"}), _missing("vocab_size")),
    "missing intermediate_size": (frozenset({"intermediate_size"}), _missing("intermediate_size")),
    "bad vocab_size": (frozenset({"vocab_size"}), _set("vocab_size", NOT_POSITIVE)),
    "bad num_hidden_layers": (frozenset({"num_hidden_layers"}), _set("num_hidden_layers", NOT_POSITIVE)),
    "bad max_position_embeddings": (
        frozenset({"max_position_embeddings"}),
        _set("max_position_embeddings", NOT_POSITIVE),
    ),
    "kv heads not dividing": (frozenset({"num_key_value_heads", "num_attention_heads"}), _kv_not_dividing),
    "hidden not divisible by heads": (
        frozenset({"hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads"}),
        _hidden_not_divisible,
    ),
    "unknown rope type": (frozenset({"rope_parameters", "rope_scaling", "rope_theta"}), _unknown_rope_type),
    "bad rope theta": (frozenset({"rope_parameters", "rope_scaling", "rope_theta"}), _bad_rope_theta),
    "bad activation": (frozenset({"hidden_act"}), _set("hidden_act", st.sampled_from(["tanh", "SiLU", "", 3]))),
    "bad tie_word_embeddings": (
        frozenset({"tie_word_embeddings"}),
        _set("tie_word_embeddings", st.sampled_from(["true", 1, 0])),
    ),
    "bad rms_norm_eps": (frozenset({"rms_norm_eps"}), _set("rms_norm_eps", st.sampled_from(["1e-5", True]))),
    "bad eos_token_id": (frozenset({"eos_token_id"}), _set("eos_token_id", st.sampled_from(["</s>", -1, [1, "x"]]))),
}

MIXTRAL_BREAKERS: dict[str, tuple[frozenset[str], Breaker]] = {
    "more experts per token than experts": (
        frozenset({"num_local_experts", "num_experts_per_tok"}),
        _too_many_experts_per_token,
    ),
}


@st.composite
def broken_configs(draw: Draw, min_breaks: int = 1, max_breaks: int = 1) -> tuple[dict[str, Any], frozenset[str]]:
    """A llama-like config dict with between `min_breaks` and `max_breaks` independent fields broken.

    Returns the dict and the set of field names the parser must report (each exactly once).
    Breakers are chosen so that no two touch the same keys, so each problem stays independent.
    """
    raw, _ = draw(llama_like_cases())
    table = BREAKERS | (MIXTRAL_BREAKERS if raw["model_type"] == "mixtral" else {})
    names = draw(st.permutations(sorted(table)))
    chosen: list[Breaker] = []
    touched: set[str] = set()
    for name in names:
        keys, breaker = table[name]
        if not keys & touched and len(chosen) < max_breaks:
            chosen.append(breaker)
            touched |= keys
    assert len(chosen) >= min_breaks, "the breaker table has too few independent entries"
    return raw, frozenset(breaker(draw, raw) for breaker in chosen)

"""Gemma 3 (text): the record, its checkpoint layout and its config reader. Pure.

Gemma 3 is Llama plus these ModelSpec fields, each read from the config here and run by the decoder:
- every RMSNorm (q_norm/k_norm and the final norm too) scales by `1 + weight` in fp32 (`norm_offset`);
- four norms a layer (`sandwich_norms`): `input_layernorm` before attention, `post_attention_layernorm`
  on the attention output before the residual add, `pre_feedforward_layernorm` and
  `post_feedforward_layernorm` around the MLP;
- embeddings times sqrt(hidden_size) (`embed_scale`), attention scores times
  `query_pre_attn_scalar ** -0.5` (`attention_scale`), q/k norm, an explicit `head_dim` (default 256);
- sliding-window layers interleaved with global ones: `layer_types`, or in older configs every
  `sliding_window_pattern`-th layer global (transformers' rule). The sliding layers see the last
  `sliding_window` positions (the query's own included, transformers' `kv > q - window`, which is
  `layers.visible_mask`'s convention) and use their own RoPE (`local_rope`: `rope_local_base_freq`,
  unscaled, or `rope_parameters.sliding_attention`); the global ones use `rope_theta` with
  `rope_scaling` (or `rope_parameters.full_attention`);
- a gelu_pytorch_tanh gated MLP (`hidden_activation`), tied embeddings unless the config says
  otherwise, and `final_logit_softcapping` (`final_logit_softcap`) when set.

What is read and what is refused:
- `gemma3_text` configs (transformers' Gemma3ForCausalLM: Gemma 3 270M and 1B on the hub).
- `gemma3` configs (Gemma3ForConditionalGeneration: Gemma 3 4B, 12B and 27B, a SigLIP vision tower
  plus a language model): nxdi runs the language model, text in and text out. Its attributes are
  read from `text_config` (problems named `text_config.<key>`); `tie_word_embeddings` and the
  token ids from the outer config where it sets them, as transformers does (its lm_head ties by
  the outer flag; generate() takes the outer token ids first, so the hub's `eos_token_id` [1, 106]
  ends a turn). A language-model key set at the top level instead, where nothing reads it, is
  refused. The checkpoint is read through `MULTIMODAL_CHECKPOINT`: the language model's keys in
  either layout transformers reads (`language_model.model.*` and `language_model.lm_head.weight`,
  what it writes; or its module names `model.language_model.*`, `lm_head.weight`), the vision
  tower and projector skipped, anything else reported. Images cannot reach the model: the shell
  refuses image inputs (`pixel_values`, ...) rather than generate from the text alone.
- `attn_logit_softcapping` is accepted and, as in transformers' Gemma3 (which stores it but never
  passes it to attention: Gemma 3 replaced attention soft-capping by the q/k norm), not applied.
- `use_bidirectional_attention` (EmbeddingGemma) is refused: the engine's attention is causal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.llama import EMBED, GATED_MLP, HEAD, SELF_ATTENTION
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import RopeSpec
from nxdi.core.weight_table import WeightTable, Wrapper, copy

REQUIRED = (
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "query_pre_attn_scalar",
    "sliding_window",
)
"""NxDI's Gemma3 `get_required_attributes`."""

_SLIDING = "sliding_attention"
_FULL = "full_attention"
_PATTERN = 6
"""transformers' default `sliding_window_pattern`: every sixth layer is global."""
# transformers' Gemma3TextConfig defaults:
_WINDOW = 4096
_HEAD_DIM = 256
_QUERY_SCALAR = 256.0
_GLOBAL_THETA = 1_000_000.0
"""`rope_theta`."""
_LOCAL_THETA = 10_000.0
"""`rope_local_base_freq`."""
_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
"""transformers' default token ids of a Gemma3TextConfig."""
_TOKEN_FIELDS = {"eos_token_id": "eos_token_ids"}
"""ModelSpec fields of the token-id keys, where the names differ."""

TEXT = "gemma3_text"
"""The text model's model_type (Gemma3ForCausalLM)."""
MULTIMODAL = "gemma3"
"""The multimodal model's model_type (Gemma3ForConditionalGeneration)."""
_TEXT_KEYS = frozenset(
    {
        *REQUIRED,
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "hidden_activation",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "rope_local_base_freq",
        "layer_types",
        "sliding_window_pattern",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "attention_bias",
        "use_bidirectional_attention",
    }
)
"""The keys a multimodal config keeps under `text_config` (its language model's architecture)."""
_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
"""transformers' Gemma3TextConfig defaults for the sizes, which the hub's multimodal configs rely on
(their `text_config` leaves out vocab_size, and gemma-3-4b's its head counts too); a `gemma3_text`
config must give them, as every family's config must."""

MULTIMODAL_CHECKPOINT = Wrapper(
    model_type=MULTIMODAL,
    layouts=(
        (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        (("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    ),
    skipped=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
)
"""Where a multimodal checkpoint keeps the language model: the two layouts transformers reads, its
legacy keys (which save_pretrained writes, and the hub's checkpoints have) and its module names
(`Gemma3ForConditionalGeneration`'s conversion mapping between them); the vision tower and the
projector, in either layout, are skipped."""

GEMMA3_WEIGHTS = WeightTable(
    before=EMBED,
    layer=(
        copy("input_norm", "input_layernorm.weight", ("E",)),
        *SELF_ATTENTION,
        copy("attn_out_norm", "post_attention_layernorm.weight", ("E",)),
        copy("post_norm", "pre_feedforward_layernorm.weight", ("E",)),
        copy("mlp_out_norm", "post_feedforward_layernorm.weight", ("E",)),
        *GATED_MLP,
    ),
    after=HEAD,
    wrappers=(MULTIMODAL_CHECKPOINT,),
)
"""A Gemma 3 checkpoint as the decoder takes it: Llama's, with `post_attention_layernorm` norming the
attention output (`attn_out_norm`) and the MLP between `pre_feedforward_layernorm` (the `post_norm`
slot, the norm a Llama layer puts before its MLP) and `post_feedforward_layernorm` (`mlp_out_norm`);
in a multimodal checkpoint, nested as `MULTIMODAL_CHECKPOINT` says."""


def _full_layers(r: ConfigReader, layers: int) -> tuple[int, ...] | None:
    """The global layers, from `layer_types` or `sliding_window_pattern`; None when invalid (recorded)."""
    types = r.raw.get("layer_types")
    if types is None:
        pattern = r.int_("sliding_window_pattern", _PATTERN)
        return None if pattern is None else tuple(i for i in range(layers) if (i + 1) % pattern == 0)
    if not isinstance(types, list) or len(types) != layers or any(t not in (_SLIDING, _FULL) for t in types):
        why = f"must list {layers} entries, each one of {_FULL}, {_SLIDING}"
        r.problems.append(Problem.of(r.name("layer_types"), types, why))
        return None
    return tuple(i for i, t in enumerate(types) if t == _FULL)


def _windows(r: ConfigReader) -> dict[str, Any]:
    """`sliding_window` and `full_attention_layers` (no window when every layer is global)."""
    layers = r.raw.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return {}  # a bad layer count is reported once, by the model reader
    full = _full_layers(r, layers)
    if full is None or len(full) == layers:
        return {}
    if "sliding_window" in r.raw and r.raw["sliding_window"] is None:
        why = f"is null, but layers {sorted(set(range(layers)) - set(full))} attend within a sliding window"
        r.problems.append(Problem.of(r.name("sliding_window"), None, why, "set the window, in tokens"))
        return {}
    return {"sliding_window": r.int_("sliding_window", _WINDOW), "full_attention_layers": full}


def _ropes(r: ConfigReader) -> tuple[RopeSpec | None, RopeSpec | None]:
    """(global, local) RoPE: transformers 5's `rope_parameters` with one block per layer type, or the
    legacy `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local, unscaled)."""
    params = r.sub("rope_parameters")
    extra = sorted(set(params.raw) - {_FULL, _SLIDING})
    if extra:
        why = f"has keys {extra}: Gemma 3 keeps one block of RoPE parameters per layer type"
        r.problems.append(Problem.of(r.name("rope_parameters"), dict(params.raw), why, f"nest them under {_FULL}"))
    full = params.sub(_FULL) if _FULL in params.raw else r.sub("rope_scaling")
    theta = (r.name("rope_theta"), r.raw.get("rope_theta"))
    glob = reader.rope_block(full, theta=theta, default_theta=_GLOBAL_THETA)
    local_theta = (r.name("rope_local_base_freq"), r.raw.get("rope_local_base_freq"))
    local = reader.rope_block(params.sub(_SLIDING), theta=local_theta, default_theta=_LOCAL_THETA)
    return glob, local


def read_gemma3(r: ConfigReader) -> dict[str, Any]:
    """ModelSpec fields of a `gemma3_text` config, or of the language model of a `gemma3` one
    (see the module docstring)."""
    return _read_multimodal(r) if r.raw.get("model_type") == MULTIMODAL else _read_text(r)


def _read_multimodal(r: ConfigReader) -> dict[str, Any]:
    """The language model of a multimodal `gemma3` config: its `text_config`, with the outer
    config's `tie_word_embeddings` and token ids."""
    raw = r.raw.get("text_config")
    if not isinstance(raw, Mapping):
        fix = "a gemma3 config keeps its language model's attributes (hidden_size, ...) in a text_config object"
        missing = Problem.missing("text_config", fix)
        r.problems.append(missing if raw is None else Problem.of("text_config", raw, "must be an object", fix))
        return {}
    text = ConfigReader({**_TEXT_DEFAULTS, **raw}, r.name("text_config.")).sharing(r)
    if text.raw.get("model_type", TEXT) != TEXT:
        why = f"must be {TEXT}: the language model of a multimodal Gemma 3"
        r.problems.append(Problem.of(text.name("model_type"), text.raw["model_type"], why))
    for key in sorted(k for k in _TEXT_KEYS if r.raw.get(k) is not None):
        why = "is a language-model attribute at the top level of a multimodal gemma3 config, where nothing reads it"
        r.problems.append(Problem.of(key, r.raw[key], why, f"set text_config.{key} instead"))
    fields = _read_text(text)
    outer = {k: r.raw[k] for k in _TOKENS if r.raw.get(k) is not None}
    tokens = reader.tokens(ConfigReader(outer).sharing(r))
    return {
        **fields,
        "model_type": MULTIMODAL,
        "tie_word_embeddings": r.bool_("tie_word_embeddings", True),
        **{_TOKEN_FIELDS.get(k, k): tokens[_TOKEN_FIELDS.get(k, k)] for k in outer},
    }


def _read_text(r: ConfigReader) -> dict[str, Any]:
    """ModelSpec fields of a Gemma 3 text model's config (a `gemma3_text` config, or a `text_config`)."""
    if r.bool_("use_bidirectional_attention", False):
        why = "asks for bidirectional attention (EmbeddingGemma); nxdi runs causal language models"
        r.problems.append(Problem.of(r.name("use_bidirectional_attention"), True, why, "set it to false"))
    r.opt_float("attn_logit_softcapping", positive=True)  # checked, then unused, as transformers does
    bias = r.bool_("attention_bias", False)
    dims = reader.heads(
        r,
        hidden_key="hidden_size",
        heads_key="num_attention_heads",
        kv=(r, "num_key_value_heads", None),
        head_dim_key="head_dim",
        head_dim_default=_HEAD_DIM,
    )
    windows = _windows(r)
    glob, local = _ropes(r)
    hidden = dims["hidden_size"]
    return dict(
        model_type=TEXT,
        **dims,
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("intermediate_size"),
        max_position_embeddings=r.int_("max_position_embeddings", 131072),
        norm_eps=r.float_("rms_norm_eps", 1e-6, positive=True),
        activation=r.activation("hidden_activation", "gelu_pytorch_tanh"),
        rope=glob,
        local_rope=local if windows and local != glob else None,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=None if hidden is None else hidden**0.5,
        attention_scale=r.float_("query_pre_attn_scalar", _QUERY_SCALAR, positive=True) ** -0.5,
        final_logit_softcap=r.opt_float("final_logit_softcapping", positive=True),
        **windows,
        **reader.tokens(r, _TOKENS),
    )


RECORD = FamilyRecord(
    name="gemma3",
    model_types=(TEXT, MULTIMODAL),
    read=read_gemma3,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="Gemma3InferenceConfig",
        causal_lm="NeuronGemma3ForCausalLM",
        neuron_config="Gemma3NeuronConfig",
        inner_model="NeuronGemma3TextModel",
    ),
    weights=GEMMA3_WEIGHTS,
    program=ProgramKind.DECODER,
    tiny_config={
        "head_dim": 32,
        "query_pre_attn_scalar": 20,
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": True,
    },
)

"""GPT-2: the record, its checkpoint layout and its config reader. Pure.

A GPT-2 layer: biased LayerNorms before attention and MLP, a fused `c_attn` projection with a
bias, and a plain gelu_new MLP; learned absolute positions (`wpe`) added to the token embeddings,
a final `ln_f`, and the lm_head tied to the embeddings. Its linear layers are Conv1D modules,
whose weights are stored [in, out]: the weight table reads them transposed (`Source.transposed`).

Refused: `scale_attn_by_inverse_layer_idx` (a per-layer score scale the decoder does not apply)
and `add_cross_attention` (an encoder-decoder layer). `scale_attn_weights=false` is run as an
attention scale of 1.
"""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.gpt_neox import final_norm, layer_norms, plain_mlp
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind, PositionKind
from nxdi.core.weight_table import WeightTable, copy

REQUIRED = ("n_embd", "n_head", "n_layer", "vocab_size")
"""The attributes the config must give (the rest have transformers' defaults)."""

WEIGHTS = WeightTable(
    before=(
        copy("embed", "embed_tokens.weight", ("V", "E"), source="wte.weight"),
        copy("embed_positions", "embed_positions.weight", ("P", "E"), source="wpe.weight"),
    ),
    layer=(
        *layer_norms("ln_1", "ln_2"),
        copy(
            "attn.qkv", "self_attn.Wqkv.weight", ("E", "QKV"), source="attn.c_attn.weight", linear=True, transposed=True
        ),
        copy("attn.qkv_bias", "self_attn.Wqkv.bias", ("QKV",), source="attn.c_attn.bias"),
        copy(
            "attn.o", "self_attn.o_proj.weight", ("Q", "E"), source="attn.c_proj.weight", linear=True, transposed=True
        ),
        copy("attn.o_bias", "self_attn.o_proj.bias", ("E",), source="attn.c_proj.bias"),
        *plain_mlp("mlp.c_fc", "mlp.c_proj", transposed=True),
    ),
    after=(*final_norm("ln_f"), copy("lm_head", "lm_head.weight", ("V", "E"), linear=True)),
    source_layer_prefix="h.{i}.",
    model_prefix="transformer.",
)
"""A GPT-2 checkpoint (`transformer.h.{i}....`, Conv1D weights [in, out]) as the decoder takes it."""


def refuse_flags(r: ConfigReader, flags: tuple[tuple[str, bool, str], ...]) -> None:
    """Record a problem for each (key, default, why) whose config value is not the default."""
    for key, default, why in flags:
        value = r.bool_(key, default)
        if value != default:
            r.problems.append(Problem.of(r.name(key), value, why, f"set {key} to {str(default).lower()}"))


def _read(r: ConfigReader) -> dict[str, Any]:
    refuse_flags(
        r,
        (
            ("scale_attn_by_inverse_layer_idx", False, "scales attention scores per layer, which nxdi does not"),
            ("add_cross_attention", False, "adds cross-attention to an encoder; nxdi runs decoder-only models"),
        ),
    )
    dims = reader.heads(r, hidden_key="n_embd", heads_key="n_head")
    hidden = dims["hidden_size"]
    return dict(
        model_type="gpt2",
        **dims,
        num_layers=r.int_("n_layer"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("n_inner", 4 * hidden if hidden else None),
        max_position_embeddings=r.int_("n_positions", 1024),
        norm=NormKind.LAYER,
        norm_eps=r.float_("layer_norm_epsilon", 1e-5, positive=True),
        activation=r.activation("activation_function", "gelu_new"),
        gated_mlp=False,
        position=PositionKind.LEARNED,
        rope=None,
        attention_scale=None if r.bool_("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="gpt2",
    model_types=("gpt2",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="GPT2InferenceConfig",
        causal_lm="NeuronGPT2ForCausalLM",
        tnx=("GPT2ForSampling", "GPT2ForSamplingWithContextBroadcasting", "GPT2ForSamplingWithContextBeforeAfter"),
    ),
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    eagle=False,
    tiny_config={
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 256,
        "n_inner": 128,
        "tie_word_embeddings": True,
    },
)

"""GPT-NeoX (Pythia and relatives): the record, its checkpoint layout and its config reader. Pure.

A GPT-NeoX layer: biased LayerNorms, a fused `query_key_value` stored head by head ([H, 3, D] rows:
`RowOrder.PER_HEAD_QKV` reads it into the decoder's [Q; K; V]), RoPE on the first
`partial_rotary_factor` (legacy `rotary_pct`) of each head in the rotate-half style, a plain GELU
MLP, and, with `use_parallel_residual` (the default), attention and MLP both reading the layer's
input, each through its own norm. The lm_head is the separate top-level `embed_out`.

Its table's parts (`layer_norms`, `per_head_attention`, `plain_mlp`, `final_norm`) are shared by
the other pre-Llama families (GPT-2, OPT, BLOOM, GPT-J), named by their checkpoint keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind
from nxdi.core.weight_table import RowOrder, WeightTable, copy

REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
"""The attributes the config must give (the rest have transformers' defaults)."""
_ROTARY_PCT = 0.25
"""transformers' default `partial_rotary_factor` of GPT-NeoX."""


def layer_norms(input_norm: str, post_norm: str | None) -> tuple[Any, ...]:
    """The biased LayerNorms before attention (`input_norm`) and MLP (`post_norm`, if any), by their
    checkpoint names (without `.weight`/`.bias`), in the Llama layout's nxdi names."""
    pairs = (("input_norm", "input_layernorm", input_norm), ("post_norm", "post_attention_layernorm", post_norm))
    return tuple(
        copy(slot + ("_bias" if kind == "bias" else ""), f"{name}.{kind}", ("E",), source=f"{src}.{kind}")
        for slot, name, src in pairs
        if src is not None
        for kind in ("weight", "bias")
    )


def plain_mlp(up: str, down: str, *, transposed: bool = False) -> tuple[Any, ...]:
    """A plain MLP `down(act(up x))` with biases, by its checkpoint names (Conv1D: `transposed`)."""
    up_shape, down_shape = (("E", "F"), ("F", "E")) if transposed else (("F", "E"), ("E", "F"))
    return (
        copy("mlp.up", "mlp.up_proj.weight", up_shape, source=f"{up}.weight", linear=True, transposed=transposed),
        copy("mlp.up_bias", "mlp.up_proj.bias", ("F",), source=f"{up}.bias", when="mlp_bias"),
        copy(
            "mlp.down", "mlp.down_proj.weight", down_shape, source=f"{down}.weight", linear=True, transposed=transposed
        ),
        copy("mlp.down_bias", "mlp.down_proj.bias", ("E",), source=f"{down}.bias", when="mlp_bias"),
    )


def final_norm(source: str, *, when: str | None = None) -> tuple[Any, ...]:
    """The final biased LayerNorm, by its checkpoint name (existing under ModelSpec flag `when`)."""
    return (
        copy("norm", "norm.weight", ("E",), source=f"{source}.weight", when=when),
        copy("norm_bias", "norm.bias", ("E",), source=f"{source}.bias", when=when),
    )


def per_head_attention(qkv: str, o: str) -> tuple[Any, ...]:
    """A fused QKV stored head by head (`RowOrder.PER_HEAD_QKV`) and the output projection, with biases."""
    head = RowOrder.PER_HEAD_QKV
    return (
        copy("attn.qkv", "self_attn.Wqkv.weight", ("QKV", "E"), source=f"{qkv}.weight", linear=True, rows=head),
        copy("attn.qkv_bias", "self_attn.Wqkv.bias", ("QKV",), source=f"{qkv}.bias", when="qkv_bias", rows=head),
        copy("attn.o", "self_attn.o_proj.weight", ("E", "Q"), source=f"{o}.weight", linear=True),
        copy("attn.o_bias", "self_attn.o_proj.bias", ("E",), source=f"{o}.bias", when="o_bias"),
    )


WEIGHTS = WeightTable(
    before=(copy("embed", "embed_tokens.weight", ("V", "E"), source="embed_in.weight"),),
    layer=(
        *layer_norms("input_layernorm", "post_attention_layernorm"),
        *per_head_attention("attention.query_key_value", "attention.dense"),
        *plain_mlp("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    ),
    after=(
        *final_norm("final_layer_norm"),
        copy("lm_head", "lm_head.weight", ("V", "E"), source="embed_out.weight", linear=True),
    ),
    model_prefix="gpt_neox.",
    unprefixed=("embed_out.",),
)
"""A GPT-NeoX checkpoint (`gpt_neox.layers.{i}....`, `embed_out.weight`) as the decoder program takes it."""


def rotary_dim(r: ConfigReader, head_dim: int | None, fraction: object) -> int | None:
    """`int(head_dim * fraction)` (transformers' rule), checked to be a positive even count; None
    (all of the head) when it covers the whole head."""
    name = r.name("rope_parameters.partial_rotary_factor")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        r.problems.append(Problem.of(name, fraction, "must be a number in (0, 1]"))
        return None
    if head_dim is None:
        return None
    dims = int(head_dim * fraction)
    if dims < 2 or dims % 2:
        why = f"rotates {dims} of head_dim={head_dim} dims, which must be a positive even count"
        r.problems.append(Problem.of(name, fraction, why))
        return None
    return None if dims == head_dim else dims


def _read(r: ConfigReader) -> dict[str, Any]:
    dims = reader.heads(r, hidden_key="hidden_size", heads_key="num_attention_heads")
    params = r.raw.get("rope_parameters")
    params = params if isinstance(params, Mapping) else {}  # a bad block is reported by reader.rope
    fraction = params.get("partial_rotary_factor", r.raw.get("rotary_pct", _ROTARY_PCT))
    legacy = ("rotary_emb_base", r.raw.get("rotary_emb_base"))
    bias = r.bool_("attention_bias", True)
    return dict(
        model_type="gpt_neox",
        **dims,
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("intermediate_size"),
        max_position_embeddings=r.int_("max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=r.float_("layer_norm_eps", 1e-5, positive=True),
        activation=r.activation("hidden_act", "gelu"),
        gated_mlp=False,
        rope=reader.rope(r, legacy_theta=legacy if r.raw.get("rope_theta") is None else None),
        rotary_dim=rotary_dim(r, dims["head_dim"], fraction),
        parallel_residual=r.bool_("use_parallel_residual", True),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="gpt_neox",
    model_types=("gpt_neox",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="GPTNeoXInferenceConfig",
        causal_lm="NeuronGPTNeoXForCausalLM",
        tnx=("GPTNeoXForSampling",),
    ),
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    eagle=False,
    tiny_config={
        "use_parallel_residual": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
)

"""OPT: the record, its checkpoint layout and its config reader. Pure.

An OPT layer: biased LayerNorms, q/k/v/out projections and a plain ReLU MLP (`fc1`, `fc2`), with
biases unless `enable_bias` is false; learned positions whose table reserves 2 rows before position
0 (`position_offset`), a final LayerNorm, and the lm_head tied to the embeddings by default.
`do_layer_norm_before=false` (OPT-350m) norms after each residual add instead, with no final norm
(`post_layer_norm`; as with `_remove_final_layer_norm`).

Refused: `word_embed_proj_dim` other than `hidden_size` (OPT-350m's `project_in`/`project_out`
between a narrower embedding and the layers) and `layer_norm_elementwise_affine=false`.
"""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.gpt2 import refuse_flags
from nxdi.core.families.gpt_neox import final_norm, layer_norms, plain_mlp
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind, PositionKind
from nxdi.core.weight_table import Weight, WeightTable, copy, fused

REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "ffn_dim", "vocab_size")
"""The attributes the config must give (the rest have transformers' defaults)."""
POSITION_OFFSET = 2
"""OPT's learned position table starts 2 rows before position 0."""


def _projection(kind: str) -> tuple[Weight, ...]:
    """OPT's q/k/v (fused) and out projections' weights or biases, by their checkpoint names."""
    names = {"weight": (("Q", "E"), ("KV", "E"), ("E", "Q")), "bias": (("Q",), ("KV",), ("E",))}
    q, kv, o = names[kind]
    when = None if kind == "weight" else "qkv_bias"
    suffix = "" if kind == "weight" else "_bias"
    return (
        fused(
            f"attn.qkv{suffix}",
            f"self_attn.Wqkv.{kind}",
            (f"self_attn.q_proj.{kind}", q),
            (f"self_attn.k_proj.{kind}", kv),
            (f"self_attn.v_proj.{kind}", kv),
            when=when,
            linear=kind == "weight",
        ),
        copy(
            f"attn.o{suffix}",
            f"self_attn.o_proj.{kind}",
            o,
            source=f"self_attn.out_proj.{kind}",
            when=None if kind == "weight" else "o_bias",
            linear=kind == "weight",
        ),
    )


WEIGHTS = WeightTable(
    before=(
        copy("embed", "embed_tokens.weight", ("V", "E")),
        copy("embed_positions", "embed_positions.weight", ("P", "E")),
    ),
    layer=(
        *layer_norms("self_attn_layer_norm", "final_layer_norm"),
        *_projection("weight"),
        *_projection("bias"),
        *plain_mlp("fc1", "fc2"),
    ),
    after=(
        *final_norm("final_layer_norm", when="final_norm"),
        copy("lm_head", "lm_head.weight", ("V", "E"), linear=True),
    ),
    model_prefix="model.decoder.",
)
"""An OPT checkpoint (`model.decoder.layers.{i}....`) as the decoder program takes it."""


def _read(r: ConfigReader) -> dict[str, Any]:
    refuse_flags(
        r,
        (("layer_norm_elementwise_affine", True, "makes LayerNorms without weights, which nxdi does not read"),),
    )
    dims = reader.heads(r, hidden_key="hidden_size", heads_key="num_attention_heads")
    hidden = dims["hidden_size"]
    proj = r.raw.get("word_embed_proj_dim")
    if proj is not None and proj != hidden:
        why = f"differs from hidden_size={hidden}: OPT's project_in/project_out are not supported by nxdi yet"
        r.problems.append(Problem.of(r.name("word_embed_proj_dim"), proj, why, "use an OPT without the projections"))
    before = r.bool_("do_layer_norm_before", True)
    bias = r.bool_("enable_bias", True)
    return dict(
        model_type="opt",
        **dims,
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("ffn_dim"),
        max_position_embeddings=r.int_("max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=1e-5,  # torch's LayerNorm default, which OPT's use
        activation=r.activation("activation_function", "relu"),
        gated_mlp=False,
        position=PositionKind.LEARNED,
        position_offset=POSITION_OFFSET,
        rope=None,
        post_layer_norm=not before,
        final_norm=before and not r.bool_("_remove_final_layer_norm", False),
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="opt",
    model_types=("opt",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="OPTInferenceConfig",
        causal_lm="NeuronOPTForCausalLM",
        tnx=("OPTForSampling",),
    ),
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    eagle=False,
    tiny_config={"ffn_dim": 128, "word_embed_proj_dim": 64, "tie_word_embeddings": True},
)

"""BLOOM: the record, its checkpoint layout and its config reader. Pure.

A BLOOM model: token embeddings normed by `word_embeddings_layernorm`, then layers of biased
LayerNorms, a fused `query_key_value` stored head by head ([H, 3, D] rows: `RowOrder.PER_HEAD_QKV`)
and a plain tanh-GELU MLP; no position embeddings but ALiBi (`PositionKind.ALIBI`: each head adds
its slope times the key's position to the attention scores); a final `ln_f` and the lm_head tied
to the embeddings. BLOOM's GELU, `x/2 (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))`, is the tanh
approximation of GELU (`gelu_pytorch_tanh`).

Refused: `apply_residual_connection_post_layernorm` (the residual taken after the norm).
`pretraining_tp` and `slow_but_exact` change only how transformers splits its matmuls.
"""

from __future__ import annotations

from typing import Any

from nxdi.core.families import reader
from nxdi.core.families.gpt2 import refuse_flags
from nxdi.core.families.gpt_neox import final_norm, layer_norms, per_head_attention, plain_mlp
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind, PositionKind
from nxdi.core.weight_table import WeightTable, copy

REQUIRED = ("hidden_size", "n_head", "n_layer", "vocab_size")
"""The attributes the config must give (the rest have transformers' defaults)."""

WEIGHTS = WeightTable(
    before=(
        copy("embed", "embed_tokens.weight", ("V", "E"), source="word_embeddings.weight"),
        copy("embed_norm", "embed_norm.weight", ("E",), source="word_embeddings_layernorm.weight"),
        copy("embed_norm_bias", "embed_norm.bias", ("E",), source="word_embeddings_layernorm.bias"),
    ),
    layer=(
        *layer_norms("input_layernorm", "post_attention_layernorm"),
        *per_head_attention("self_attention.query_key_value", "self_attention.dense"),
        *plain_mlp("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    ),
    after=(*final_norm("ln_f"), copy("lm_head", "lm_head.weight", ("V", "E"), linear=True)),
    source_layer_prefix="h.{i}.",
    model_prefix="transformer.",
)
"""A BLOOM checkpoint (`transformer.h.{i}....`) as the decoder program takes it."""


def _read(r: ConfigReader) -> dict[str, Any]:
    refuse_flags(
        r,
        (
            (
                "apply_residual_connection_post_layernorm",
                False,
                "takes each residual after its LayerNorm, which nxdi does not",
            ),
        ),
    )
    dims = reader.heads(r, hidden_key="hidden_size", heads_key="n_head")
    hidden = dims["hidden_size"]
    return dict(
        model_type="bloom",
        **dims,
        num_layers=r.int_("n_layer"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=4 * hidden if hidden else None,
        # ALiBi has no table of positions; the length BLOOM was trained at bounds what is planned
        max_position_embeddings=r.int_("seq_length", 2048),
        norm=NormKind.LAYER,
        norm_eps=r.float_("layer_norm_epsilon", 1e-5, positive=True),
        activation="gelu_pytorch_tanh",
        gated_mlp=False,
        position=PositionKind.ALIBI,
        rope=None,
        embed_norm=True,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="bloom",
    model_types=("bloom",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="BloomInferenceConfig",
        causal_lm="NeuronBloomForCausalLM",
        tnx=("BloomForSampling",),
    ),
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    eagle=False,
    tiny_config={"n_layer": 2, "n_head": 4, "tie_word_embeddings": True},
)

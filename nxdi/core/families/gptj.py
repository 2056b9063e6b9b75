"""GPT-J: the record, its checkpoint layout and its config reader. Pure.

A GPT-J layer: one biased LayerNorm (`ln_1`) feeding both attention and MLP, whose outputs join
the residual together (`parallel_residual`, `shared_layer_norm`); separate q/k/v projections
without biases and RoPE on the first `rotary_dim` dims of each head, turning neighbouring dims
(`rotate_every_two`). The decoder's RoPE turns dims half a rotary span apart, so the q and k rows
are read evens first (`RowOrder.ROTARY_PAIRS`): the same rotation, and q.k unchanged. A plain
gelu_new MLP with biases, and an lm_head with a bias.
"""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.gpt_neox import final_norm, layer_norms, plain_mlp
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind, RopeSpec
from nxdi.core.weight_table import RowOrder, Source, Weight, WeightTable, copy

REQUIRED = ("n_embd", "n_head", "n_layer", "vocab_size")
"""The attributes the config must give (the rest have transformers' defaults)."""

_PAIRS = RowOrder.ROTARY_PAIRS
WEIGHTS = WeightTable(
    before=(copy("embed", "embed_tokens.weight", ("V", "E"), source="wte.weight"),),
    layer=(
        *layer_norms("ln_1", None),
        Weight(
            slot="attn.qkv",
            name="self_attn.Wqkv.weight",
            sources=(
                Source(name="attn.q_proj.weight", shape=("Q", "E"), rows=_PAIRS),
                Source(name="attn.k_proj.weight", shape=("KV", "E"), rows=_PAIRS),
                Source(name="attn.v_proj.weight", shape=("KV", "E")),
            ),
            linear=True,
        ),
        copy("attn.o", "self_attn.o_proj.weight", ("E", "Q"), source="attn.out_proj.weight", linear=True),
        *plain_mlp("mlp.fc_in", "mlp.fc_out"),
    ),
    after=(
        *final_norm("ln_f"),
        copy("lm_head", "lm_head.weight", ("V", "E"), linear=True),
        copy("lm_head_bias", "lm_head.bias", ("V",), when="lm_head_bias"),
    ),
    source_layer_prefix="h.{i}.",
    model_prefix="transformer.",
)
"""A GPT-J checkpoint (`transformer.h.{i}....`, `lm_head.weight`/`.bias`) as the decoder takes it."""


def _read(r: ConfigReader) -> dict[str, Any]:
    dims = reader.heads(r, hidden_key="n_embd", heads_key="n_head")
    hidden, head_dim = dims["hidden_size"], dims["head_dim"]
    rotary = r.opt_int("rotary_dim")
    if rotary is not None and head_dim is not None and (rotary < 2 or rotary % 2 or rotary > head_dim):
        why = f"must be a positive even count up to the head size {head_dim}"
        r.problems.append(Problem.of(r.name("rotary_dim"), rotary, why))
        rotary = None
    return dict(
        model_type="gptj",
        **dims,
        num_layers=r.int_("n_layer"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("n_inner", 4 * hidden if hidden else None),
        max_position_embeddings=r.int_("n_positions", 2048),
        norm=NormKind.LAYER,
        norm_eps=r.float_("layer_norm_epsilon", 1e-5, positive=True),
        activation=r.activation("activation_function", "gelu_new"),
        gated_mlp=False,
        rope=RopeSpec(theta=10000.0),
        rotary_dim=None if rotary == head_dim else rotary,
        parallel_residual=True,
        shared_layer_norm=True,
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        mlp_bias=True,
        lm_head_bias=True,
        attention_upcast=True,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="gptj",
    model_types=("gptj",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="GPTJInferenceConfig",
        causal_lm="NeuronGPTJForCausalLM",
        tnx=("GPTJForSampling",),
    ),
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    eagle=False,
    tiny_config={"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256, "n_inner": 128, "rotary_dim": 8},
)

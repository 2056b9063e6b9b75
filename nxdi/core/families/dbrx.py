"""DBRX: LayerNorm without bias, clamped q/k/v, a mixture of experts stored fused. Pure.

The config nests attention and experts (`attn_config`, `ffn_config`). Each block is Llama-shaped:
`h += attn(norm_1 h)`, `h += experts(norm_2 h)`, with bias-free LayerNorms, the fused `Wqkv`
projection clamped to [-clip_qkv, clip_qkv] before RoPE, and a router choosing `moe_top_k` of
`moe_num_experts` experts per token with a softmax, the chosen weights divided by their p-norm
(p = `moe_normalize_expert_weights`). The checkpoint keeps every expert of a layer in one tensor
per projection, [X*F, E]: `w1` (gate) and `v1` (up) hold each expert's [F, E], `w2` each
expert's down projection transposed; the weight table splits them into the program's [X, ...].
"""

from __future__ import annotations

from typing import Any

from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.model_spec import NormKind
from nxdi.core.weight_table import ExpertRows, WeightTable, copy, split

REQUIRED = (
    "d_model",
    "n_heads",
    "max_seq_len",
    "emb_pdrop",
    "resid_pdrop",
    "pad_token_id",
    "vocab_size",
    "attn_config",
    "ffn_config",
)
"""NxDI's `DbrxInferenceConfig.get_required_attributes`."""


def _normalize(ffn: ConfigReader) -> dict[str, Any]:
    """The chosen experts' weights are divided by their p-norm, p = `moe_normalize_expert_weights`
    (1 when the key is absent, transformers' default; an explicit null turns it off)."""
    key = "moe_normalize_expert_weights"
    if key in ffn.raw and ffn.raw[key] is None:
        return dict(moe_normalize=False)
    return dict(moe_normalize=True, moe_normalize_p=ffn.float_(key, 1.0, positive=True))


def _read(r: ConfigReader) -> dict[str, Any]:
    attn, ffn = r.sub("attn_config"), r.sub("ffn_config")
    return dict(
        model_type="dbrx",
        **reader.heads(r, hidden_key="d_model", heads_key="n_heads", kv=(attn, "kv_n_heads", 1)),
        num_layers=r.int_("n_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=ffn.int_("ffn_hidden_size"),
        max_position_embeddings=r.int_("max_seq_len", 2048),
        norm=NormKind.LAYER,
        norm_bias=False,
        norm_eps=1e-5,  # nn.LayerNorm's default, which transformers' DBRX uses
        activation=ffn.sub("ffn_act_fn").activation("name", "silu"),
        rope=reader.rope(r, legacy_theta=(attn.name("rope_theta"), attn.raw.get("rope_theta"))),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        clip_qkv=attn.opt_float("clip_qkv", positive=True),
        **_normalize(ffn),
        **reader.experts(ffn, experts=("moe_num_experts", 4), top_k=("moe_top_k", 1)),
        **reader.tokens(r),
    )


_ATTN = "norm_attn_norm."

WEIGHTS = WeightTable(
    before=(copy("embed", "embed_tokens.weight", ("V", "E"), source="wte.weight"),),
    layer=(  # the nxdi names are the Llama layout's (the sharding plan's); DBRX has no biases or q/k norms
        copy("input_norm", "input_layernorm.weight", ("E",), source=_ATTN + "norm_1.weight"),
        copy("attn.qkv", "self_attn.Wqkv.weight", ("QKV", "E"), source=_ATTN + "attn.Wqkv.weight", linear=True),
        copy("attn.o", "self_attn.o_proj.weight", ("E", "Q"), source=_ATTN + "attn.out_proj.weight", linear=True),
        copy("post_norm", "post_attention_layernorm.weight", ("E",), source=_ATTN + "norm_2.weight"),
        copy("mlp.router", "mlp.router.weight", ("X", "E"), source="ffn.router.layer.weight"),
        split("mlp.gate", "mlp.experts.gate_proj.weight", "ffn.experts.mlp.w1", ExpertRows.AS_IS),
        split("mlp.up", "mlp.experts.up_proj.weight", "ffn.experts.mlp.v1", ExpertRows.AS_IS),
        split("mlp.down", "mlp.experts.down_proj.weight", "ffn.experts.mlp.w2", ExpertRows.TRANSPOSED),
    ),
    after=(
        copy("norm", "norm.weight", ("E",), source="norm_f.weight"),
        copy("lm_head", "lm_head.weight", ("V", "E"), linear=True),
    ),
    source_layer_prefix="blocks.{i}.",
    model_prefix="transformer.",
)
"""A DBRX checkpoint (`transformer.blocks.{i}....`) as the decoder program takes it."""


RECORD = FamilyRecord(
    name="dbrx",
    model_types=("dbrx",),
    read=_read,
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="DbrxInferenceConfig",
        causal_lm="NeuronDbrxForCausalLM",
        neuron_config="DbrxNeuronConfig",
    ),
    moe=True,
    weights=WEIGHTS,
    program=ProgramKind.DECODER,
    tiny_config={
        # transformers sizes the experts from d_model when the config is built; the tiny base's
        # hidden_size (its alias) is set only afterwards, so d_model is given here as well.
        "d_model": 64,
        # A clip_qkv that binds: the tiny model's q/k/v reach about +-2.9 and a third are clamped.
        # (transformers 5 cannot run DBRX with clip_qkv null: its clamp is given no bound.)
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.75, "rope_theta": 10000.0},
        # p = 2 normalisation: a p that the default (a sum) would not reproduce.
        "ffn_config": {
            "ffn_hidden_size": 48,
            "moe_num_experts": 4,
            "moe_top_k": 2,
            "moe_normalize_expert_weights": 2.0,
        },
    },
)

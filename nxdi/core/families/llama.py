"""Llama: the record, and the Llama checkpoint layout and config reader other families reuse. Pure.

Llama-3 RoPE scaling, GQA and tied embeddings are ModelSpec fields, so they need no code here.
Llama-shaped families read their configs with `read_llama_like` plus their own fields, and share
`LLAMA_WEIGHTS` (Hugging Face's Llama key names, Q, K and V fused into the one `Wqkv` the decoder
program takes).
"""

from __future__ import annotations

from typing import Any

from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind
from nxdi.core.weight_table import Source, Weight, WeightTable, copy, fused, stacked

REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pad_token_id",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "hidden_act",
)
"""NxDI's Llama `get_required_attributes`."""


def _qkv(kind: str, tail: tuple[str, ...], when: str | None = None) -> Any:
    return fused(
        f"attn.qkv{'_bias' if kind == 'bias' else ''}",
        f"self_attn.Wqkv.{kind}",
        (f"self_attn.q_proj.{kind}", ("Q", *tail)),
        (f"self_attn.k_proj.{kind}", ("KV", *tail)),
        (f"self_attn.v_proj.{kind}", ("KV", *tail)),
        when=when,
        linear=kind == "weight",
    )


SELF_ATTENTION: tuple[Weight, ...] = (
    _qkv("weight", ("E",)),
    _qkv("bias", (), when="qkv_bias"),
    copy("attn.o", "self_attn.o_proj.weight", ("E", "Q"), linear=True),
    copy("attn.o_bias", "self_attn.o_proj.bias", ("E",), when="o_bias"),
    copy("attn.q_norm", "self_attn.q_norm.weight", ("D",), when="qk_norm"),
    copy("attn.k_norm", "self_attn.k_norm.weight", ("D",), when="qk_norm"),
)
"""A Llama layer's attention projections (and q/k norms), without the layer norms around them."""
ATTENTION: tuple[Weight, ...] = (
    copy("input_norm", "input_layernorm.weight", ("E",)),
    *SELF_ATTENTION,
    copy("post_norm", "post_attention_layernorm.weight", ("E",)),
)
"""A Llama layer's norms and attention, which the MoE families share."""
GATED_MLP: tuple[Weight, ...] = (
    copy("mlp.gate", "mlp.gate_proj.weight", ("F", "E"), linear=True),
    copy("mlp.up", "mlp.up_proj.weight", ("F", "E"), linear=True),
    copy("mlp.down", "mlp.down_proj.weight", ("E", "F"), linear=True),
    copy("mlp.gate_bias", "mlp.gate_proj.bias", ("F",), when="mlp_bias"),
    copy("mlp.up_bias", "mlp.up_proj.bias", ("F",), when="mlp_bias"),
    copy("mlp.down_bias", "mlp.down_proj.bias", ("E",), when="mlp_bias"),
)
"""A Llama layer's gated MLP."""
EMBED = (copy("embed", "embed_tokens.weight", ("V", "E")),)
HEAD = (copy("norm", "norm.weight", ("E",)), copy("lm_head", "lm_head.weight", ("V", "E"), linear=True))

LLAMA_WEIGHTS = WeightTable(before=EMBED, layer=(*ATTENTION, *GATED_MLP), after=HEAD)
"""A Llama checkpoint as the decoder program takes it."""


def moe_weights(*, router: str, gate: str, up: str, down: str) -> WeightTable:
    """A Llama checkpoint whose MLPs are mixtures of experts: the router's key and each expert's
    gate [F, E], up [F, E] and down [E, F] keys with an `{x}` for the expert (stacked to [X, ...])."""
    return WeightTable(
        before=EMBED,
        layer=(
            *ATTENTION,
            Weight(slot="mlp.router", name="mlp.router.weight", sources=(Source(name=router, shape=("X", "E")),)),
            stacked("mlp.gate", "mlp.experts.gate_proj.weight", gate, ("F", "E")),
            stacked("mlp.up", "mlp.experts.up_proj.weight", up, ("F", "E")),
            stacked("mlp.down", "mlp.experts.down_proj.weight", down, ("E", "F")),
        ),
        after=HEAD,
    )


def read_llama_like(r: ConfigReader, model_type: str, **family: Any) -> dict[str, Any]:
    """ModelSpec fields of a Llama-style config; `family` adds or overrides fields."""
    bias = r.bool_("attention_bias", False)
    common = dict(
        model_type=model_type,
        **reader.heads(
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
        norm_eps=r.float_("rms_norm_eps", 1e-6, positive=True),
        activation=r.activation("hidden_act", "silu"),
        rope=reader.rope(r),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=r.bool_("mlp_bias", False),
        **reader.tokens(r),
    )
    return common | family


RECORD = FamilyRecord(
    name="llama",
    model_types=("llama",),
    read=lambda r: read_llama_like(r, "llama"),
    required_attributes=REQUIRED,
    classes=ClassNames(
        inference_config="LlamaInferenceConfig",
        causal_lm="NeuronLlamaForCausalLM",
        neuron_config="LlamaNeuronConfig",
        tnx=("LlamaForSampling",),
    ),
    weights=LLAMA_WEIGHTS,
    program=ProgramKind.DECODER,
    lora=True,
)

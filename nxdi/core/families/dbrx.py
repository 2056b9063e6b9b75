"""DBRX: LayerNorm without bias, clamped q/k/v, a mixture of experts (planned; no program yet). Pure."""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord
from nxdi.core.model_spec import NormKind


def _read(r: ConfigReader) -> dict[str, Any]:
    attn, ffn = r.sub("attn_config"), r.sub("ffn_config")
    clip = attn.opt_float("clip_qkv", positive=True)
    if clip is not None and clip <= 0:
        attn.problems.append(Problem.of(attn.name("clip_qkv"), clip, "must be positive or null"))
    return dict(
        model_type="dbrx",
        **reader.heads(r, hidden_key="d_model", heads_key="n_heads", kv=(attn, "kv_n_heads", 1)),
        num_layers=r.int_("n_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=ffn.int_("ffn_hidden_size"),
        max_position_embeddings=r.int_("max_seq_len", 2048),
        norm=NormKind.LAYER,
        norm_bias=False,
        norm_eps=1e-5,
        activation=ffn.sub("ffn_act_fn").activation("name", "silu"),
        rope=reader.rope(r, legacy_theta=(attn.name("rope_theta"), attn.raw.get("rope_theta"))),
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        clip_qkv=clip,
        **reader.experts(ffn, experts=("moe_num_experts", 4), top_k=("moe_top_k", 1)),
        **reader.tokens(r),
    )


RECORD = FamilyRecord(
    name="dbrx",
    model_types=("dbrx",),
    read=_read,
    required_attributes=("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size", "attn_config", "ffn_config"),
    classes=ClassNames(inference_config="DbrxInferenceConfig", neuron_config="DbrxNeuronConfig"),
    moe=True,
)

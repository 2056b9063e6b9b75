"""OPT: learned positions (offset 2), biased LayerNorms and projections, a plain ReLU MLP (planned only). Pure."""

from __future__ import annotations

from typing import Any

from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import FamilyRecord
from nxdi.core.model_spec import NormKind, PositionKind


def _read(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool_("enable_bias", True)
    return dict(
        model_type="opt",
        **reader.heads(r, hidden_key="hidden_size", heads_key="num_attention_heads"),
        num_layers=r.int_("num_hidden_layers"),
        vocab_size=r.int_("vocab_size"),
        intermediate_size=r.int_("ffn_dim"),
        max_position_embeddings=r.int_("max_position_embeddings", 2048),
        norm=NormKind.LAYER,
        norm_eps=1e-5,
        activation=r.activation("activation_function", "relu"),
        gated_mlp=False,
        position=PositionKind.LEARNED,
        position_offset=2,
        rope=None,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(name="opt", model_types=("opt",), read=_read)

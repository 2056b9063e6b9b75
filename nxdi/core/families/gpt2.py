"""GPT-2: learned positions, biased LayerNorms and projections, a plain GELU MLP (planned only). Pure."""

from __future__ import annotations

from typing import Any

from nxdi.core.families import reader
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import FamilyRecord
from nxdi.core.model_spec import NormKind, PositionKind


def _read(r: ConfigReader) -> dict[str, Any]:
    heads = reader.heads(r, hidden_key="n_embd", heads_key="n_head")
    hidden = heads["hidden_size"]
    return dict(
        model_type="gpt2",
        **heads,
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
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        **reader.tokens(r),
    )


RECORD = FamilyRecord(name="gpt2", model_types=("gpt2",), read=_read)

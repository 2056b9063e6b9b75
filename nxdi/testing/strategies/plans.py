"""Strategies for the planners: bucket tables, head configurations, small model specs of any kind."""

from __future__ import annotations

from hypothesis import strategies as st

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind, RopeSpec
from nxdi.core.planning import buckets


@st.composite
def bucket_tables(draw: st.DrawFn) -> buckets.BucketTable:
    """Valid tables of any kind, 1-D or 2-D, with a maximum at or above the largest bucket."""
    kind = draw(st.sampled_from(list(Phase)))
    lengths = sorted(draw(st.sets(st.integers(min_value=1, max_value=1 << 16), min_size=1, max_size=8)))
    sizes = sorted(draw(st.sets(st.integers(min_value=1, max_value=64), min_size=1, max_size=4)), reverse=True)
    max_length = draw(st.integers(min_value=lengths[-1], max_value=lengths[-1] + 1000))
    extra = draw(st.integers(min_value=0, max_value=8)) if kind is Phase.SPECULATION else 0
    return buckets.BucketTable(
        kind=kind, lengths=tuple(lengths), batch_sizes=tuple(sizes), max_length=max_length, extra_tokens=extra
    )


@st.composite
def head_configs(draw: st.DrawFn) -> tuple[int, int, int]:
    """`(tp, q, kv)` with kv dividing q: MHA, GQA and MQA shapes over tp degrees 1..64."""
    kv = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 25, 32]))
    group = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]))
    return tp, kv * group, kv


@st.composite
def small_model_specs(draw: st.DrawFn, *, max_layers: int = 4) -> ModelSpec:
    """Small dense (and sometimes MoE) decoder specs with varied head shapes, biases and norms."""
    _, q, kv = draw(head_configs())
    head_dim = draw(st.sampled_from([2, 4, 8]))
    layer_norm = draw(st.booleans())
    experts = draw(st.sampled_from([0, 0, 0, 4]))
    return ModelSpec(
        model_type="opt" if layer_norm else "llama",
        hidden_size=draw(st.integers(min_value=4, max_value=96)),
        num_attention_heads=q,
        num_kv_heads=kv,
        head_dim=head_dim,
        num_layers=draw(st.integers(min_value=1, max_value=max_layers)),
        vocab_size=draw(st.integers(min_value=8, max_value=500)),
        intermediate_size=draw(st.integers(min_value=4, max_value=200)),
        max_position_embeddings=64,
        norm=NormKind.LAYER if layer_norm else NormKind.RMS,
        norm_bias=draw(st.booleans()),
        position_offset=draw(st.sampled_from([0, 2])) if layer_norm else 0,
        gated_mlp=not layer_norm,
        position=PositionKind.LEARNED if layer_norm else PositionKind.ROPE,
        rope=None if layer_norm else RopeSpec(),
        qkv_bias=draw(st.booleans()),
        o_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        num_experts=experts,
        num_experts_per_tok=2 if experts else 0,
    )

"""Strategies for the tensor programs: tiny decoder specs, and random weights drawn from a seed.

- `dense_specs()`: tiny llama/mistral/qwen2/qwen3/gemma3 `ModelSpec`s covering GQA, every RoPE kind, sliding
  windows (per layer too, with a RoPE of their own), biases, q/k norms, tied embeddings, the
  activations and Gemma's norms, scales and soft-capped logits (small enough to run eagerly).
- `random_state_dict(spec, seed)`: a Hugging Face checkpoint-style dict (`model.` keys) of random fp32 tensors.
- `random_weights(spec, seed)`: the same weights as the decoder program's weights value, via the weight plan.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec, NormKind, RopeKind, RopeSpec
from nxdi.core.programs import catalog


@st.composite
def rope_specs(draw: st.DrawFn, max_positions: int) -> RopeSpec:
    kind = draw(st.sampled_from(list(RopeKind)))
    factor = draw(st.sampled_from([2.0, 4.0, 8.0])) if kind is not RopeKind.DEFAULT else 1.0
    original = draw(st.sampled_from([4, 8, 16])) if kind in (RopeKind.LLAMA3, RopeKind.YARN) else None
    return RopeSpec(
        theta=draw(st.sampled_from([100.0, 10000.0, 500000.0])),
        kind=kind,
        factor=factor,
        high_freq_factor=draw(st.sampled_from([2.0, 4.0])),
        original_max_position_embeddings=original,
    )


LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3")
"""The dense families whose layers are Llama's (the mixtures of experts build on them)."""


@st.composite
def dense_specs(
    draw: st.DrawFn, *, max_positions: int = 32, model_types: tuple[str, ...] = (*LLAMA_SHAPED, "gemma3_text")
) -> ModelSpec:
    """A tiny decoder spec of one of `model_types`; `max_positions` is small so dynamic NTK scaling is exercised."""
    model_type = draw(st.sampled_from(model_types))
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    layers = draw(st.integers(1, 2))
    explicit = model_type in ("qwen3", "gemma3_text") and draw(st.booleans())
    qkv_bias = model_type == "qwen2" or draw(st.booleans())
    window = draw(st.integers(1, 8)) if model_type != "llama" and draw(st.booleans()) else None
    full = draw(st.sets(st.integers(0, layers - 1))) if window is not None and model_type != "mistral" else set()
    spec = ModelSpec(
        model_type=model_type,
        hidden_size=draw(st.sampled_from([8, 16, 24])) if explicit else heads * head_dim,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        num_layers=layers,
        vocab_size=draw(st.integers(8, 48)),
        intermediate_size=draw(st.integers(4, 40)),
        max_position_embeddings=max_positions,
        norm_eps=1e-6,
        activation=draw(st.sampled_from(["silu", "gelu", "gelu_pytorch_tanh", "relu"])),
        rope=draw(rope_specs(max_positions)),
        tie_word_embeddings=draw(st.booleans()),
        qkv_bias=qkv_bias,
        o_bias=model_type != "qwen2" and draw(st.booleans()),
        mlp_bias=model_type == "llama" and draw(st.booleans()),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=window,
        full_attention_layers=tuple(sorted(full)),
    )
    return _gemma(draw, spec, max_positions) if model_type == "gemma3_text" else spec


def _gemma(draw: st.DrawFn, spec: ModelSpec, max_positions: int) -> ModelSpec:
    """Gemma 3's fields on a drawn spec: `1 + w` and sandwich norms, the scales, a local RoPE, a logit cap."""
    return attrs.evolve(
        spec,
        o_bias=spec.qkv_bias,  # Gemma's attention_bias covers both
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=spec.hidden_size**0.5,
        attention_scale=draw(st.sampled_from([0.1, 0.25, 0.5])),
        final_logit_softcap=draw(st.sampled_from([None, 1.0, 30.0])),
        local_rope=draw(rope_specs(max_positions)) if spec.sliding_window is not None else None,
    )


@st.composite
def moe_specs(draw: st.DrawFn, *, max_positions: int = 32) -> ModelSpec:
    """A tiny mixture-of-experts spec (Mixtral, Qwen3-MoE or DBRX): a dense spec's attention with
    2-4 experts of which 1 to all are chosen per token; DBRX's with bias-free LayerNorms, clamped
    q/k/v (some clips bind, some do not) and a p-norm renormalisation."""
    base = draw(dense_specs(max_positions=max_positions, model_types=LLAMA_SHAPED))
    model_type = draw(st.sampled_from(["mixtral", "qwen3_moe", "dbrx"]))
    experts = draw(st.integers(2, 4))
    dbrx = model_type == "dbrx"
    return attrs.evolve(
        base,
        model_type=model_type,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=model_type == "qwen3_moe",
        sliding_window=None if dbrx else base.sliding_window,
        full_attention_layers=base.full_attention_layers if model_type == "qwen3_moe" else (),
        norm=NormKind.LAYER if dbrx else NormKind.RMS,
        norm_bias=not dbrx,
        clip_qkv=draw(st.sampled_from([None, 0.5, 8.0])) if dbrx else None,
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, experts)),
        moe_normalize=draw(st.booleans()),
        moe_normalize_p=draw(st.sampled_from([1.0, 2.0])) if dbrx else 1.0,
    )


def decoder_specs(*, max_positions: int = 32) -> st.SearchStrategy[ModelSpec]:
    """Dense and mixture-of-experts specs."""
    return st.one_of(dense_specs(max_positions=max_positions), moe_specs(max_positions=max_positions))


def program_of(spec: ModelSpec) -> catalog.Program:
    """The program (and weight table) of `spec`'s family."""
    return families.record_for(spec.model_type).bind(lambda r: catalog.program_for(r, spec)).unwrap()


def plan_of(spec: ModelSpec, **kwargs: Any) -> weights.WeightPlan:
    """The weight plan of `spec`'s family (kwargs: cast_type, torch_dtype, prefixes)."""
    return weights.weight_plan_for(program_of(spec).table, spec, **kwargs).unwrap()


def checkpoint_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Checkpoint key (as Hugging Face stores it) -> shape of a well-formed checkpoint of `spec`."""
    plan = plan_of(spec)
    return {plan.stored_key(name): shape for name, shape in plan.source_shapes().items()}


def random_state_dict(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under Hugging Face keys (the family's prefix, `model.` or DBRX's
    `transformer.`; no `lm_head` when tied)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in checkpoint_shapes(spec).items():
        if "norm" in key.rsplit(".", 2)[-2]:  # a norm's weight (`input_layernorm`, DBRX's `norm_1`, ...)
            out[key] = 1.0 + 0.2 * torch.randn(shape, generator=g)
        else:
            out[key] = torch.randn(shape, generator=g) * (0.5 if len(shape) == 1 else shape[-1] ** -0.5)
    return out


def cast_floats(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`tensors` with their floating ones cast to `dtype` (integer ones as they are)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def random_weights(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """`random_state_dict` converted by the weight plan into the program's weights value, its
    floating tensors cast to `dtype` (the same draws whatever the dtype)."""
    tensors = weight_ops.convert(plan_of(spec), random_state_dict(spec, seed)).unwrap()
    return program_of(spec).weights(cast_floats(tensors, dtype), spec=spec)

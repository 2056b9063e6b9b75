"""The dense decoder program (Llama and the families that are Llama plus flags). Pure.

Covers Llama (incl. Llama-3 RoPE scaling, GQA, tied embeddings), Mistral (`spec.sliding_window`),
Qwen2 (`spec.qkv_bias`) and Qwen3 (`spec.qk_norm`, explicit `spec.head_dim`): every difference is a
field of the `ModelSpec`, decided when the program is traced, never from tensor values.

One step, context encoding or token generation alike (the shapes say which):
    h = embed[input_ids]                                   [B*S, E]
    per layer: h += o(attn(rope(q), cache <- rope(k), v))  then  h += down(act(gate h) * up h)
    logits = lm_head(norm(h at last_index))                [B, 1, V] fp32 (or [B, S, V])
Keys/values are written into the cache view at each token's slot before attention reads it, so
the current token attends to itself; the mask allows slots `<= position` (within the sliding
window), which is causal attention inside a prompt and "everything cached so far" in decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import inputs, kv_cache, layers
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache

_LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("input_norm", "input_layernorm.weight"),
    ("qkv", "self_attn.Wqkv.weight"),
    ("qkv_bias", "self_attn.Wqkv.bias"),
    ("q", "self_attn.q_proj.weight"),
    ("k", "self_attn.k_proj.weight"),
    ("v", "self_attn.v_proj.weight"),
    ("q_bias", "self_attn.q_proj.bias"),
    ("k_bias", "self_attn.k_proj.bias"),
    ("v_bias", "self_attn.v_proj.bias"),
    ("o", "self_attn.o_proj.weight"),
    ("o_bias", "self_attn.o_proj.bias"),
    ("q_norm", "self_attn.q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight"),
    ("post_norm", "post_attention_layernorm.weight"),
    ("gate", "mlp.gate_proj.weight"),
    ("up", "mlp.up_proj.weight"),
    ("down", "mlp.down_proj.weight"),
    ("gate_bias", "mlp.gate_proj.bias"),
    ("up_bias", "mlp.up_proj.bias"),
    ("down_bias", "mlp.down_proj.bias"),
)
"""Field -> nxdi name suffix under `layers.{i}.`, in `nxdi.core.weight_plan.weight_names` order."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class LayerWeights:
    """One decoder layer. Linear weights are [out, in]; absent optional parts are None.

    Attention takes either the fused `qkv` [(H+2K)*D, E] or `q` [H*D, E], `k`/`v` [K*D, E].
    """

    input_norm: Tensor
    o: Tensor
    post_norm: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    qkv: Tensor | None = None
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    qkv_bias: Tensor | None = None
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    gate_bias: Tensor | None = None
    up_bias: Tensor | None = None
    down_bias: Tensor | None = None

    def to_tensors(self, prefix: str = "") -> dict[str, Tensor]:
        """nxdi name -> tensor for the parts present, in binding order."""
        out = {prefix + name: getattr(self, f) for f, name in _LAYER_NAMES}
        return {k: t for k, t in out.items() if t is not None}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], prefix: str = "") -> LayerWeights:
        """The inverse of `to_tensors`: reads the names present under `prefix`."""
        return cls(**{f: tensors[prefix + name] for f, name in _LAYER_NAMES if prefix + name in tensors})


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class LlamaWeights:
    """All weights of a dense decoder. `lm_head` may be the `embed` tensor itself (tied)."""

    embed: Tensor
    """[V, E]"""
    layers: tuple[LayerWeights, ...]
    norm: Tensor
    """[E]"""
    lm_head: Tensor
    """[V, E]"""

    def to_tensors(self) -> dict[str, Tensor]:
        """Flat nxdi name -> tensor, in `nxdi.core.weight_plan.weight_names` order (tied: the same tensor twice)."""
        out = {"embed_tokens.weight": self.embed}
        for i, lw in enumerate(self.layers):
            out.update(lw.to_tensors(f"layers.{i}."))
        return out | {"norm.weight": self.norm, "lm_head.weight": self.lm_head}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], *, spec: ModelSpec) -> LlamaWeights:
        """Weights from nxdi names (the output of a weight plan); `lm_head` defaults to the embedding."""
        embed = tensors["embed_tokens.weight"]
        return cls(
            embed=embed,
            layers=tuple(LayerWeights.from_tensors(tensors, f"layers.{i}.") for i in range(spec.num_layers)),
            norm=tensors["norm.weight"],
            lm_head=tensors.get("lm_head.weight", embed),
        )


def _project_qkv(lw: LayerWeights, x: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor, Tensor]:
    """q [N, H*D], k and v [N, K*D] from x [N, E], with one fused matmul when the weights are fused."""
    if lw.qkv is not None:
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # [N, (H+2K)*D]
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        return q, k, v
    assert lw.q is not None and lw.k is not None and lw.v is not None
    return F.linear(x, lw.q, lw.q_bias), F.linear(x, lw.k, lw.k_bias), F.linear(x, lw.v, lw.v_bias)


def _attention(
    lw: LayerWeights,
    x: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    rope: tuple[Tensor, Tensor],
    mask: Tensor,
    slots: Tensor,
    spec: ModelSpec,
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-attention of normed x [N, E] (N = B*S): returns [N, E] and the written k/v caches [B, K, T, D]."""
    b, s = slots.shape
    h, kh, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = _project_qkv(lw, x, spec)
    q, k, v = q.view(b, s, h, d), k.view(b, s, kh, d), v.view(b, s, kh, d)
    if lw.q_norm is not None and lw.k_norm is not None:
        q, k = layers.rms_norm(q, lw.q_norm, spec.norm_eps), layers.rms_norm(k, lw.k_norm, spec.norm_eps)
    q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
    k_cache = kv_cache.write(k_cache, k.transpose(1, 2), slots)
    v_cache = kv_cache.write(v_cache, v.transpose(1, 2), slots)
    o = layers.attend(q, k_cache, v_cache, mask)  # [B, S, H*D]
    return F.linear(o.view(b * s, h * d), lw.o, lw.o_bias), k_cache, v_cache


def _mlp(lw: LayerWeights, x: Tensor, spec: ModelSpec) -> Tensor:
    biases = (lw.gate_bias, lw.up_bias, lw.down_bias)
    return layers.gated_mlp(x, lw.gate, lw.up, lw.down, activation=spec.activation, biases=biases)


def _rope_tables(x: StepInputs, slots: Tensor, spec: ModelSpec, w: LlamaWeights) -> tuple[Tensor, Tensor]:
    """cos/sin [B, S, 1, D] at every token's slot (= its position for real tokens)."""
    assert spec.rope is not None, "the dense decoder uses rotary positions"
    seq_len = slots.gather(1, x.last_index[:, None]).max() + 1  # longest real sequence (dynamic NTK)
    cos, sin = layers.rope_cos_sin(
        spec.rope,
        slots,
        head_dim=spec.head_dim,
        max_positions=spec.max_position_embeddings,
        dtype=w.embed.dtype,
        seq_len=seq_len,
    )
    return cos[:, :, None], sin[:, :, None]


def forward(
    w: LlamaWeights, cache: KVCache, x: StepInputs, *, spec: ModelSpec, all_logits: bool = False
) -> tuple[Tensor, KVCache]:
    """One decoder step over the cache view `cache` (T slots).

    Args:
        w: the weights.
        cache: L layers of [B, K, T, D]; T is the bucket length.
        x: input_ids/position_ids [B, S], last_index [B] (see `nxdi.core.programs.inputs`).
        spec: the architecture.
        all_logits: return logits of all S tokens instead of the last real one per row.

    Returns:
        logits [B, 1, V] fp32 (or [B, S, V] with `all_logits`), and the cache with this step's keys
        and values written at the tokens' slots; every other slot unchanged. Inputs are not mutated.
    """
    b, s = x.input_ids.shape
    slots = inputs.write_slots(x)  # [B, S]
    rope = _rope_tables(x, slots, spec, w)
    groups = spec.num_attention_heads // spec.num_kv_heads
    mask = layers.fold_mask(layers.visible_mask(slots, cache.length, window=spec.sliding_window), groups)
    h = F.embedding(x.input_ids, w.embed).view(b * s, -1)  # [B*S, E]
    ks, vs = [], []
    for lw, k_cache, v_cache in zip(w.layers, cache.k, cache.v, strict=True):
        normed = layers.rms_norm(h, lw.input_norm, spec.norm_eps)
        a, k_cache, v_cache = _attention(lw, normed, k_cache, v_cache, rope=rope, mask=mask, slots=slots, spec=spec)
        h = h + a
        h = h + _mlp(lw, layers.rms_norm(h, lw.post_norm, spec.norm_eps), spec)
        ks.append(k_cache)
        vs.append(v_cache)
    h = h.view(b, s, -1)
    if not all_logits:
        h = h.gather(1, x.last_index[:, None, None].expand(b, 1, h.shape[-1]))  # [B, 1, E]
    logits = F.linear(layers.rms_norm(h, w.norm, spec.norm_eps), w.lm_head).float()
    return logits, KVCache(k=tuple(ks), v=tuple(vs))

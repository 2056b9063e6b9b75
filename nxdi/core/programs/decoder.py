"""The decoder program: Llama and every family that is Llama plus ModelSpec fields. Pure.

Covers RoPE (every scaling kind), GQA, tied embeddings, sliding windows (`spec.sliding_window`, per
layer with `spec.full_attention_layers`), projection biases (`spec.qkv_bias`, `o_bias`,
`mlp_bias`), per-head q/k RMSNorm (`spec.qk_norm`) and an explicit `spec.head_dim`: every
difference between the families it runs is a field of the `ModelSpec`, decided when the program is
traced, never from tensor values. The weights come in one layout (fused QKV), built from the
family's weight table by `weights_from_slots`.

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

from nxdi.core.model_spec import MlpKind, ModelSpec
from nxdi.core.programs import inputs, kv_cache, layers
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Attention:
    """Self-attention weights of one layer. Linear weights are [out, in]; absent optional parts are None."""

    qkv: Tensor
    """[(H + 2K) * D, E]: Q, K and V projections fused (the one layout; the weight plan fuses)."""
    o: Tensor
    """[E, H * D]"""
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None
    """[D] per-head RMSNorm of q and k before RoPE (`spec.qk_norm`)."""
    k_norm: Tensor | None = None


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class GatedMLP:
    """`down(act(gate x) * up x)`: gate, up [F, E], down [E, F], optional biases."""

    gate: Tensor
    up: Tensor
    down: Tensor
    gate_bias: Tensor | None = None
    up_bias: Tensor | None = None
    down_bias: Tensor | None = None


MLP = GatedMLP
"""The feed-forward block of a layer, one case per `ModelSpec.mlp_kind` the program runs (MoE and
the plain two-matrix MLP join as further cases, each handled by a `match` in `_mlp`)."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Layer:
    """One decoder layer."""

    input_norm: Tensor
    """[E]"""
    attn: Attention
    post_norm: Tensor
    """[E]"""
    mlp: MLP


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class DecoderWeights:
    """All weights of the decoder. `lm_head` may be the `embed` tensor itself (tied)."""

    embed: Tensor
    """[V, E]"""
    layers: tuple[Layer, ...]
    norm: Tensor
    """[E]"""
    lm_head: Tensor
    """[V, E]"""


def _group(slots: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The slots under `prefix.`, by their remaining name."""
    return {k[len(prefix) + 1 :]: v for k, v in slots.items() if k.startswith(prefix + ".")}


def _mlp_weights(parts: Mapping[str, Tensor], spec: ModelSpec) -> MLP:
    match spec.mlp_kind:
        case MlpKind.GATED:
            return GatedMLP(**parts)
    raise ValueError(f"the decoder program has no {spec.mlp_kind.value} MLP (checked by programs.catalog)")


def weights_from_slots(slots: Mapping[str, Tensor], *, spec: ModelSpec) -> DecoderWeights:
    """The weights value from slot paths (`WeightTable.slots`): `embed`, `layers.{i}.attn.qkv`, ...

    Raises:
        TypeError: a slot the table declares has no field here (a table and program out of step).
    """

    def layer(i: int) -> Layer:
        parts = _group(slots, f"layers.{i}")
        return Layer(
            input_norm=parts["input_norm"],
            attn=Attention(**_group(parts, "attn")),
            post_norm=parts["post_norm"],
            mlp=_mlp_weights(_group(parts, "mlp"), spec),
        )

    return DecoderWeights(
        embed=slots["embed"],
        layers=tuple(layer(i) for i in range(spec.num_layers)),
        norm=slots["norm"],
        lm_head=slots["lm_head"],
    )


def _attention(
    w: Attention,
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
    q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q, k, v = q.view(b, s, h, d), k.view(b, s, kh, d), v.view(b, s, kh, d)
    if spec.qk_norm:
        assert w.q_norm is not None and w.k_norm is not None, "qk_norm needs q_norm and k_norm weights"
        q, k = layers.rms_norm(q, w.q_norm, spec.norm_eps), layers.rms_norm(k, w.k_norm, spec.norm_eps)
    q, k = layers.apply_rope(q, *rope), layers.apply_rope(k, *rope)
    k_cache = kv_cache.write(k_cache, k.transpose(1, 2), slots)
    v_cache = kv_cache.write(v_cache, v.transpose(1, 2), slots)
    o = layers.attend(q, k_cache, v_cache, mask)  # [B, S, H*D]
    return F.linear(o.view(b * s, h * d), w.o, w.o_bias), k_cache, v_cache


def _mlp(m: MLP, x: Tensor, spec: ModelSpec) -> Tensor:
    """The feed-forward block of normed x [N, E] -> [N, E]."""
    match m:
        case GatedMLP():
            biases = (m.gate_bias, m.up_bias, m.down_bias)
            return layers.gated_mlp(x, m.gate, m.up, m.down, activation=spec.activation, biases=biases)


def _masks(slots: Tensor, length: int, spec: ModelSpec) -> list[Tensor]:
    """Each layer's attention mask [B, 1, G*S, T]; layers with the same window share one tensor."""
    groups = spec.num_attention_heads // spec.num_kv_heads
    built: dict[int | None, Tensor] = {}
    out = []
    for i in range(spec.num_layers):
        window = spec.layer_window(i)
        if window not in built:
            built[window] = layers.fold_mask(layers.visible_mask(slots, length, window=window), groups)
        out.append(built[window])
    return out


def _rope_tables(x: StepInputs, slots: Tensor, spec: ModelSpec, w: DecoderWeights) -> tuple[Tensor, Tensor]:
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
    w: DecoderWeights, cache: KVCache, x: StepInputs, *, spec: ModelSpec, all_logits: bool = False
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
    masks = _masks(slots, cache.length, spec)
    h = F.embedding(x.input_ids, w.embed).view(b * s, -1)  # [B*S, E]
    ks, vs = [], []
    for lw, mask, k_cache, v_cache in zip(w.layers, masks, cache.k, cache.v, strict=True):
        normed = layers.rms_norm(h, lw.input_norm, spec.norm_eps)
        a, k_cache, v_cache = _attention(
            lw.attn, normed, k_cache, v_cache, rope=rope, mask=mask, slots=slots, spec=spec
        )
        h = h + a
        h = h + _mlp(lw.mlp, layers.rms_norm(h, lw.post_norm, spec.norm_eps), spec)
        ks.append(k_cache)
        vs.append(v_cache)
    h = h.view(b, s, -1)
    if not all_logits:
        h = h.gather(1, x.last_index[:, None, None].expand(b, 1, h.shape[-1]))  # [B, 1, E]
    logits = F.linear(layers.rms_norm(h, w.norm, spec.norm_eps), w.lm_head).float()
    return logits, KVCache(k=tuple(ks), v=tuple(vs))

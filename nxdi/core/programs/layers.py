"""Transformer building blocks as functions of tensors: RMSNorm, LayerNorm, RoPE, masks, attention, MLP. Pure.

Numerics follow Hugging Face transformers (the accuracy reference): RMSNorm runs in fp32 and is
cast back before the weight multiply; RoPE tables are computed in fp32 from the position ids and
cast to the activation dtype; attention is `F.scaled_dot_product_attention` with a boolean mask.

GQA without repeating K/V: the G query heads that share a kv head are folded into the query-length
axis (`[B, K, G*S, D]`), so one plain SDPA call over K heads does the work and the cache is read as
stored. (Measured on 2 CPU threads this beats both `enable_gqa=True` and an explicit
`repeat_interleave`, most of all in bf16 decode; it also needs no backend support for GQA.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.model_spec import RopeKind, RopeSpec
from nxdi.core.programs.linear import Weight, linear


def at_least_fp32(x: Tensor) -> Tensor:
    """`x` in fp32, or as it is in float64: the upcast of a bf16/fp16/float8 computation that must
    not round a float64 program down."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, offset: bool = False) -> Tensor:
    """RMSNorm over the last dim: `weight * (x / rms(x))`, the division in fp32. x [..., N], weight [N].

    transformers' `(x.float() * rsqrt(mean(x**2) + eps)).to(dtype)` is `F.rms_norm(x)`, which
    computes in fp32 for bf16/fp16 input and rounds once at the end (bit for bit the same): one
    traced op instead of seven, and a decode step runs two per layer.

    With `offset` (Gemma), the scale is `1 + weight`, and both it and the product stay in fp32 until
    one rounding at the end, as transformers' Gemma3RMSNorm computes (`(1 + w)` in bf16 would round)."""
    if not offset:
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return F.rms_norm(at_least_fp32(x), (x.shape[-1],), 1.0 + at_least_fp32(weight), eps=eps).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, eps: float, bias: Tensor | None = None) -> Tensor:
    """LayerNorm over the last dim: `weight * (x - mean(x)) / sqrt(var(x) + eps) + bias`, which is
    `nn.LayerNorm(N)` (`bias=False` without one, DBRX), in x's dtype as transformers runs it. x [..., N], weight [N]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# --- rotary position embeddings ----------------------------------------------------------------


def _exponents(dim: int, device: torch.device) -> Tensor:
    """[D/2] fp32: `2i / D`."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _base_inv_freq(theta: float, dim: int, device: torch.device) -> Tensor:
    """[D/2] fp32: `1 / theta ** (2i / D)`."""
    return 1.0 / (theta ** _exponents(dim, device))


def _llama3_inv_freq(rope: RopeSpec, dim: int, max_positions: int, device: torch.device) -> Tensor:
    """Llama-3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv = _base_inv_freq(rope.theta, dim, device)
    old = rope.original_max_position_embeddings or max_positions
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeSpec, dim: int, max_positions: int, device: torch.device) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, with a linear ramp between."""
    factor, base = rope.factor, rope.theta
    original = rope.original_max_position_embeddings or max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    pos_freqs = base ** _exponents(dim, device)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    scale = rope.attention_factor
    if scale is None:
        scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return inv, scale


def _dynamic_inv_freq(rope: RopeSpec, dim: int, max_positions: int, seq_len: Tensor) -> Tensor:
    """Dynamic NTK: the base grows once the longest sequence in the batch passes `max_positions`."""
    seq_len = seq_len.float()
    grown = rope.theta * ((rope.factor * seq_len / max_positions) - (rope.factor - 1)) ** (dim / (dim - 2))
    base = torch.where(seq_len > max_positions, grown, torch.full_like(grown, rope.theta))
    return 1.0 / (base ** _exponents(dim, seq_len.device))


def rope_cos_sin(
    rope: RopeSpec,
    positions: Tensor,
    *,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    seq_len: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables [B, S, D] for positions [B, S], in `dtype` (computed in fp32).

    `max_positions` is the model's `max_position_embeddings` (llama3/yarn fall back to it when the
    original length is not given; dynamic NTK scales past it). `seq_len` (a 0-d tensor) is the
    longest real sequence in the batch, used by dynamic NTK only; it defaults to `positions.max() + 1`.
    """
    scale, device = 1.0, positions.device
    match rope.kind:
        case RopeKind.DEFAULT:
            inv = _base_inv_freq(rope.theta, head_dim, device)
        case RopeKind.LINEAR:
            inv = _base_inv_freq(rope.theta, head_dim, device) / rope.factor
        case RopeKind.LLAMA3:
            inv = _llama3_inv_freq(rope, head_dim, max_positions, device)
        case RopeKind.YARN:
            inv, scale = _yarn_inv_freq(rope, head_dim, max_positions, device)
        case RopeKind.DYNAMIC:
            longest = positions.max() + 1 if seq_len is None else seq_len
            inv = _dynamic_inv_freq(rope, head_dim, max_positions, longest)
    freqs = positions[..., None].float() * inv  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def signed_sin(sin: Tensor) -> Tensor:
    """`[-s1, s2]` for a sin table `[s1, s2]` [..., D]: the sign `rotate_half` puts on x's second half,
    moved into the table (computed once per step, not once per layer and projection)."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate x [B, S, N, D] by cos and `signed_sin(sin)` [B, S, 1, D] (the non-interleaved "rotate
    half" layout). transformers computes `x * cos + cat(-x2, x1) * sin`; `roll(x, D/2) * signed_sin`
    is `cat(x2, x1) * cat(-s1, s2)`, the same products bit for bit, in one op instead of five."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


# --- attention ---------------------------------------------------------------------------------


def visible_mask(positions: Tensor, length: int, *, window: int | None = None) -> Tensor:
    """Which cache slots each query may attend to: bool [B, 1, S, T] for query positions [B, S].

    Slot t holds position t (right padding, positional cache), so query position p sees slots
    `t <= p`, and with a sliding window only `p - t < window`. Slot p itself is always visible, so
    no row is empty (an empty row would give NaN).
    """
    t = torch.arange(length, device=positions.device)
    p = positions[:, None, :, None]  # [B, 1, S, 1]
    mask = t <= p
    if window is not None:
        mask = mask & (p - t < window)
    return mask


def fold_mask(mask: Tensor, groups: int) -> Tensor:
    """A [B, 1, S, T] mask repeated for the G folded query heads: [B, 1, G*S, T]."""
    b, _, s, t = mask.shape
    if groups == 1:
        return mask
    return mask[:, :, None].expand(b, 1, groups, s, t).reshape(b, 1, groups * s, t)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None = None) -> Tensor:
    """Grouped-query attention of q [B, S, H, D] over a cache k, v [B, K, T, D] -> [B, S, H*D].

    `mask` is `fold_mask(visible_mask(...), H // K)`: bool [B, 1, G*S, T]. Query head h uses kv head
    h // G (the Hugging Face `repeat_kv` order). The cache is cast to q's dtype when they differ.
    `scale` multiplies the scores (`ModelSpec.attention_scale`); None: 1/sqrt(D).
    """
    b, s, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    qf = q.view(b, s, kh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kh, g * s, d)  # [B, K, G*S, D]
    o = F.scaled_dot_product_attention(qf, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return o.view(b, kh, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)


# --- MLP ---------------------------------------------------------------------------------------


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,  # the GPT-OSS style swiglu experts' gate activation
}
"""Hugging Face `hidden_act` names -> functions."""


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The function for a Hugging Face `hidden_act` name.

    Raises:
        ValueError: an unknown name.
    """
    fn = ACTIVATION_FNS.get(name)
    if fn is None:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(sorted(ACTIVATION_FNS))})")
    return fn


def gated_mlp(
    x: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    *,
    activation: str,
    biases: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
) -> Tensor:
    """`down(act(gate(x)) * up(x))`: x [N, E], gate/up [F, E], down [E, F] -> [N, E]."""
    act = ACTIVATION_FNS[activation]
    return linear(act(linear(x, gate, biases[0])) * linear(x, up, biases[1]), down, biases[2])

"""Tiny pure flat programs for the backend and artifact tests (a weight, a cache, an input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.effects.backends.base import Signature

E, V, T, B = 64, 96, 16, 2
CALLS = {"n": 0}
"""How many times a program body ran (tracing runs it; a loaded program never does)."""

SIGNATURE = Signature(weights=("proj.weight", "out.weight"), cache=("cache",), inputs=("x", "pos"), outputs=("y",))


def step(w: Tensor, w_out: Tensor, cache: Tensor, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, S, E] at positions pos [S]: write proj(x) into cache [B, T, E], read it back, project.

    Returns y [B, 1, V] fp32 and the new cache (out of place, `index_copy`).
    """
    CALLS["n"] += 1
    h = F.linear(x, w)  # [B, S, E]
    cache = cache.index_copy(1, pos, h.to(cache.dtype))
    seen = (torch.arange(cache.shape[1]) <= pos[-1]).to(cache.dtype)  # [T]
    ctx = (cache * seen[None, :, None]).sum(1, keepdim=True)  # [B, 1, E]
    return F.linear(torch.tanh(ctx + h[:, -1:]), w_out).float(), cache


def scatter_step(w: Tensor, w_out: Tensor, cache: Tensor, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """`step` with the cache written by `scatter` (the form of nxdi.core.programs.kv_cache.write)."""
    CALLS["n"] += 1
    h = F.linear(x, w)
    index = pos[None, :, None].expand(h.shape[0], h.shape[1], h.shape[2])
    cache = cache.scatter(1, index, h.to(cache.dtype))
    seen = (torch.arange(cache.shape[1]) <= pos[-1]).to(cache.dtype)
    ctx = (cache * seen[None, :, None]).sum(1, keepdim=True)
    return F.linear(torch.tanh(ctx + h[:, -1:]), w_out).float(), cache


def flat_step(w: Tensor, w_out: Tensor, cache: Tensor, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """`step` on 2-D activations [B*S, E], with a same-dtype conversion and a constant that needs no input."""
    CALLS["n"] += 1
    b, s, e = x.shape
    scale = 1.0 / (10.0 ** (torch.arange(0, e, dtype=torch.float32) / e))  # [E], the same on every call
    h = (F.linear(x.reshape(b * s, e).to(x.dtype), w) * scale.to(x.dtype)).view(b, s, e)
    cache = cache.index_copy(1, pos, h.to(cache.dtype))
    seen = (torch.arange(cache.shape[1]) <= pos[-1]).to(cache.dtype)
    ctx = (cache * seen[None, :, None]).sum(1, keepdim=True)
    return F.linear(torch.tanh(ctx + h[:, -1:]), w_out).float(), cache


def reread_step(w: Tensor, w_out: Tensor, cache: Tensor, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Reads the *old* cache after writing the new one, so the write must stay out of place."""
    CALLS["n"] += 1
    h = F.linear(x, w)
    new = cache.index_copy(1, pos, h.to(cache.dtype))
    y = F.linear(torch.tanh(new.sum(1, keepdim=True) - cache.sum(1, keepdim=True)), w_out).float()
    return y, new


def broken_step(w: Tensor, w_out: Tensor, cache: Tensor, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Fails while tracing (stands in for a compiler crash or an interrupt halfway through a compile)."""
    CALLS["n"] += 1
    raise RuntimeError("simulated failure while tracing")


def weights(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, E, generator=g) / 8).to(dtype), (torch.randn(V, E, generator=g) / 8).to(dtype)


def example(s: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    """W + C + I example tensors for a bucket of s tokens."""
    return (*weights(0, dtype), torch.zeros(B, T, E, dtype=dtype), torch.zeros(B, s, E, dtype=dtype), torch.arange(s))


def inputs(seed: int, s: int, start: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, s, E, generator=g).to(dtype), torch.arange(start, start + s)

"""The KV cache as a value: one key and one value tensor per layer, written out of place. Pure.

Layout per layer is BHSD, `[B, K, T, D]` (REFERENCE §6): row b of the batch, kv head, cache slot,
head dim. Slot t holds the token at position t (right padding). A program receives a cache *view*
whose length T is the bucket being run, and returns a new cache of the same shape; the runtime
splices it back into the full cache. `write` is the one place a cache changes; an in-place variant
(index_put_/scatter_ for CPU reinplacing, Neuron aliasing) lives in effects and must agree with it.

A quantized cache (`kv_cache_quant`, `kv_quant_config`) is a float8 tensor: values are cast to it
when written (`store`, NxD's direct cast) and cast back to the compute dtype when attention reads
them (`layers.attend`). `store` saturates at the float8 dtype's largest finite value (448 for
float8_e4m3fn, 57344 for float8_e5m2): a plain cast gives NaN past 448 on some torch versions
(2.9) and saturates on others (2.13), and NaN or inf in the cache would spread through attention.
CPU torch has no scatter/gather kernels for float8, so there those run on the cache's bytes (`bits`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class KVCache:
    """Per-layer keys and values, each [B, K, T, D]."""

    k: tuple[Tensor, ...]
    v: tuple[Tensor, ...]

    @property
    def length(self) -> int:
        """T, the number of cache slots."""
        return int(self.k[0].shape[2])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def to_tensors(self) -> tuple[Tensor, ...]:
        """Flat `(L0.K, L0.V, L1.K, L1.V, ...)`, NxDI's `past_key_values` order."""
        return tuple(t for pair in zip(self.k, self.v, strict=True) for t in pair)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor]) -> KVCache:
        """The inverse of `to_tensors`."""
        assert len(tensors) % 2 == 0, "a KV cache has a key and a value tensor per layer"
        return cls(k=tuple(tensors[0::2]), v=tuple(tensors[1::2]))

    def prefix(self, length: int) -> KVCache:
        """Views of the first `length` slots of every layer (the cache view of a bucket)."""
        return KVCache(k=tuple(t[:, :, :length] for t in self.k), v=tuple(t[:, :, :length] for t in self.v))

    def splice(self, part: KVCache) -> KVCache:
        """A new cache: `part` in the first `part.length` slots, this cache's slots after them."""
        n = part.length

        def join(full: Tensor, head: Tensor) -> Tensor:
            return torch.cat((store(head, full.dtype), full[:, :, n:]), dim=2)

        return KVCache(
            k=tuple(join(f, p) for f, p in zip(self.k, part.k, strict=True)),
            v=tuple(join(f, p) for f, p in zip(self.v, part.v, strict=True)),
        )


def empty_cache(
    spec: ModelSpec,
    *,
    batch: int,
    length: int,
    dtype: torch.dtype,
    heads: int | None = None,
    device: torch.device | None = None,
) -> KVCache:
    """A zero cache of `length` slots for `batch` rows: L layers of [B, K, T, D].

    `heads` is K, the kv heads one rank holds (default: the model's, i.e. one rank).
    """
    shape = (batch, spec.num_kv_heads if heads is None else heads, length, spec.head_dim)
    return KVCache(
        k=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)),
        v=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)),
    )


def write(cache: Tensor, new: Tensor, slots: Tensor) -> Tensor:
    """A copy of `cache` [B, K, T, D] with `new` [B, K, S, D] written at `slots` [B, S] of each row.

    Out of place (`scatter`): `cache` is unchanged. Slots within a row must be distinct and < T.
    """
    b, k, s, d = new.shape
    index = slots[:, None, :, None].expand(b, k, s, d)
    return scatter(cache, 2, index, new)


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The quantized cache dtypes."""


def store(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` cast to the cache dtype `dtype`; to a float8 dtype, saturated at its largest finite value."""
    if dtype in FLOAT8 and x.dtype != dtype:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def bits(t: Tensor) -> Tensor:
    """A float8 tensor on the CPU as its bytes, a uint8 view (the same memory); any other tensor as
    it is. XLA scatters and gathers float8 itself (and a dtype view there is not an HLO op)."""
    return t.view(torch.uint8) if t.dtype in FLOAT8 and t.device.type == "cpu" else t


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of `bits` (no view at all when nothing was viewed, so a plain cache's graph is unchanged)."""
    return t if t.dtype == dtype else t.view(dtype)


def scatter(cache: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """`cache.scatter(dim, index, store(src))`, on the bytes of a float8 cache."""
    return _as(bits(cache).scatter(dim, index, bits(store(src, cache.dtype))), cache.dtype)


def gather(cache: Tensor, dim: int, index: Tensor) -> Tensor:
    """`cache.gather(dim, index)`, on the bytes of a float8 cache."""
    return _as(bits(cache).gather(dim, index), cache.dtype)

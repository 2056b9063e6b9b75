"""The KV cache as a value: one key and one value tensor per layer, written out of place. Pure.

Layout per layer is BHSD, `[B, K, T, D]` (REFERENCE §6): row b of the batch, kv head, cache slot,
head dim. Slot t holds the token at position t (right padding). A program receives a cache *view*
whose length T is the bucket being run, and returns a new cache of the same shape; the runtime
splices it back into the full cache. `write` is the one place a cache changes; an in-place variant
(index_put_/scatter_ for CPU reinplacing, Neuron aliasing) lives in effects and must agree with it.
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
            return torch.cat((head.to(full.dtype), full[:, :, n:]), dim=2)

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
    return cache.scatter(2, index, new.to(cache.dtype))

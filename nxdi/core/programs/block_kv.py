"""The block (paged) KV cache: blocks of positions that sequences own through block tables. Pure.

Layout per layer is `[N + 1, bs, K, D]` (the reference's block layout): block n, offset in the
block, kv head, head dim. Blocks 0..N-1 are the `pa_num_blocks` blocks a serving client hands out;
block N is the garbage block, where writes that go nowhere land (`slot_mapping` -1), so that a
padded token never touches a block someone owns. Position j of a sequence lives in block
`block_table[j // bs]` at offset `j % bs`; its flat slot is `block * bs + offset`.

One step sees rows of tokens. Each row holds R *segments* (R = 1 except in chunked prefill, where
one row concatenates several requests' chunks): every token belongs to a segment (`segment`, -1 for
padding), and every segment has a block table and a prefix of `computed` tokens already cached.
A token attends to its segment's prefix (read from the blocks) and to the earlier tokens of its
segment in this step (their keys come straight from this step, not from the cache), so:

    keys of row b = [prefix of segment 0 | ... | prefix of segment R-1 | this step's S tokens]

masked per query by segment, `computed` and causality (and the sliding window on positions).
Context encoding of a fresh prompt is R = 1 with `computed = 0`; prefix caching is the same with
`computed` > 0 (only the new tokens are computed); token generation is one token over a prefix
of everything cached so far. The step's keys and values are written at `slot_mapping` after the
prefix is read, which lets a compiled CPU program write the cache in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import kv_cache
from nxdi.core.programs.kv_cache import KVCache


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class BlockInputs:
    """Where a block step reads and writes, besides the token ids and positions (`StepInputs`)."""

    slot_mapping: Tensor
    """[B, S] int64 flat cache slot of every token (`block * bs + offset`); -1 writes nowhere."""
    block_table: Tensor
    """[B, R, NB] int64 blocks of each segment's positions 0..NB*bs-1, in order (entries past the
    segment's prefix are never read: any value)."""
    computed: Tensor
    """[B, R] int64 tokens of each segment already in the cache (its prefix)."""
    segment: Tensor
    """[B, S] int64 segment of every token, -1 for padding."""
    out_index: Tensor
    """[B, R] int64 index (0..S-1) of each segment's last token: the token whose logits come back."""

    def to_tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.slot_mapping, self.block_table, self.computed, self.segment, self.out_index

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor]) -> BlockInputs:
        slot_mapping, block_table, computed, segment, out_index = tensors
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            computed=computed,
            segment=segment,
            out_index=out_index,
        )

    @property
    def blocks_per_segment(self) -> int:
        """NB: a segment's prefix spans NB * bs positions (bs is the cache's block size)."""
        return int(self.block_table.shape[-1])


NAMES = ("slot_mapping", "block_table", "computed", "segment", "out_index")
"""The block inputs of a compiled program, in `BlockInputs.to_tensors` order."""


def empty_block_cache(
    spec: ModelSpec,
    *,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    heads: int | None = None,
    device: torch.device | None = None,
) -> KVCache:
    """A zero block cache: L layers of [num_blocks + 1, block_size, K, D] (the last block is garbage).

    `heads` is K, the kv heads one rank holds (default: the model's).
    """
    shape = (num_blocks + 1, block_size, spec.num_kv_heads if heads is None else heads, spec.head_dim)
    return KVCache(
        k=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)),
        v=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)),
    )


def write(cache: Tensor, new: Tensor, slot_mapping: Tensor) -> Tensor:
    """A copy of `cache` [N+1, bs, K, D] with `new` [B, S, K, D] written at `slot_mapping` [B, S].

    Slots of -1 go to the garbage block N. Out of place (`index_put` on the cache itself, so a
    compiled CPU program can turn it into an in-place write).
    """
    n, bs = cache.shape[0] - 1, cache.shape[1]
    flat = slot_mapping.reshape(-1)
    real = flat >= 0
    block = torch.where(real, flat // bs, torch.full_like(flat, n))
    offset = torch.where(real, flat % bs, torch.zeros_like(flat))
    return cache.index_put((block, offset), kv_cache.store(new.reshape(-1, *new.shape[2:]), cache.dtype))


def gather(cache: Tensor, block_table: Tensor) -> Tensor:
    """The prefixes of every segment: cache [N+1, bs, K, D], block_table [B, R, NB] -> [B, K, R*NB*bs, D].

    Entries outside 0..N (the -1 some clients pad with) read block 0; the mask hides them.
    """
    b, r, nb = block_table.shape
    bs, k, d = cache.shape[1:]
    blocks = block_table.clamp(0, cache.shape[0] - 1)
    return cache[blocks.reshape(b, r * nb)].reshape(b, r * nb * bs, k, d).transpose(1, 2)


def visible(positions: Tensor, blocks: BlockInputs, *, block_size: int, window: int | None = None) -> Tensor:
    """Which keys each query sees: bool [B, 1, S, R*P + S] (P = NB * block_size), keys ordered as
    `[prefixes | this step's tokens]`.

    A query of segment r sees prefix slot j of segment r when `j < computed[r]`, and this step's
    token i of segment r when `i <= s`; with a window only keys within `window` positions. A padding
    query (segment -1) sees itself only, so no row of the softmax is empty.
    """
    b, s = positions.shape
    r = blocks.computed.shape[1]
    p = blocks.blocks_per_segment * block_size
    seg_q = blocks.segment[:, :, None]  # [B, S, 1]
    pos_q = positions[:, :, None]
    # Prefix keys: segment of each key, and its position within its segment.
    key_seg = torch.arange(r, device=positions.device).repeat_interleave(p)  # [R*P]
    key_pos = torch.arange(p, device=positions.device).repeat(r)  # [R*P]
    limit = blocks.computed.gather(1, key_seg[None, :].expand(b, r * p))  # [B, R*P]
    prefix = (seg_q == key_seg) & (key_pos < limit[:, None, :])
    if window is not None:
        prefix = prefix & (pos_q - key_pos < window)
    # This step's keys.
    i = torch.arange(s, device=positions.device)
    active = (seg_q == blocks.segment[:, None, :]) & (i[None, None, :] <= i[None, :, None]) & (seg_q >= 0)
    if window is not None:
        active = active & (pos_q - positions[:, None, :] < window)
    active = active | torch.eye(s, dtype=torch.bool, device=positions.device)[None]
    return torch.cat((prefix, active), dim=2)[:, None]  # [B, 1, S, R*P + S]

"""A serving client with a paged KV cache, driving forward() as vLLM's Neuron model runner does.

The client owns the cache's blocks: a shuffled free list (so every sequence's blocks are scattered
and non-contiguous), a block table per request, and, with prefix caching, a map from a prompt's
full leading blocks (by their tokens) to the blocks holding them, which later prompts reuse.

- `serve_rows`: continuous batching. Each iteration admits at most one arrived request with a
  prefill of the whole prompt (from position 0, `computed_context_lens` = its cached prefix,
  `slot_mapping` for the rest padded with -1), then decodes every running request in one call, in a
  shuffled order.
- `serve_chunked`: chunked prefill. Each iteration builds one row under a token budget: a decode
  token for every request whose prompt is done, then the next prompt chunks of the others; each
  request gets a token only when its prompt is complete (`prefill_completion_state`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from tests.support.serving import REQUESTS, Request


@attrs.define
class BlockManager:
    block_size: int
    free: list[int]
    cached: dict[tuple[int, ...], int] = attrs.Factory(dict)
    """Token prefix (a whole number of blocks) -> the block holding its last block."""

    @classmethod
    def shuffled(cls, num_blocks: int, block_size: int, seed: int) -> BlockManager:
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        return cls(block_size=block_size, free=free)

    def allocate(self, prompt: Sequence[int], total: int, prefix_caching: bool) -> tuple[list[int], int]:
        """Blocks for `total` positions, the prompt's cached leading blocks reused; and how many
        prompt tokens are cached (whole blocks, leaving at least one token to compute)."""
        table: list[int] = []
        hit = 0
        if prefix_caching:
            while (hit + 1) * self.block_size < len(prompt):
                block = self.cached.get(tuple(prompt[: (hit + 1) * self.block_size]))
                if block is None:
                    break
                table.append(block)
                hit += 1
        while len(table) * self.block_size < total:
            table.append(self.free.pop())
        return table, hit * self.block_size

    def remember(self, prompt: Sequence[int], table: Sequence[int]) -> None:
        for i in range(len(prompt) // self.block_size):
            self.cached.setdefault(tuple(prompt[: (i + 1) * self.block_size]), table[i])


@attrs.define
class _Running:
    index: int
    table: list[int]
    position: int
    tokens: list[int]
    computed: int = 0
    """Prompt tokens in the cache (chunked prefill)."""


def _slots(table: Sequence[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _padded_table(table: Sequence[int], width: int) -> list[int]:
    return list(table) + [0] * (width - len(table))


def _next(out: Any, sampled: bool) -> Tensor:
    return out.tokens if sampled else out.logits[:, -1].argmax(-1)


def serve_rows(
    model: Any,
    requests: Sequence[Request] = REQUESTS,
    *,
    prefix_caching: bool = False,
    sampled: bool = False,
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[list[list[int]], list[int]]:
    """Serve `requests` with block tables (see the module docstring).

    Args:
        shuffle: decode the running requests in a new random order every step (else in admission order).

    Returns:
        each request's new tokens, and the cached prefix length of every prefill.
    """
    spec = model.neuron_config
    bs, width = spec.pa_block_size, spec.max_length // spec.pa_block_size
    manager = BlockManager.shuffled(spec.pa_num_blocks, bs, seed)
    order = random.Random(seed)
    waiting, running, done, hits, step = list(range(len(requests))), [], {}, [], 0
    slots = spec.batch_size
    while waiting or running:
        arrived = [i for i in waiting if requests[i].arrives <= step]
        if arrived and len(running) < slots:
            i = arrived[0]
            waiting.remove(i)
            prompt, n = list(requests[i].prompt), len(requests[i].prompt)
            table, hit = manager.allocate(prompt, n + requests[i].new_tokens, prefix_caching)
            hits.append(hit)
            out = model.forward(
                torch.tensor([prompt]),
                position_ids=torch.arange(n)[None],
                seq_ids=torch.tensor([0]),
                slot_mapping=torch.tensor([_slots(table, range(hit, n), bs) + [-1] * (spec.max_length - n + hit)]),
                block_table=torch.tensor([_padded_table(table, width)]),
                full_context_lens=torch.tensor([[n]]),
                computed_context_lens=torch.tensor([[hit]]),
            )
            if prefix_caching:
                manager.remember(prompt, table)
            running.append(_Running(index=i, table=table, position=n, tokens=[int(_next(out, sampled)[0])]))
        active = [r for r in running if len(r.tokens) < requests[r.index].new_tokens]
        if active:
            if shuffle:
                order.shuffle(active)
            out = model.forward(
                torch.tensor([[r.tokens[-1]] for r in active]),
                position_ids=torch.tensor([[r.position] for r in active]),
                seq_ids=torch.arange(len(active)),
                slot_mapping=torch.tensor([_slots(r.table, range(r.position, r.position + 1), bs) for r in active]),
                block_table=torch.tensor([_padded_table(r.table, width) for r in active]),
                full_context_lens=torch.tensor([[r.position + 1] for r in active]),
                computed_context_lens=torch.tensor([[r.position] for r in active]),
            )
            for r, token in zip(active, _next(out, sampled).tolist(), strict=True):
                r.tokens.append(int(token))
                r.position += 1
        for r in [r for r in running if len(r.tokens) == requests[r.index].new_tokens]:
            running.remove(r)
            done[r.index] = r.tokens
        step += 1
    return [done[i] for i in range(len(requests))], hits


def serve_chunked(
    model: Any, requests: Sequence[Request] = REQUESTS, *, budget: int, sampled: bool = False, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Serve `requests` with chunked prefill under a `budget` of tokens per call.

    Returns:
        each request's new tokens, and the number of requests in every call.
    """
    spec = model.neuron_config
    bs = spec.pa_block_size
    seqs = spec.chunked_prefill_config.max_num_seqs
    manager = BlockManager.shuffled(spec.pa_num_blocks, bs, seed)
    waiting, running, done, sizes, step = list(range(len(requests))), [], {}, [], 0
    while waiting or running:
        for i in [i for i in waiting if requests[i].arrives <= step]:
            if len(running) < seqs:
                waiting.remove(i)
                req = requests[i]
                table, _ = manager.allocate(req.prompt, len(req.prompt) + req.new_tokens, False)
                running.append(_Running(index=i, table=table, position=0, tokens=[]))
        ids: list[int] = []
        parts: list[tuple[_Running, int, int]] = []  # (request, start, end)
        left = budget
        for r in sorted(running, key=lambda r: not r.tokens):  # decodes first, then prompt chunks
            prompt = requests[r.index].prompt
            if left == 0:
                break
            if r.tokens:
                ids.append(r.tokens[-1])
                parts.append((r, r.position, r.position + 1))
                left -= 1
            else:
                end = min(len(prompt), r.computed + left)
                ids.extend(prompt[r.computed : end])
                parts.append((r, r.computed, end))
                left -= end - r.computed
        if parts:
            sizes.append(len(parts))
            width = max(len(r.table) for r, _, _ in parts)
            out = model.forward(
                torch.tensor([ids]),
                position_ids=torch.tensor([[p for _, s, e in parts for p in range(s, e)]]),
                seq_ids=torch.tensor([0]),
                slot_mapping=torch.tensor([s for r, a, e in parts for s in _slots(r.table, range(a, e), bs)]),
                block_table=torch.tensor([_padded_table(r.table, width) for r, _, _ in parts]),
                full_context_lens=torch.tensor([e for _, _, e in parts]),
                computed_context_lens=torch.tensor([s for _, s, _ in parts]),
                sampling_params=torch.ones(seqs, 3),
            )
            new = out.tokens if sampled else out.logits[0].argmax(-1)
            for (r, _, end), token in zip(parts, new.tolist(), strict=True):
                prompt = requests[r.index].prompt
                if r.tokens:
                    r.position += 1
                    r.tokens.append(int(token))
                else:
                    r.computed = end
                    if end == len(prompt):  # the prompt is complete: its token counts
                        r.position = end
                        r.tokens.append(int(token))
        for r in [r for r in running if len(r.tokens) == requests[r.index].new_tokens]:
            running.remove(r)
            done[r.index] = r.tokens
        step += 1
    return [done[i] for i in range(len(requests))], sizes

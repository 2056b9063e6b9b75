"""A serving client's continuous batching, driving forward() as vLLM's Neuron model runner does.

`serve(model, requests)` keeps requests in cache slots (seq_ids): every iteration it admits at
most one arrived request into a free slot with a prefill of its own (ctx_batch_size=1), then
decodes every running slot in one call, the slots in a shuffled order; a finished request frees
its slot for the next one. It returns every request's new tokens and the decode batch sizes seen.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor


@attrs.frozen(kw_only=True)
class Request:
    prompt: tuple[int, ...]
    new_tokens: int
    arrives: int
    """The iteration at which the client receives it."""


REQUESTS: tuple[Request, ...] = (
    Request(prompt=(1, 5, 7, 9, 11, 3, 4, 5, 6, 7), new_tokens=9, arrives=0),
    Request(prompt=(3,), new_tokens=12, arrives=0),
    Request(prompt=(4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17), new_tokens=4, arrives=1),
    Request(prompt=(9, 8), new_tokens=10, arrives=2),
    Request(prompt=(20, 21, 22), new_tokens=6, arrives=3),
    Request(prompt=(30, 31, 32, 33, 34), new_tokens=3, arrives=9),
    Request(prompt=(40, 41), new_tokens=8, arrives=10),
)
"""Seven requests arriving over time for four slots (ids avoid 0, the pad, and 2, the eos):
decode batches of 1, 2, 3 and 4 rows all occur, and slots are reused."""

SLOTS = 4


@attrs.define
class _Running:
    index: int
    slot: int
    position: int
    """The position of the next token fed (the prompt length, then one more per decode)."""
    tokens: list[int]


def _next_tokens(out: Any, sampled: bool) -> Tensor:
    return out.tokens if sampled else out.logits[:, -1].argmax(-1)


def serve(
    model: Any,
    requests: Sequence[Request] = REQUESTS,
    *,
    sampled: bool = False,
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[list[list[int]], list[int]]:
    """Serve `requests` through `model.forward` (see the module docstring).

    Args:
        sampled: read `out.tokens` (on-device sampling) instead of the argmax of `out.logits`.
        shuffle: decode the running slots in a new random order every step (else in admission order).

    Returns:
        each request's new tokens, and the batch size of every decode call, in order.
    """
    order = random.Random(seed)
    waiting = list(range(len(requests)))
    free = list(range(SLOTS))
    running: list[_Running] = []
    done: dict[int, list[int]] = {}
    decodes: list[int] = []
    step = 0
    model.reset()
    while waiting or running:
        arrived = [i for i in waiting if requests[i].arrives <= step]
        if arrived and free:
            i, slot = arrived[0], free.pop(0)
            waiting.remove(i)
            prompt = torch.tensor([requests[i].prompt])
            n = prompt.shape[1]
            out = model.forward(prompt, seq_ids=torch.tensor([slot]), position_ids=torch.arange(n)[None, :])
            running.append(_Running(index=i, slot=slot, position=n, tokens=[int(_next_tokens(out, sampled)[0])]))
        active = [r for r in running if len(r.tokens) < requests[r.index].new_tokens]
        if active:
            if shuffle:
                order.shuffle(active)
            ids = torch.tensor([[r.tokens[-1]] for r in active])
            positions = torch.tensor([[r.position] for r in active])
            out = model.forward(ids, position_ids=positions, seq_ids=torch.tensor([r.slot for r in active]))
            decodes.append(len(active))
            for r, token in zip(active, _next_tokens(out, sampled).tolist(), strict=True):
                r.tokens.append(int(token))
                r.position += 1
        for r in [r for r in running if len(r.tokens) == requests[r.index].new_tokens]:
            running.remove(r)
            free.append(r.slot)
            done[r.index] = r.tokens
        step += 1
    return [done[i] for i in range(len(requests))], decodes

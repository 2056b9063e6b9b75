"""Properties of the decoder on a block (paged) KV cache, against the contiguous cache it replaces:

- a prompt prefilled into scattered blocks, then decoded token by token, gives one full forward's logits;
- prefix caching: prefilling only the tokens after a cached prefix gives the full prefill's logits;
- chunked prefill: several sequences' chunks in one row give each sequence's own logits;
- padding tokens (slot -1) write only the garbage block.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import block_kv, inputs, kv_cache
from nxdi.core.programs import decoder as llama
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.inputs import StepInputs
from nxdi.testing.strategies.decoders import dense_specs, random_weights
from tests.support.program_checks import DTYPE
from tests.support.program_checks import close as _close
from tests.support.program_checks import random_tokens as _tokens

SEEDS = st.integers(0, 2**31 - 1)
BS = 4
"""Block size of these tests (small, so sequences span several blocks)."""


def _full(spec: ModelSpec, w: object, toks: list[int]) -> torch.Tensor:
    """[n, V] logits of every position, from one contiguous forward."""
    n = len(toks)
    cache = kv_cache.empty_cache(spec, batch=1, length=n, dtype=DTYPE)
    logits, _ = llama.forward(w, cache, inputs.prompt_inputs([toks], length=n), spec=spec, all_logits=True)
    return logits[0]


def _segment(toks: list[int], table: list[int], start: int, *, width: int, nb: int) -> tuple[StepInputs, BlockInputs]:
    """One row: tokens `toks[start:]` at positions start.., right padded to `width`, over a prefix of
    `start` cached tokens in blocks `table` (padded with 0 to `nb`)."""
    new = toks[start:]
    pad = width - len(new)
    pos = list(range(start, len(toks)))
    slots = [table[p // BS] * BS + p % BS for p in pos]
    x = StepInputs(
        input_ids=torch.tensor([new + [0] * pad]),
        position_ids=torch.tensor([pos + [1] * pad]),
        last_index=torch.tensor([len(new) - 1]),
    )
    b = BlockInputs(
        slot_mapping=torch.tensor([slots + [-1] * pad]),
        block_table=torch.tensor([[table + [0] * (nb - len(table))]]),
        computed=torch.tensor([[start]]),
        segment=torch.tensor([[0] * len(new) + [-1] * pad]),
        out_index=torch.tensor([[len(new) - 1]]),
    )
    return x, b


def _blocks_for(n: int, num_blocks: int, seed: int) -> list[int]:
    """A scattered, non-contiguous block table for n positions."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[: -(-n // BS)]


@settings(deadline=None, max_examples=25)
@given(spec=dense_specs(), seed=SEEDS, n=st.integers(2, 14), data=st.data())
def test_block_prefill_then_decode_equals_full_forward(spec: ModelSpec, seed: int, n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, n - 1), label="prompt length")
    w = random_weights(spec, seed, DTYPE)
    toks = _tokens(spec, seed, n)
    num_blocks = 8
    table = _blocks_for(n, num_blocks, seed)
    nb = len(table)
    cache = block_kv.empty_block_cache(spec, num_blocks=num_blocks, block_size=BS, dtype=DTYPE)
    width = data.draw(st.integers(m, m + 3), label="context bucket")
    x, b = _segment(toks[:m], table, 0, width=width, nb=nb)
    logits, cache = llama.forward(w, cache, x, spec=spec, blocks=b)
    steps = [logits[:, 0]]
    for p in range(m, n - 1):
        x, b = _segment(toks[: p + 1], table, p, width=1, nb=nb)
        logits, cache = llama.forward(w, cache, x, spec=spec, blocks=b)
        steps.append(logits[:, 0])
    _close(torch.cat(steps), _full(spec, w, toks)[m - 1 : n - 1])


@settings(deadline=None, max_examples=25)
@given(spec=dense_specs(), seed=SEEDS, n=st.integers(2, 14), data=st.data())
def test_prefix_cache_hit_equals_full_prefill(spec: ModelSpec, seed: int, n: int, data: st.DataObject) -> None:
    cached = data.draw(st.integers(1, n - 1), label="cached prefix")
    w = random_weights(spec, seed, DTYPE)
    toks = _tokens(spec, seed, n)
    table = _blocks_for(n, 8, seed)
    cache = block_kv.empty_block_cache(spec, num_blocks=8, block_size=BS, dtype=DTYPE)
    x, b = _segment(toks[:cached], table, 0, width=cached, nb=len(table))
    _, cache = llama.forward(w, cache, x, spec=spec, blocks=b)
    x, b = _segment(toks, table, cached, width=n - cached + 2, nb=len(table))
    hit, _ = llama.forward(w, cache, x, spec=spec, blocks=b)
    _close(hit[0, 0], _full(spec, w, toks)[n - 1])


@settings(deadline=None, max_examples=20)
@given(spec=dense_specs(), seed=SEEDS, lengths=st.lists(st.integers(2, 9), min_size=2, max_size=3), data=st.data())
def test_chunks_of_several_sequences_in_one_row_equal_each_alone(
    spec: ModelSpec, seed: int, lengths: list[int], data: st.DataObject
) -> None:
    w = random_weights(spec, seed, DTYPE)
    seqs = [_tokens(spec, seed + i, n) for i, n in enumerate(lengths)]
    starts = [data.draw(st.integers(0, n - 1), label=f"cached {i}") for i, n in enumerate(lengths)]
    order = torch.randperm(12, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, nb = [], 3  # each sequence <= 9 tokens: 3 blocks of 4
    for n in lengths:
        tables.append(order[: -(-n // BS)])
        order = order[-(-n // BS) :]
    cache = block_kv.empty_block_cache(spec, num_blocks=12, block_size=BS, dtype=DTYPE)
    for toks, table, start in zip(seqs, tables, starts, strict=True):  # each sequence's prefix, cached alone
        if start:
            x, b = _segment(toks[:start], table, 0, width=start, nb=nb)
            _, cache = llama.forward(w, cache, x, spec=spec, blocks=b)
    # One row: every sequence's remaining tokens, concatenated, then padding.
    ids, pos, slots, seg, out = [], [], [], [], []
    for r, (toks, table, start) in enumerate(zip(seqs, tables, starts, strict=True)):
        for p in range(start, len(toks)):
            ids.append(toks[p])
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
            seg.append(r)
        out.append(len(ids) - 1)
    pad = 3
    x = StepInputs(
        input_ids=torch.tensor([ids + [0] * pad]),
        position_ids=torch.tensor([pos + [0] * pad]),
        last_index=torch.tensor([0]),
    )
    b = BlockInputs(
        slot_mapping=torch.tensor([slots + [-1] * pad]),
        block_table=torch.tensor([[t + [0] * (nb - len(t)) for t in tables]]),
        computed=torch.tensor([starts]),
        segment=torch.tensor([seg + [-1] * pad]),
        out_index=torch.tensor([out]),
    )
    logits, cache = llama.forward(w, cache, x, spec=spec, blocks=b)
    for r, toks in enumerate(seqs):
        _close(logits[0, r], _full(spec, w, toks)[len(toks) - 1])


@settings(deadline=None, max_examples=10)
@given(spec=dense_specs(), seed=SEEDS, n=st.integers(1, 6))
def test_padding_tokens_write_only_the_garbage_block(spec: ModelSpec, seed: int, n: int) -> None:
    w = random_weights(spec, seed, DTYPE)
    toks = _tokens(spec, seed, n)
    table = _blocks_for(n, 4, seed)
    cache = block_kv.empty_block_cache(spec, num_blocks=4, block_size=BS, dtype=DTYPE)
    x, b = _segment(toks, table, 0, width=n + 5, nb=len(table))
    _, new = llama.forward(w, cache, x, spec=spec, blocks=b)
    written = {table[p // BS] * BS + p % BS for p in range(n)}
    for t in (*new.k, *new.v):
        flat = t[:4].reshape(4 * BS, -1)
        untouched = [s for s in range(4 * BS) if s not in written]
        assert torch.all(flat[untouched] == 0)
        assert torch.all(flat[sorted(written)].abs().sum(-1) > 0)
    assert all(torch.all(t == 0) for t in (*cache.k, *cache.v)), "the input cache is not mutated"

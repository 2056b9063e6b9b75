"""The block (paged) KV cache as a serving client drives it: block tables, prefix caching, chunked prefill.

The client (tests/support/block_serving.py) hands out blocks from a shuffled free list, so every
sequence's blocks are scattered and non-contiguous. Every request's tokens must be transformers'
greedy tokens for its prompt alone: with and without prefix-cache hits, and with prompts
prefilled in chunks of several sizes mixed with decode tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.core.config.neuron_spec import Phase
from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.block_serving import serve_chunked, serve_rows
from tests.support.engine_fixtures import program_calls
from tests.support.serving import REQUESTS, Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCKS = dict(
    batch_size=4,
    ctx_batch_size=1,
    is_continuous_batching=True,
    is_block_kv_layout=True,
    pa_block_size=4,
    pa_num_blocks=96,
)
PREFIX = dict(
    BLOCKS, is_prefix_caching=True, enable_bucketing=True, context_encoding_buckets=[8, 16, 32], prefix_buckets=[8, 16]
)
SHARED = (1, 5, 7, 9, 11, 3, 4, 5, 6, 7, 8)
"""A prompt head the prefix-caching requests share (11 tokens: two whole blocks of 4 and 3 more)."""
PREFIX_REQUESTS = (
    Request(prompt=(*SHARED, 12, 13), new_tokens=6, arrives=0),
    Request(prompt=(*SHARED, 20), new_tokens=5, arrives=1),
    Request(prompt=SHARED[:9], new_tokens=7, arrives=2),
    Request(prompt=(3, 4), new_tokens=4, arrives=2),
    Request(prompt=(*SHARED, 12, 13, 14, 15, 16), new_tokens=6, arrives=3),
)


def _expected(hf_greedy: Callable[..., torch.Tensor], requests: tuple[Request, ...]) -> list[list[int]]:
    most = max(r.new_tokens for r in requests)
    tokens = hf_greedy("llama", [r.prompt for r in requests], most)
    return [tokens[i, : r.new_tokens].tolist() for i, r in enumerate(requests)]


@pytest.mark.parametrize("sampled", [False, True], ids=["host-greedy", "on-device-top_k-1"])
def test_scattered_block_tables_give_every_requests_greedy_tokens(
    sampled: bool, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    config = dict(BLOCKS, on_device_sampling_config={"top_k": 1}) if sampled else BLOCKS
    model = loaded_model("llama", **config)
    tokens, hits = serve_rows(model, sampled=sampled)
    assert tokens == _expected(hf_greedy, REQUESTS)
    assert hits == [0] * len(REQUESTS)


def test_a_prefix_cache_hit_computes_only_the_new_tokens_and_gives_the_same_tokens(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **PREFIX)
    with program_calls(model) as calls:
        tokens, hits = serve_rows(model, PREFIX_REQUESTS, prefix_caching=True)
    assert hits == [0, 8, 8, 0, 12], "later prompts reuse the whole blocks of earlier ones"
    assert tokens == _expected(hf_greedy, PREFIX_REQUESTS)
    prefills = [k for k in calls if k.phase is Phase.CONTEXT]
    # The last hit (12 cached) runs on the (8 new, 8 prefix) bucket: 4 cached tokens are computed again.
    assert [k.tokens for k in prefills] == [16, 8, 8, 8, 8], "a hit computes only the tokens after its prefix"
    assert [k.length - k.tokens for k in prefills] == [0, 8, 8, 0, 8]
    miss, _ = serve_rows(loaded_model("llama", **PREFIX, fresh=True), PREFIX_REQUESTS, prefix_caching=False)
    assert miss == tokens


@pytest.mark.parametrize("budget", [3, 5, 16])
def test_chunked_prefill_in_chunks_of_several_sizes_equals_one_shot_prefill(
    budget: int, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    config = dict(BLOCKS, batch_size=1, chunked_prefill_config={"max_num_seqs": 4}, max_context_length=16)
    model = loaded_model("llama", **config)
    tokens, sizes = serve_chunked(model, budget=budget)
    assert tokens == _expected(hf_greedy, REQUESTS)
    assert max(sizes) > 1, "calls mixed several requests"


def test_block_arguments_are_checked(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", **BLOCKS)
    with pytest.raises(IncompatibleConfigError, match="needs slot_mapping and block_table"):
        model.forward(torch.tensor([[5, 6]]), position_ids=torch.arange(2)[None])
    with pytest.raises(IncompatibleConfigError, match=r"block_table\[0\].*outside 0..95"):
        model.forward(
            torch.tensor([[5, 6]]),
            position_ids=torch.arange(2)[None],
            slot_mapping=torch.tensor([[400, 401]]),
            block_table=torch.tensor([[100]]),
        )
    plain = loaded_model("llama", batch_size=1)
    with pytest.raises(IncompatibleConfigError, match="set is_block_kv_layout=True"):
        plain.forward(torch.tensor([[5, 6]]), slot_mapping=torch.tensor([[0, 1]]))


def test_a_compiled_block_program_writes_the_cache_in_place(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", backend="cpu", **BLOCKS)
    runtime = model._require_runtime()
    before = [t.data_ptr() for t in (*runtime.cache.k, *runtime.cache.v)]
    tokens, _ = serve_rows(model)
    assert tokens == _expected(hf_greedy, REQUESTS)
    assert [t.data_ptr() for t in (*runtime.cache.k, *runtime.cache.v)] == before, "no copy of the block cache per step"


def test_block_kv_with_tensor_parallelism_is_refused_clearly(loaded_model: Callable[..., Any]) -> None:
    with pytest.raises(IncompatibleConfigError, match=r"is_block_kv_layout.*tp_degree"):
        loaded_model("llama", tp_degree=2, **BLOCKS)

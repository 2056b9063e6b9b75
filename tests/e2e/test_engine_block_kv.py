"""The block (paged) KV cache as a serving client drives it: block tables, prefix caching, chunked prefill.

The client (tests/support/block_serving.py) hands out blocks from a shuffled free list, so every
sequence's blocks are scattered and non-contiguous. Every request's tokens must be transformers'
greedy tokens for its prompt alone: with and without prefix-cache hits, and with prompts
prefilled in chunks of several sizes mixed with decode tokens; with tp_degree 2 too, where every
rank process holds its KV heads of every block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.planning import kv_layout
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES
from tests.support.block_serving import serve_chunked, serve_rows
from tests.support.engine_fixtures import model_type_of, program_calls
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
    with pytest.raises(IncompatibleConfigError, match=r"slot_mapping='torch.float32'.*\n.*block_table='torch.bool'"):
        model.forward(  # every argument that is not integers, named at once
            torch.tensor([[5, 6]]),
            position_ids=torch.arange(2)[None],
            slot_mapping=torch.tensor([[4.0, 5.0]]),
            block_table=torch.tensor([[True]]),
        )
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


CHUNKED = dict(BLOCKS, batch_size=1, chunked_prefill_config={"max_num_seqs": 4}, max_context_length=16)
TP_CASES = {  # name: (load_model arguments at tp_degree 2, how the client serves it)
    "rows-on-device-top_k-1": (dict(BLOCKS, on_device_sampling_config={"top_k": 1}), "rows"),
    "rows-compiled-cpu-backend": (dict(BLOCKS, backend="cpu"), "rows"),
    "prefix-caching-sequence-parallel": (dict(PREFIX, sequence_parallel_enabled=True), "prefix"),
    "chunked-prefill-vocab-parallel": (dict(CHUNKED, vocab_parallel=True), "chunked"),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_block_kv_with_tensor_parallelism_gives_every_requests_greedy_tokens(
    case: str, tp_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """Two rank processes, each holding its KV heads of every block, serve what one rank does
    (transformers' greedy tokens, as the tp 1 tests above show)."""
    config, served = TP_CASES[case]
    model = tp_model("llama", tp_degree=2, **config)
    if served == "rows":
        tokens, _ = serve_rows(model, sampled="on_device_sampling_config" in config)
        assert tokens == _expected(hf_greedy, REQUESTS)
    elif served == "prefix":
        tokens, hits = serve_rows(model, PREFIX_REQUESTS, prefix_caching=True)
        assert hits == [0, 8, 8, 0, 12]
        assert tokens == _expected(hf_greedy, PREFIX_REQUESTS)
    else:
        tokens, sizes = serve_chunked(model, budget=5)
        assert tokens == _expected(hf_greedy, REQUESTS)
        assert max(sizes) > 1


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_its_kv_heads_of_every_block(tiny_checkpoint: Callable[..., Path], tp: int) -> None:
    """The block cache of a rank is [N+1, bs, K_rank, D], K_rank the planner's KV heads per rank
    (2 KV heads: one each at tp 2, replicated at tp 4)."""
    path, model_type = tiny_checkpoint("llama"), model_type_of("llama")
    neuron = NeuronConfig(torch_dtype="float32", seq_len=64, tp_degree=tp, **BLOCKS)
    config = CONFIG_TYPES[model_type](neuron, load_config=load_pretrained_config(path))
    model = MODEL_TYPES[model_type]["causal-lm"](path, config)  # built, not loaded: no rank processes
    heads = kv_layout.kv_layout_for(model.model_spec, model.spec).unwrap().shape_per_rank[1]
    want = (BLOCKS["pa_num_blocks"] + 1, BLOCKS["pa_block_size"], heads, model.model_spec.head_dim)
    assert heads == 1
    for rank in range(tp):
        cache = attrs.evolve(model._engine_model(), rank=rank).empty_cache(length=model.spec.max_length)
        assert {tuple(t.shape) for t in (*cache.k, *cache.v)} == {want}


def test_block_kv_with_ranks_refuses_what_cannot_split(loaded_model: Callable[..., Any]) -> None:
    """Flash decoding splits a sequence over ranks, and sequence parallelism needs every chunk to
    split evenly: both are refused up front, naming the setting and the fix."""
    with pytest.raises(IncompatibleConfigError, match=r"flash_decoding_enabled=True: splits each sequence.*block KV"):
        loaded_model("llama", tp_degree=4, flash_decoding_enabled=True, **BLOCKS)
    odd = dict(
        CHUNKED,
        chunked_prefill_config={"max_num_seqs": 4, "kernel_q_tile_size": 3},
        enable_bucketing=True,
        sequence_parallel_enabled=True,
    )
    with pytest.raises(IncompatibleConfigError, match=r"block programs of \[3, 9\] tokens over tp_degree=2"):
        loaded_model("llama", tp_degree=2, **odd)

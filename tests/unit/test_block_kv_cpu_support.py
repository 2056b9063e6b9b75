"""`check_cpu_support` on the block KV layout with tensor parallelism: it runs, except with flash
decoding and with sequence parallelism over chunks tp_degree does not divide (refused, naming the
setting and the fix)."""

from __future__ import annotations

from typing import Any

import pytest
from returns.result import Failure, Success

from nxdi.core.config.cpu_support import check_cpu_support
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.partition import check_partition

BLOCKS = dict(
    batch_size=4,
    seq_len=64,
    is_continuous_batching=True,
    is_block_kv_layout=True,
    pa_block_size=4,
    pa_num_blocks=96,
)
MODEL = ModelSpec(
    model_type="llama",
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_layers=2,
    vocab_size=160,
    intermediate_size=128,
    max_position_embeddings=128,
)
CHUNKED = dict(BLOCKS, batch_size=1, chunked_prefill_config={"max_num_seqs": 4}, max_context_length=16)


def _spec(**kwargs: Any) -> NeuronSpec:
    return parse_neuron_spec(kwargs).unwrap().spec


def _problems(spec: NeuronSpec) -> list[str]:
    checked = check_cpu_support(spec)
    return [] if isinstance(checked, Success) else [str(p) for p in checked.failure().problems]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(BLOCKS, tp_degree=2),
        dict(BLOCKS, tp_degree=4, sequence_parallel_enabled=True, vocab_parallel=True),
        dict(BLOCKS, is_prefix_caching=True, enable_bucketing=True, context_encoding_buckets=[8, 16], tp_degree=2),
        dict(CHUNKED, tp_degree=2, sequence_parallel_enabled=True),
        dict(BLOCKS, tp_degree=1, flash_decoding_enabled=True),
    ],
    ids=["plain", "sequence-parallel", "prefix-caching", "chunked-even", "one-rank"],
)
def test_block_kv_runs_with_tensor_parallelism(kwargs: dict[str, Any]) -> None:
    assert isinstance(check_cpu_support(_spec(**kwargs)), Success)


def test_block_kv_refuses_flash_decoding_across_ranks() -> None:
    problems = _problems(_spec(**BLOCKS, tp_degree=4, flash_decoding_enabled=True))
    assert len(problems) == 1
    assert "flash_decoding_enabled" in problems[0] and "block KV layout" in problems[0]
    assert "disable flash decoding" in problems[0]


def test_block_kv_refuses_sequence_parallel_chunks_tp_does_not_divide() -> None:
    """Chunks of a kernel_q_tile_size of 3 are 3, 9 and 18 tokens: 3 and 9 do not split over 2 ranks."""
    odd = dict(CHUNKED, chunked_prefill_config={"max_num_seqs": 4, "kernel_q_tile_size": 3}, enable_bucketing=True)
    problems = _problems(_spec(**odd, tp_degree=2, sequence_parallel_enabled=True))
    assert len(problems) == 1
    assert "sequence_parallel_enabled" in problems[0] and "[3, 9] tokens over tp_degree=2" in problems[0]
    assert isinstance(check_cpu_support(_spec(**odd, tp_degree=2)), Success), "fine without sequence parallelism"
    assert isinstance(check_cpu_support(_spec(**odd, tp_degree=1, sequence_parallel_enabled=True)), Success)


def test_a_context_bucket_sequence_parallelism_cannot_split_is_left_to_the_partition_check() -> None:
    """`partition.check_partition` names an odd context bucket already: not repeated here."""
    spec = _spec(
        **BLOCKS, enable_bucketing=True, context_encoding_buckets=[7, 16], tp_degree=2, sequence_parallel_enabled=True
    )
    assert isinstance(check_cpu_support(spec), Success)
    assert isinstance(check_partition(MODEL, spec), Failure)

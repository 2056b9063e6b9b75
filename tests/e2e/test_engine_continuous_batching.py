"""Continuous batching as a serving client drives it, and batch buckets (`token_generation_batches`).

The client (tests/support/serving.py): 4 slots, 7 requests arriving over time, one prompt admitted
per prefill step (ctx_batch_size=1), decodes over every running slot in a shuffled slot order,
slots reused. Every request's tokens must be transformers' greedy tokens for its prompt alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.planning.program_key import ProgramKey
from tests.support.engine_fixtures import load_model, program_calls, runtime_of
from tests.support.serving import REQUESTS, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLIENT = dict(batch_size=4, ctx_batch_size=1, is_continuous_batching=True)
ON_DEVICE = dict(CLIENT, on_device_sampling_config={"top_k": 1})
BATCH_BUCKETS = dict(CLIENT, token_generation_batches=[1, 2])
"""Token generation compiled for 1, 2 and 4 rows (tkg_batch_size is always a batch bucket)."""


def _expected(hf_greedy: Callable[..., torch.Tensor]) -> list[list[int]]:
    most = max(r.new_tokens for r in REQUESTS)
    tokens = hf_greedy("llama", [r.prompt for r in REQUESTS], most)
    return [tokens[i, : r.new_tokens].tolist() for i, r in enumerate(REQUESTS)]


@pytest.mark.parametrize("config", [CLIENT, ON_DEVICE], ids=["host-greedy", "on-device-top_k-1"])
def test_a_serving_client_gets_every_requests_greedy_tokens(
    config: dict[str, Any], loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **config)
    sampled = "on_device_sampling_config" in config
    with program_calls(model) as calls:
        tokens, decodes = serve(model, sampled=sampled)
    assert set(decodes) == {1, 2, 3, 4}, "decode batches of every size up to the slots"
    assert tokens == _expected(hf_greedy)
    assert {k.batch for k in calls if k.phase is Phase.CONTEXT} == {1}, "one prompt per prefill"
    assert {k.batch for k in calls if k.phase is Phase.TOKEN} == {4}, "no batch buckets: every decode pads to 4"


def test_decode_batches_run_on_the_smallest_batch_bucket_that_holds_them(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model("llama", **BATCH_BUCKETS)
    token_keys = {k for k in runtime_of(model).programs if k.phase is Phase.TOKEN}
    assert token_keys == {ProgramKey.token(64, b) for b in (1, 2, 4)}
    with program_calls(model) as calls:
        tokens, decodes = serve(model)
    assert tokens == _expected(hf_greedy)
    bucket = {1: 1, 2: 2, 3: 4, 4: 4}
    expected = Counter(ProgramKey.token(64, bucket[n]) for n in decodes)
    assert Counter(k for k in calls if k.phase is Phase.TOKEN) == expected
    assert set(expected) == token_keys, "every batch bucket ran"
    plain, _ = serve(loaded_model("llama", **CLIENT))
    assert tokens == plain


def test_a_batch_larger_than_every_bucket_is_split_and_the_rest_takes_the_smallest_fit(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """6 rows on batch buckets (2, 1) with 6 cache rows: a chunk of 2, 2, then 2 (REFERENCE §3)."""
    from tests.support.engine_fixtures import PROMPTS, nxdi_generate

    six = [*PROMPTS, (20, 21, 22), (30,)]
    model = loaded_model("llama", batch_size=2, kv_cache_batch_size=6, token_generation_batches=[1])
    five = loaded_model("llama", batch_size=2, kv_cache_batch_size=5, token_generation_batches=[1])
    with program_calls(model) as calls:
        ours = nxdi_generate(model, six, max_new_tokens=6)
    assert {k.batch for k in calls if k.phase is Phase.TOKEN} == {2}
    with program_calls(five) as calls:
        rest = nxdi_generate(five, six[:5], max_new_tokens=6)
    assert [k.batch for k in calls if k.phase is Phase.TOKEN][:3] == [2, 2, 1], "5 rows: 2, 2, then 1"
    assert torch.equal(ours, hf_greedy("llama", six, 6)) and torch.equal(rest, ours[:5])


def test_batch_bucket_programs_survive_a_compile_load_round_trip(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = load_model(tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="cpu", **BATCH_BUCKETS)
    (folder,) = tmp_path.glob("compiled-*")
    names = sorted(p.name for p in (folder / "programs").iterdir())
    assert names == [
        "context_encoding_64.pt2",
        "token_generation_64.pt2",
        "token_generation_64_b1.pt2",
        "token_generation_64_b2.pt2",
    ]
    assert set(runtime_of(model).programs) == {ProgramKey.context(64, 1)} | {ProgramKey.token(64, b) for b in (1, 2, 4)}
    with program_calls(model) as calls:
        tokens, _ = serve(model)
    assert tokens == _expected(hf_greedy)
    assert {k.batch for k in calls if k.phase is Phase.TOKEN} == {1, 2, 4}

"""Serving on the xla backend: a continuous-batching client on batch buckets, and garbage rows
written by several batch rows at once (static-shape row blending), give the CPU engine's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.core.config.neuron_spec import Phase
from tests.support.engine_fixtures import PROMPTS, load_model, padded, program_calls
from tests.support.serving import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(batch_size=4, ctx_batch_size=1, token_generation_batches=[1, 2], kv_cache_padding_size=1)


def _with_garbage(model: Any) -> list[list[int]]:
    """Two sequences in rows 0 and 1, a decode call whose other rows all go to the one garbage row
    (a duplicate pair and an out-of-range id), then the two sequences decode on."""
    ids, mask = padded([PROMPTS[0], PROMPTS[3]])
    model.reset()
    first = [
        int(
            model.forward(ids[i : i + 1], attention_mask=mask[i : i + 1], seq_ids=torch.tensor([i]))
            .logits[0, -1]
            .argmax()
        )
        for i in range(2)
    ]
    lengths = mask.sum(-1).tolist()
    junk = model.forward(
        torch.tensor([[5], [6], [7]]), position_ids=torch.tensor([[3], [3], [4]]), seq_ids=torch.tensor([0, 0, 9])
    )
    assert junk.logits.shape[0] == 3
    tokens = [[t] for t in first]
    for k in range(5):
        out = model.forward(
            torch.tensor([[t[-1]] for t in tokens]),
            position_ids=torch.tensor([[n + k] for n in lengths]),
            seq_ids=torch.tensor([0, 1]),
        )
        for row, token in zip(tokens, out.logits[:, -1].argmax(-1).tolist(), strict=True):
            row.append(int(token))
    return tokens


def test_serving_on_batch_buckets_with_garbage_rows_gives_the_cpu_engines_tokens(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, loaded_model: Callable[..., Any]
) -> None:
    model = load_model(tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="xla", **CONFIG)
    cpu = loaded_model("llama", **CONFIG)
    with program_calls(model) as calls:
        tokens, _ = serve(model)
    assert tokens == serve(cpu)[0]
    assert {k.batch for k in calls if k.phase is Phase.TOKEN} == {1, 2, 4}
    assert _with_garbage(model) == _with_garbage(cpu)


def test_async_mode_on_xla_gives_the_synchronous_tokens(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, loaded_model: Callable[..., Any]
) -> None:
    """Steps launched ahead run on a worker thread, which XLA executes like the caller's."""
    settings = dict(CONFIG, on_device_sampling_config={"top_k": 1})
    model = load_model(tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="xla", async_mode=True, **settings)
    try:
        tokens, _ = serve(model, sampled=True, shuffle=False)
        assert tokens == serve(loaded_model("llama", **settings), sampled=True, shuffle=False)[0]
        assert model.async_stats.used > 0
    finally:
        model.close()

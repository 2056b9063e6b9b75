"""async_mode: each decode call launches the predicted next call in the background.

Every test compares with the same model built without async_mode (or with transformers): async
mode must return exactly synchronous mode's tokens, including when the launched step is discarded
(a call other than predicted, a reset, a new seed), and it must actually run steps ahead
(`async_stats`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.block_serving import serve_rows
from tests.support.engine_fixtures import PROMPTS, nxdi_generate, padded, runtime_of
from tests.support.serving import REQUESTS, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(batch_size=4, on_device_sampling_config={"top_k": 1})
SAMPLED = dict(batch_size=4, on_device_sampling_config={"do_sample": True, "top_k": 8})
CLIENT = dict(batch_size=4, ctx_batch_size=1, is_continuous_batching=True, on_device_sampling_config={"top_k": 1})
BLOCKS = dict(CLIENT, is_block_kv_layout=True, pa_block_size=4, pa_num_blocks=96)


def _pair(loaded_model: Callable[..., Any], **config: Any) -> tuple[Any, Any]:
    """The shared synchronous model, and a fresh async one (its `async_stats` count this test only)."""
    return loaded_model("llama", **config), loaded_model("llama", async_mode=True, fresh=True, **config)


def test_generate_gives_the_synchronous_greedy_tokens_and_runs_decode_steps_ahead(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    sync, ahead = _pair(loaded_model, **GREEDY)
    ours = nxdi_generate(ahead, PROMPTS, max_new_tokens=16)
    assert torch.equal(ours, nxdi_generate(sync, PROMPTS, max_new_tokens=16))
    assert torch.equal(ours, hf_greedy("llama", PROMPTS)[:, :16])
    stats = ahead.async_stats
    # 15 decode calls: the first runs synchronously and launches the second, and so on; the step
    # launched by the last call is waiting when generate() returns.
    assert (stats.launched, stats.used, stats.discarded) == (15, 14, 0)
    nxdi_generate(ahead, PROMPTS, max_new_tokens=4)
    assert stats.discarded == 1, "the next generate()'s reset discards the step left waiting"
    assert sync.async_stats is None


def test_sampled_tokens_equal_synchronous_modes_across_discarded_steps(loaded_model: Callable[..., Any]) -> None:
    """A discarded step drew random numbers: they are given back, so every later draw is the
    synchronous stream's (three generate() calls in a row, each ending with a discarded step)."""
    sync, ahead = _pair(loaded_model, **SAMPLED)
    runs = []
    for model in (sync, ahead):
        runtime_of(model).set_seed(3)
        runs.append([nxdi_generate(model, PROMPTS, max_new_tokens=10, do_sample=True, top_k=8, temperature=2.0)])
        runs[-1] += [nxdi_generate(model, PROMPTS, max_new_tokens=n, do_sample=True, top_k=8) for n in (7, 12)]
    for plain, pipelined in zip(*runs, strict=True):
        assert torch.equal(plain, pipelined)
    assert ahead.async_stats.discarded >= 2
    greedy = runs[0][0].new_tensor(0)
    assert bool((runs[0][0] != greedy).any())


def test_a_call_other_than_predicted_runs_synchronously_with_its_own_inputs(loaded_model: Callable[..., Any]) -> None:
    """Teacher forcing: the tokens fed back are not the ones sampled, so no launched step is used,
    and every step's output follows the tokens actually passed."""
    sync, ahead = _pair(loaded_model, **GREEDY)
    ids, mask = padded(PROMPTS, "right")
    forced = torch.randint(3, 100, (len(PROMPTS), 8), generator=torch.Generator().manual_seed(0))
    outputs = []
    for model in (sync, ahead):
        model.reset()
        steps = [model.forward(ids, attention_mask=mask).tokens]
        positions = mask.sum(-1, keepdim=True)
        for k in range(forced.shape[1]):
            steps.append(model.forward(forced[:, k : k + 1], position_ids=positions + k).tokens)
        outputs.append(torch.stack(steps, 1))
    assert torch.equal(outputs[0], outputs[1])
    stats = ahead.async_stats
    assert stats.used == 0 and stats.discarded >= stats.launched - 1 > 0


def test_a_serving_client_gets_the_synchronous_tokens(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """Continuous batching: rows join and leave, so some launched steps are discarded; decodes over
    an unchanged set of rows in an unchanged order use theirs."""
    sync, ahead = _pair(loaded_model, **CLIENT)
    for shuffle in (False, True):
        tokens, _ = serve(ahead, sampled=True, shuffle=shuffle)
        assert tokens == serve(sync, sampled=True, shuffle=shuffle)[0]
    most = max(r.new_tokens for r in REQUESTS)
    expected = hf_greedy("llama", [r.prompt for r in REQUESTS], most)
    assert tokens == [expected[i, : r.new_tokens].tolist() for i, r in enumerate(REQUESTS)]
    stats = ahead.async_stats
    assert stats.used > 0 and stats.discarded > 0


def test_block_kv_decodes_run_ahead_within_a_block_and_give_the_synchronous_tokens(
    loaded_model: Callable[..., Any],
) -> None:
    """The block layout: the launched step writes the slot after each row's last one, so a decode
    whose next token starts a new block is not launched ahead (it would write a block the client may
    have given to another sequence)."""
    sync, ahead = _pair(loaded_model, **BLOCKS)
    tokens, _ = serve_rows(ahead, sampled=True, shuffle=False)
    assert tokens == serve_rows(sync, sampled=True, shuffle=False)[0]
    assert ahead.async_stats.used > 0


def test_every_step_runs_on_the_models_worker_thread(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", async_mode=True, fresh=True, **GREEDY)
    runtime = runtime_of(model)
    threads: list[str] = []
    run = runtime.run

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return run(*args, **kwargs)

    runtime.run = recording
    try:
        nxdi_generate(model, PROMPTS, max_new_tokens=5)
        model.reset()  # waits for the step the last decode launched
    finally:
        del runtime.run
    # Every step runs on the model's worker thread: prefill and the first decode while the caller
    # waits, each later decode launched ahead (the last one for a call that never came).
    assert len(threads) == 6 and len(set(threads)) == 1 and threads[0].startswith("nxdi-async")
    assert model.async_stats.launched == 4


def test_async_mode_without_on_device_sampling_is_refused(loaded_model: Callable[..., Any]) -> None:
    with pytest.raises(IncompatibleConfigError, match=r"async_mode.*needs on-device sampling"):
        loaded_model("llama", async_mode=True, batch_size=4)


def test_compiled_programs_run_ahead_too(tiny_checkpoint: Callable[..., Any], tmp_path: Any) -> None:
    from tests.support.engine_fixtures import load_model

    path = tiny_checkpoint("llama")
    compiled = load_model(path, "llama", workdir=tmp_path, backend="cpu", async_mode=True, **GREEDY)
    eager = load_model(path, "llama", **GREEDY)
    try:
        assert torch.equal(
            nxdi_generate(compiled, PROMPTS, max_new_tokens=8), nxdi_generate(eager, PROMPTS, max_new_tokens=8)
        )
        assert compiled.async_stats.used == 6
    finally:
        compiled.close()
        eager.close()

"""Tensor parallelism end to end: rank processes (gloo) driven through the documented API, and torchrun.

- Every family at tp 2 and 4, the mixtures of experts and GPT-2, OPT, BLOOM, GPT-J and GPT-NeoX included (with sequence parallelism, vocabulary-parallel embeddings and flash
  decoding switched on in some of them): greedy tokens equal transformers' (batch 1 and a padded
  batch of 4), logits within 1e-5 of the largest logit against tp 1.
- GQA layouts: KV heads replicated (2 KV heads at tp 4), Q heads zero padded (6 Q heads at tp 4),
  MHA conversion (3 KV heads at tp 4).
- Weights: per-rank files hold exactly their shard; a presharded folder loads after the checkpoint
  is deleted; shard_weights() then load_weights() do the same.
- Processes: a killed rank fails the next call within seconds naming the rank, close(), garbage
  collection and a killed driver leave no rank process (checked in the process table); rank
  settings that contradict how the process was started are refused.
- torchrun: two nodes of two ranks on localhost generate the tokens of tp 1; so do two node drivers
  started with the transformers-neuronx guide's variables (NEURON_RT_ROOT_COMM_ID, NEURON_RANK_ID,
  NEURON_LOCAL_TP); NEURON_PP_STAGES and contradicting node variables are refused.

Models here are private (rank processes are not shared across tests) and closed after each test.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors import safe_open

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.effects.distributed.ranks import free_port
from nxdi.shell.exceptions import IncompatibleConfigError, RankError
from nxdi.testing import checkpoints
from tests.support.engine_fixtures import (
    NEW_TOKENS,
    PROMPTS,
    hf_generate,
    load_model,
    nxdi_generate,
    settings_kwargs,
    teacher_forced,
)
from tests.support.processes import outputs_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[2]
WORKER = "nxdi.effects.distributed.worker"
LOGIT_STEPS = 6


def rank_processes() -> list[int]:
    """Live rank processes (any parent) in the process table; zombies are dead."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if WORKER in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    """The pids of `pids` still alive after up to `seconds`."""
    deadline = time.monotonic() + seconds
    alive = [p for p in pids if p in rank_processes()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if p in rank_processes()]
    return alive


# --- numbers: every family -------------------------------------------------------------------

SP, VP, FD = "sequence_parallel_enabled", "vocab_parallel", "flash_decoding_enabled"
HYBRID_TP2 = {"moe_cte_tp_degree": 2, "moe_cte_ep_degree": 1, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 2}
HYBRID_TP4 = {"moe_cte_tp_degree": 1, "moe_cte_ep_degree": 4, "moe_tkg_tp_degree": 2, "moe_tkg_ep_degree": 2}
CASES = [  # (family, tp_degree, compiled batch, settings): each family at tp 2 and 4, batch 1 and 4
    ("llama", 2, 1, ()),
    ("llama", 2, 4, (VP,)),
    ("llama", 4, 1, (VP, FD)),
    ("llama", 4, 4, (SP, FD)),
    ("mistral", 2, 1, (SP,)),
    ("mistral", 2, 4, ()),
    ("mistral", 4, 1, (SP, VP)),
    ("mistral", 4, 4, (VP, FD)),
    ("qwen2", 2, 1, (VP,)),
    ("qwen2", 2, 4, (SP,)),
    ("qwen2", 4, 1, (FD,)),
    ("qwen2", 4, 4, ()),
    ("qwen3", 2, 1, (SP, VP)),
    ("qwen3", 2, 4, ()),
    ("qwen3", 4, 1, (SP,)),
    ("qwen3", 4, 4, (FD,)),
    ("gemma3", 2, 1, (VP,)),  # Gemma: norms around the attention and MLP outputs after the reduce
    ("gemma3", 2, 4, (SP,)),
    ("gemma3", 4, 4, (FD,)),  # flash decoding with query_pre_attn_scalar and the per-layer windows
    ("mixtral", 2, 1, ()),  # mixtures of experts: every expert split along its intermediate width
    ("mixtral", 2, 4, (SP,)),
    ("qwen3_moe", 2, 4, (VP,)),
    ("qwen3_moe", 4, 1, ()),
    ("dbrx", 2, 1, ()),  # experts stored fused [X*F, E]: each rank reads its rows of every expert
    # GPT-2 (Conv1D weights read transposed, learned positions), OPT (both LayerNorm placements),
    # BLOOM (per-head fused QKV, ALiBi slopes of the rank's heads), GPT-J (q/k rows reordered for
    # its rotary pairs, parallel residual, lm_head bias), GPT-NeoX (per-head QKV, partial rotary)
    ("gpt2", 2, 4, (VP,)),
    ("gpt2", 4, 1, (SP,)),
    ("opt", 2, 4, (SP, VP)),
    ("opt-post-ln", 2, 1, ()),
    ("bloom", 2, 4, (SP,)),
    ("bloom", 4, 1, (VP,)),
    ("gptj", 2, 4, ()),
    ("gptj", 4, 4, (SP, VP)),
    ("gpt_neox", 2, 4, (VP,)),
    ("gpt_neox-sequential", 4, 1, (SP,)),
    # expert parallelism: (moe_tp_degree, moe_ep_degree) = (1, 2), then (2, 2)
    ("mixtral", 2, 4, (("moe_tp_degree", 1), ("moe_ep_degree", 2))),
    ("dbrx", 2, 4, (SP, VP, ("moe_tp_degree", 1), ("moe_ep_degree", 2))),
    ("qwen3_moe", 4, 4, (SP, ("moe_tp_degree", 2), ("moe_ep_degree", 2))),
    # hybrid sharding: context encoding and token generation each run their own expert layout
    ("mixtral", 2, 4, (("hybrid_sharding_config", HYBRID_TP2),)),
    ("qwen3_moe", 4, 1, (SP, ("hybrid_sharding_config", HYBRID_TP4))),
]


@pytest.mark.parametrize(
    ("variant", "tp", "batch", "settings"),
    CASES,
    ids=[
        f"{v}-tp{t}-b{b}-{'-'.join(f'{k}{v}' for k, v in settings_kwargs(s).items()) or 'plain'}"
        for v, t, b, s in CASES
    ],
)
def test_tokens_equal_transformers_and_logits_equal_one_rank(
    variant: str,
    tp: int,
    batch: int,
    settings: tuple[str | tuple[str, int], ...],
    tp_model: Callable[..., Any],
    loaded_model: Callable[..., Any],
    hf_greedy: Callable[..., torch.Tensor],
) -> None:
    """Batch 4 holds prompts of 1 to 14 tokens, right padded."""
    prompts = PROMPTS[:batch]
    model = tp_model(variant, tp_degree=tp, batch_size=batch, **settings_kwargs(settings))
    assert torch.equal(nxdi_generate(model, prompts), hf_greedy(variant, prompts))

    tokens = hf_greedy(variant, prompts)[:, : LOGIT_STEPS - 1]
    ours = teacher_forced(model, prompts, tokens)
    one_rank = teacher_forced(loaded_model(variant, batch_size=batch), prompts, tokens)
    for row in range(batch):
        for step in range(LOGIT_STEPS):
            err = max_relative_logit_error(one_rank[row, step], ours[row, step])
            assert err <= 1e-5, f"row {row} step {step}: {err}"


@pytest.mark.parametrize("kib", ["0", "1"])
def test_collectives_through_gloo_give_the_same_tokens(
    kib: str, tp_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank processes' collectives go through shared memory when tensors fit its slots (above),
    through gloo when there is none (0 KiB) or only for the tensors too large (1 KiB: decode steps
    through shared memory, context encoding through gloo)."""
    monkeypatch.setenv("NXDI_HOST_COLLECTIVES_KIB", kib)
    model = tp_model("llama", tp_degree=2, batch_size=4, sequence_parallel_enabled=True)
    assert torch.equal(nxdi_generate(model, PROMPTS), hf_greedy("llama", PROMPTS))


def test_async_mode_launches_decode_steps_to_the_ranks_ahead(
    tp_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """The step launched ahead drives the rank processes from a worker thread; close() waits for it."""
    model = tp_model("llama", tp_degree=2, batch_size=4, async_mode=True, on_device_sampling_config={"top_k": 1})
    assert torch.equal(nxdi_generate(model, PROMPTS), hf_greedy("llama", PROMPTS))
    assert model.async_stats.used == NEW_TOKENS - 2  # every decode call after the first


@pytest.fixture(scope="module")
def gqa_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """6 query heads over 2 KV heads (replicated and padded at tp 4) and over 3 (MHA at tp 4)."""
    out = {}
    for kv in (2, 3):
        hf = checkpoints.build_model("llama", num_attention_heads=6, num_key_value_heads=kv, hidden_size=48)
        path = checkpoints.save_checkpoint(hf, tmp_path_factory.mktemp(f"q6kv{kv}"), checkpoints.SaveFormat.SAFETENSORS)
        out[f"kv{kv}"] = (path, hf)
    return out


@pytest.mark.parametrize("kv", ["kv2", "kv3"])
def test_heads_that_do_not_divide_tp(
    kv: str, gqa_checkpoints: dict[str, tuple[Path, Any]], tp_model: Callable[..., Any]
) -> None:
    path, hf = gqa_checkpoints[kv]
    model = tp_model("llama", path, tp_degree=4, batch_size=4)
    assert torch.equal(nxdi_generate(model, PROMPTS), hf_generate(hf, PROMPTS, max_new_tokens=32))


@pytest.mark.parametrize("flash_decoding", [False, True])
def test_each_rank_caches_what_the_planner_says(tiny_checkpoint: Callable[..., Path], flash_decoding: bool) -> None:
    """The KV cache one rank allocates is the planner's per-rank layout, except flash decoding's 128
    reserved positions: the CPU programs write a token the rank does not own back in place instead
    of into a reserved garbage slot."""
    from nxdi.core.planning import kv_layout

    path = tiny_checkpoint("llama")
    model = _model_class("llama")(path, _config(path, "llama", tp_degree=4, flash_decoding_enabled=flash_decoding))
    plan = kv_layout.kv_layout_for(model.model_spec, model.spec).unwrap()
    b, heads, positions, d = plan.shape_per_rank
    if flash_decoding:
        assert plan.flash_decoding_group == 2
        positions -= kv_layout.FLASH_DECODING_RESERVED
    for rank in range(4):
        engine_model = attrs.evolve(model._engine_model(), rank=rank)
        cache = engine_model.empty_cache(length=model.spec.max_length)
        assert all(tuple(t.shape) == (b, heads, positions, d) for t in (*cache.k, *cache.v))
    assert positions == (32 if flash_decoding else 64)  # seq_len 64 split over groups of 2 ranks


# --- weights -------------------------------------------------------------------------------------


def _model_class(variant: str) -> Any:
    from nxdi.shell.models import MODEL_TYPES

    return MODEL_TYPES[checkpoints.VARIANTS[variant][0]]["causal-lm"]


def _config(path: Path, variant: str, **neuron: Any) -> Any:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import CONFIG_TYPES

    model_type = checkpoints.VARIANTS[variant][0]
    kwargs = {"seq_len": 64, "torch_dtype": "float32", "batch_size": 4, **neuron}
    return CONFIG_TYPES[model_type](NeuronConfig(**kwargs), load_config=load_pretrained_config(path))


def test_each_rank_slices_a_sharded_pickle_checkpoint(
    tiny_checkpoint: Callable[..., Path], tp_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    path = tiny_checkpoint("mistral", checkpoints.SaveFormat.BIN_SHARDED)
    model = tp_model("mistral", path, tp_degree=2, batch_size=4, vocab_parallel=True)
    assert torch.equal(nxdi_generate(model, PROMPTS), hf_greedy("mistral", PROMPTS))


def test_presharded_folder_holds_each_rank_shard_and_loads_without_the_checkpoint(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, hf_greedy: Callable[..., torch.Tensor]
) -> None:
    from nxdi.core.planning import sharding

    checkpoint = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "checkpoint")
    cls, folder = _model_class("qwen3"), tmp_path / "compiled"
    compiler = cls(checkpoint, _config(checkpoint, "qwen3", tp_degree=4, save_sharded_checkpoint=True))
    compiler.compile(folder)

    plan = sharding.shard_plan(compiler.model_spec, tp=4, fused_qkv=True).unwrap()
    by_pattern = {w.name: w for w in plan.weights}
    whole = {k: v.shape for k, v in compiler.get_state_dict(checkpoint, compiler.config).items()}
    for rank in range(4):
        with safe_open(str(folder / f"weights/tp{rank}_sharded_checkpoint.safetensors"), "pt") as f:
            assert set(f.keys()) == set(whole)
            for name in f.keys():  # noqa: SIM118 (a safetensors handle)
                pattern = name if not name.startswith("layers.") else "layers.{i}." + name.split(".", 2)[2]
                assert tuple(f.get_slice(name).get_shape()) == by_pattern[pattern].rank_shape(rank), name
    shutil.rmtree(checkpoint)

    model = cls(folder)
    try:
        model.load(folder)
        assert torch.equal(nxdi_generate(model, PROMPTS), hf_greedy("qwen3", PROMPTS))
    finally:
        model.close()


def test_shard_weights_then_load_weights_without_the_checkpoint(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, hf_greedy: Callable[..., torch.Tensor]
) -> None:
    checkpoint = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "checkpoint")
    cls, folder = _model_class("llama"), tmp_path / "compiled"
    model = cls(checkpoint, _config(checkpoint, "llama", tp_degree=2))
    model.compile(folder)
    assert not (folder / "weights").exists()
    model.shard_weights(folder)
    assert sorted(p.name for p in (folder / "weights").iterdir()) == [
        "tp0_sharded_checkpoint.safetensors",
        "tp1_sharded_checkpoint.safetensors",
    ]
    shutil.rmtree(checkpoint)
    try:
        model.load_weights(folder)
        assert torch.equal(nxdi_generate(model, PROMPTS), hf_greedy("llama", PROMPTS))
    finally:
        model.close()


# --- processes -----------------------------------------------------------------------------------


class _KillRankAt:
    """A generate() streamer that kills one rank process when the `at`-th token batch arrives."""

    def __init__(self, pid: int, at: int) -> None:
        self.pid, self.at, self.calls = pid, at, 0
        self.killed_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()

    def end(self) -> None:
        pass


def test_a_killed_rank_fails_the_next_call_naming_it_and_leaves_no_process(tp_model: Callable[..., Any]) -> None:
    model = tp_model("llama", tp_degree=2, batch_size=1)
    pids = [p.pid for p in model._runtime.group.procs]
    assert sorted(pids) == sorted(p for p in rank_processes() if p in pids)
    killer = _KillRankAt(pids[1], at=3)
    with pytest.raises(RankError, match=r"rank 1 of 2 exited with code -9") as caught:
        nxdi_generate(model, PROMPTS[:1], streamer=killer)
    assert killer.killed_at is not None and time.monotonic() - killer.killed_at < 5
    assert caught.value.rank == 1 and "load() or to_cpu() the model again" in str(caught.value)
    assert wait_until_gone(pids) == []
    with pytest.raises(RankError, match="were stopped"):
        nxdi_generate(model, PROMPTS[:1])
    model.to_cpu()  # starts afresh
    assert nxdi_generate(model, PROMPTS[:1], max_new_tokens=2).shape == (1, 2)


def test_a_hung_rank_fails_the_call_after_the_timeout(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NXDI_RANK_TIMEOUT", "2")
    model = load_model(tiny_checkpoint("llama"), "llama", tp_degree=2, batch_size=1)
    pids = [p.pid for p in model._runtime.group.procs]
    os.kill(pids[0], signal.SIGSTOP)  # alive, but never answers
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 of 2 did not answer within 2 s \(hung\)"):
        nxdi_generate(model, PROMPTS[:1], max_new_tokens=2)
    assert time.monotonic() - started < 10
    assert wait_until_gone(pids) == []


def test_close_and_garbage_collection_stop_the_ranks(tiny_checkpoint: Callable[..., Path]) -> None:
    model = load_model(tiny_checkpoint("llama"), "llama", tp_degree=2, batch_size=1)
    pids = [p.pid for p in model._runtime.group.procs]
    model.close()
    model.close()  # idempotent
    assert wait_until_gone(pids, seconds=1) == []
    with pytest.raises(RuntimeError, match="not loaded"):
        nxdi_generate(model, PROMPTS[:1])

    model.to_cpu()
    pids = [p.pid for p in model._runtime.group.procs]
    del model
    gc.collect()
    assert wait_until_gone(pids, seconds=1) == []


def test_a_killed_driver_leaves_no_rank_process(tiny_checkpoint: Callable[..., Path]) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.support.rank_scripts", "driver", str(tiny_checkpoint("llama"))],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and set(pids) <= set(rank_processes())
    finally:
        driver.kill()
        driver.wait()
    assert wait_until_gone(pids, seconds=5) == []


def test_rank_settings_must_fit_how_the_process_was_started(tp_model: Callable[..., Any]) -> None:
    before = rank_processes()
    with pytest.raises(
        IncompatibleConfigError, match=r"start_rank_id=2: with local_ranks_size=2 names ranks 2\.\.3 of 4"
    ):
        tp_model("llama", tp_degree=4, start_rank_id=2, local_ranks_size=2)
    assert rank_processes() == before  # refused before any rank process started


def test_settings_the_ranks_cannot_run_are_all_listed(tp_model: Callable[..., Any]) -> None:
    with pytest.raises(IncompatibleConfigError) as caught:
        tp_model(
            "llama",
            tp_degree=2,
            enable_bucketing=True,
            context_encoding_buckets=[15, 64],  # sequence parallelism cannot split 15 tokens over 2 ranks
            sequence_parallel_enabled=True,
            flash_decoding_enabled=True,
            pp_degree=2,
        )
    fields = {p.field for p in caught.value.error.problems}
    assert fields == {"sequence_parallel_enabled", "flash_decoding_enabled", "pp_degree"}


# --- torchrun ------------------------------------------------------------------------------------


def test_torchrun_two_nodes_of_two_ranks_generate_the_tokens_of_one_rank(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, loaded_model: Callable[..., Any]
) -> None:
    from tests.support.rank_scripts import NEW_TOKENS

    checkpoint, port = tiny_checkpoint("llama"), free_port()
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
        command += ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        command += ["-m", "tests.support.rank_scripts", "torchrun", str(checkpoint), str(tmp_path / "c"), str(node)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        nodes.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = outputs_of(nodes, timeout=240, what="torchrun")
    lines = [line.split(" ", 2) for out in outputs for line in out.splitlines() if line.startswith("TOKENS ")]
    assert sorted(int(rank) for _, rank, _ in lines) == [0, 1, 2, 3], outputs
    expected = nxdi_generate(loaded_model("llama", batch_size=2), PROMPTS[:2], max_new_tokens=NEW_TOKENS)
    for _, rank, tokens in lines:
        assert torch.equal(torch.tensor(json.loads(tokens)), expected), f"rank {rank}"
    assert len(list((tmp_path / "c" / "programs").iterdir())) > 0  # compiled once, by rank 0


def test_two_node_drivers_set_up_as_the_neuronx_guide_says_generate_the_tokens_of_one_rank(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, loaded_model: Callable[..., Any]
) -> None:
    from tests.support.rank_scripts import NEW_TOKENS

    checkpoint, port = tiny_checkpoint("llama"), free_port()
    nodes = []
    for node in (0, 1):
        command = [
            sys.executable,
            "-m",
            "tests.support.rank_scripts",
            "node",
            str(checkpoint),
            str(tmp_path / f"c{node}"),
        ]
        variables = {"NEURON_RT_ROOT_COMM_ID": f"127.0.0.1:{port}", "NEURON_RANK_ID": str(node), "NEURON_LOCAL_TP": "2"}
        env = {**os.environ, "OMP_NUM_THREADS": "1", **variables}
        nodes.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = outputs_of(nodes, timeout=240, what="the node drivers")
    lines = [line.split(" ", 2) for out in outputs for line in out.splitlines() if line.startswith("TOKENS ")]
    assert sorted(int(node) for _, node, _ in lines) == [0, 1], outputs
    started = {
        line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RANKS ")
    }
    assert started == {"0": [0, 1], "1": [2, 3]}, outputs  # each node ran its half of one world
    expected = nxdi_generate(loaded_model("llama", batch_size=2), PROMPTS[:2], max_new_tokens=NEW_TOKENS)
    for _, node, tokens in lines:
        assert torch.equal(torch.tensor(json.loads(tokens)), expected), f"node {node}"


def test_node_variables_that_cannot_take_effect_are_refused(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("llama")
    monkeypatch.setenv("NEURON_PP_STAGES", "2")
    with pytest.raises(IncompatibleConfigError, match=r"NEURON_PP_STAGES=2.*pipeline parallelism.*NEURON_LOCAL_TP"):
        load_model(path, "llama", batch_size=2)
    monkeypatch.delenv("NEURON_PP_STAGES")
    for key, value in (("NEURON_RT_ROOT_COMM_ID", "127.0.0.1:1"), ("NEURON_RANK_ID", "1"), ("NEURON_LOCAL_TP", "3")):
        monkeypatch.setenv(key, value)
    with pytest.raises(IncompatibleConfigError, match=r"NEURON_LOCAL_TP=3.*tp_degree=4.*divide"):
        load_model(path, "llama", batch_size=2, tp_degree=4)

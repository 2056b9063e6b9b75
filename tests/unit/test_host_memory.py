"""A model whose weights, KV cache and activations do not fit in host memory is refused before
anything is allocated, with the plan's numbers and the fix, instead of being killed by the OS."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from returns.result import Failure, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.families import parse_model_spec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import host_memory
from nxdi.effects import memory
from nxdi.shell.cli.main import main
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi.testing import checkpoints
from tests.support.user_files import snapshot

HUGE = {"kv_cache_batch_size": 2**16, "seq_len": 2**24, "max_context_length": 16}
"""A KV cache of 2**16 rows x 2**24 positions: 512 TiB for the tiny Llama in float32."""


def _spec(**kwargs: Any) -> NeuronSpec:
    return NeuronConfig(torch_dtype="float32", **kwargs).spec


def _tiny_model() -> ModelSpec:
    return parse_model_spec(checkpoints.tiny_config("llama").to_dict()).unwrap()


def test_the_need_adds_weights_cache_and_activations_of_every_local_rank() -> None:
    model = _tiny_model()
    one = host_memory.host_need_for(model, _spec(seq_len=64)).unwrap()
    two = host_memory.host_need_for(model, _spec(seq_len=64, tp_degree=2)).unwrap()
    assert one.ranks == 1 and two.ranks == 2
    assert one.total_bytes == one.weights_bytes + one.kv_cache_bytes + one.activation_bytes > 0
    # Every rank holds a full cache row per sequence (the tiny Llama has 2 kv heads: one per rank).
    assert two.kv_cache_bytes == one.kv_cache_bytes
    huge = host_memory.host_need_for(model, _spec(**HUGE)).unwrap()
    assert huge.kv_cache_bytes == 2 * 2 * 2 * 2**16 * 2**24 * 16 * 4  # K and V x layers x heads x B x T x D x 4 B


def test_the_check_refuses_with_every_number_and_the_fix() -> None:
    spec = _spec(**HUGE)
    need = host_memory.host_need_for(_tiny_model(), spec).unwrap()
    assert host_memory.check_host_memory(need, spec, None) == Success(need)  # unknown: no verdict
    assert host_memory.check_host_memory(need, spec, need.total_bytes) == Success(need)
    result = host_memory.check_host_memory(need, spec, 8 * 2**30)
    assert isinstance(result, Failure)
    (problem,) = result.failure().problems
    assert problem.field == "kv_cache_batch_size" and problem.value == "65536"
    for text in ("max_length=16777216", "512.0 TiB", "weights", "activations", "8.0 GiB this host has available"):
        assert text in problem.reason, problem.render()
    assert "kv_cache_batch_size" in problem.fix and "float32" in problem.fix


def test_available_bytes_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  64000000 kB\nMemAvailable:  2000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert memory.available_bytes(meminfo, cgroup) == 2000000 * 1024
    (cgroup / "memory.max").write_text("1073741824\n")
    (cgroup / "memory.current").write_text("73741824\n")
    assert memory.available_bytes(meminfo, cgroup) == 10**9  # the container's limit is lower
    (cgroup / "memory.max").write_text("max\n")
    assert memory.available_bytes(meminfo, cgroup) == 2000000 * 1024
    assert memory.available_bytes(tmp_path / "absent", cgroup) is None


@pytest.fixture
def huge_model(tiny_checkpoint: Callable[..., Path]) -> NeuronLlamaForCausalLM:
    path = tiny_checkpoint("llama")
    config = LlamaInferenceConfig(NeuronConfig(torch_dtype="float32", **HUGE), load_config=load_pretrained_config(path))
    return NeuronLlamaForCausalLM(path, config)


def _refused_quickly(action: Callable[[], object]) -> str:
    """`action` raises IncompatibleConfigError within a second, with no memory allocated meanwhile."""
    before, start = memory.usage().anon, time.perf_counter()
    with pytest.raises(IncompatibleConfigError) as info:
        action()
    assert time.perf_counter() - start < 1.0
    assert memory.usage().anon - before < 64 * 2**20
    return str(info.value)


def test_to_cpu_and_compile_refuse_a_512_tib_cache_before_allocating(
    huge_model: NeuronLlamaForCausalLM, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    before = snapshot(tiny_checkpoint("llama"))
    message = _refused_quickly(huge_model.to_cpu)
    assert "Does not fit in host memory" in message and "kv_cache_batch_size=65536" in message
    assert "512.0 TiB" in message
    _refused_quickly(lambda: huge_model.compile(tmp_path / "c"))
    assert not (tmp_path / "c").exists() and snapshot(tiny_checkpoint("llama")) == before


def test_nxdi_run_refuses_it_in_one_message(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--model-path", str(tiny_checkpoint("llama")), "--compiled-model-path", str(tmp_path / "c")]
    argv += ["--input-ids", "1 2", "--torch-dtype", "float32", "--kv-cache-batch-size", str(2**16)]
    argv += ["--seq-len", str(2**24), "--max-context-length", "16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nxdi run: Does not fit in host memory: kv_cache_batch_size=65536") and "TiB" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "c").exists()

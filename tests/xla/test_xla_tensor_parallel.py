"""Tensor parallelism on the xla backend: the sharded programs, lowered with HLO collectives, run
SPMD over one virtual XLA:CPU device per rank (in one process the driver starts) and match tp 1.

- tp 2 and 4, with sequence parallelism, vocabulary-parallel embeddings and flash decoding spread
  over the cases: greedy tokens equal the CPU engine's at tp 1, teacher-forced logits within 1e-5
  of the largest logit (fp32);
- the HLO of a tensor-parallel program holds its collectives (all-gathers over every partition,
  reduce-scatters where sequence parallelism splits the context) and takes the rank as an input;
- the rank process compiles each program once at load and nothing while stepping, runs nothing on
  the host, and updates every rank's cache buffers in place (XLA metrics, read in a process set up
  as the driver sets up its rank process);
- the xla backend under torchrun is refused with the fix.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.shell.exceptions import IncompatibleConfigError
from tests.support.engine_fixtures import PROMPTS, load_model, nxdi_generate, settings_kwargs, teacher_forced

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_STEPS = 6
BUCKETS = {"enable_bucketing": True, "context_encoding_buckets": [16, 64], "token_generation_buckets": [32, 64]}
SP, VP, FD = "sequence_parallel_enabled", "vocab_parallel", "flash_decoding_enabled"


@pytest.fixture
def xla_tp_model(backend_model: Callable[..., Any]) -> Callable[..., Any]:
    """`xla_tp_model(variant, **neuron_config)`: compiled for xla, loaded, closed after the test."""
    return functools.partial(backend_model, "xla")


HYBRID = {"moe_cte_tp_degree": 2, "moe_cte_ep_degree": 1, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 2}
CASES = [
    ("llama", 2, (VP,)),
    ("qwen3", 2, (SP,)),
    ("mistral", 4, (SP, VP)),
    ("qwen2", 4, (FD,)),
    ("mixtral", 2, (("moe_tp_degree", 1), ("moe_ep_degree", 2))),  # expert parallelism: one expert group per rank
    # hybrid sharding: context encoding splits every expert, token generation one expert group per rank
    ("mixtral", 2, (("hybrid_sharding_config", HYBRID),)),
]


@pytest.mark.parametrize(
    ("variant", "tp", "settings"),
    CASES,
    ids=[f"{v}-tp{t}-{'-'.join(f'{k}{v}' for k, v in settings_kwargs(s).items())}" for v, t, s in CASES],
)
def test_tokens_and_logits_equal_one_rank_on_the_cpu_engine(
    variant: str,
    tp: int,
    settings: tuple[str | tuple[str, int], ...],
    xla_tp_model: Callable[..., Any],
    loaded_model: Callable[..., Any],
) -> None:
    model = xla_tp_model(variant, tp_degree=tp, batch_size=4, **settings_kwargs(settings))
    one_rank = loaded_model(variant, batch_size=4)
    tokens = nxdi_generate(model, PROMPTS)
    assert torch.equal(tokens, nxdi_generate(one_rank, PROMPTS))
    ours = teacher_forced(model, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    theirs = teacher_forced(one_rank, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    for row in range(len(PROMPTS)):
        for step in range(LOGIT_STEPS):
            err = max_relative_logit_error(theirs[row, step], ours[row, step])
            assert err <= 1e-5, f"row {row} step {step}: {err}"


def test_the_hlo_holds_the_collectives_and_takes_the_rank(xla_tp_model: Callable[..., Any], tmp_path: Path) -> None:
    xla_tp_model("llama", tp_degree=2, batch_size=1, sequence_parallel_enabled=True)
    programs = sorted(tmp_path.rglob("*.xla"))
    assert programs
    for path in programs:
        with zipfile.ZipFile(path) as z:
            text = z.read("module.hlo.txt").decode()
            inputs = [p for p in json.loads(z.read("parameters.json"))["parameters"] if p["kind"] == "input"]
        assert "all-gather(" in text, path.name
        # sequence parallelism splits the context's tokens (one decode token is not split)
        assert ("reduce-scatter(" in text) == path.name.startswith("context_encoding"), path.name
        assert "replica_groups={{0,1}}" in text, path.name
        # it picks its share of the context by its rank (XLA drops the input where it is unused)
        assert ("rank" in {p["name"] for p in inputs}) == path.name.startswith("context_encoding"), path.name


def test_under_torchrun_the_xla_backend_is_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(IncompatibleConfigError, match=r"NXDI_BACKEND.*torchrun"):
        load_model(tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="xla", tp_degree=2)


SPMD_PROCESS = """
import json, sys
import torch
import torch_xla.debug.metrics as met
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.planning.program_key import ProgramKey
from nxdi.effects.backends.xla import XlaBackend
from nxdi.effects.distributed import spmd
from nxdi.shell.config import NeuronConfig
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES

checkpoint, folder, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = CONFIG_TYPES["llama"](NeuronConfig(**settings), load_config=load_pretrained_config(checkpoint))
app = MODEL_TYPES["llama"]["causal-lm"](checkpoint, config, backend="xla")
runtime = spmd.load_spmd(
    folder, app._engine_model(), app._source(checkpoint), backend=XlaBackend(), graph_key=app._graph_key()
).unwrap()
at_load = met.counter_value("UncachedCompile")
aliases = [v for _, v in met.metric_data("InputOutputAliasCount")[2]]
met.clear_all()
params = torch.tensor([[1, 1.0, 1.0]] * 2)
ids = torch.randint(0, 100, (2, 16))
x = StepInputs(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), last_index=torch.tensor([15, 9]))
runtime.run(ProgramKey.context(16, 2), x, rows=None, params=params)
for position in range(16, 40):  # both token-generation buckets
    x = StepInputs(input_ids=ids[:, :1], position_ids=torch.tensor([[position]] * 2), last_index=torch.tensor([0, 0]))
    runtime.run(ProgramKey.token(32 if position < 32 else 64, 2), x, rows=None, params=params)
fallbacks = [n for n in met.counter_names() if n.startswith("aten::")]
print(json.dumps({"at_load": at_load, "aliases": aliases, "stepping": met.counter_value("UncachedCompile") or 0,
                  "fallbacks": fallbacks}))
"""


def test_the_rank_process_compiles_each_program_once_and_updates_the_caches_in_place(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, LlamaInferenceConfig

    path, folder = tiny_checkpoint("llama"), tmp_path / "compiled"
    settings = {"torch_dtype": "float32", "seq_len": 64, "tp_degree": 2, "batch_size": 2, **BUCKETS, SP: True}
    config = LlamaInferenceConfig(NeuronConfig(**settings), load_config=load_pretrained_config(path))
    MODEL_TYPES["llama"]["causal-lm"](path, config, backend="xla").compile(folder)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}  # what the driver gives its rank process
    done = subprocess.run(
        [sys.executable, "-c", SPMD_PROCESS, str(path), str(folder), json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    programs = len(BUCKETS["context_encoding_buckets"]) + len(BUCKETS["token_generation_buckets"])
    assert found["at_load"] == programs + 1  # one per program (warm-up) and the graph zeroing the caches
    cache_tensors = 2 * config.num_hidden_layers  # a key and a value per layer, [ranks, ...] sharded
    assert sorted(found["aliases"])[-programs:] == [cache_tensors] * programs
    assert found["stepping"] == 0, "stepping compiled again (a shape or a sharding changed per step)"
    assert found["fallbacks"] == []


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "duplicated"])
def test_lora_over_two_ranks_gives_the_cpu_engines_tokens(
    shard: bool,
    xla_tp_model: Callable[..., Any],
    tiny_model: Callable[[str], Any],
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """Three PEFT adapters and a base-model row in one batch at tp 2 (the plain matrices split and
    all-gathered in HLO, or duplicated): greedy tokens equal the CPU engine's at tp 1."""
    from nxdi.shell.config import LoraServingConfig
    from tests.support.lora_adapters import ROWS, save_adapters

    paths = save_adapters(tiny_model("llama"), tmp_path / "adapters")
    lora = LoraServingConfig(
        max_loras=3, lora_ckpt_paths=paths, enable_base_model_only=True, lora_shard_linear_layer=shard
    )
    names = [adapter or 0 for adapter in ROWS]
    model = xla_tp_model("llama", tp_degree=2, batch_size=4, lora_config=lora)
    one_rank = load_model(tiny_checkpoint("llama"), "llama", batch_size=4, lora_config=lora)
    got, want = (nxdi_generate(m, PROMPTS, max_new_tokens=12, adapter_ids=names) for m in (model, one_rank))
    assert torch.equal(got, want)

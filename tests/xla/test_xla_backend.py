"""The xla backend against the CPU engine, on XLA:CPU.

- every family: greedy tokens equal the CPU engine's, and teacher-forced logits within 1e-5 of the
  largest logit (fp32);
- bucketing and on-device sampling (greedy and seeded multinomial) give the CPU engine's tokens;
  a padded batch (cache rows chosen per call) too;
- XLA compiles each program once at load and nothing while generating, runs no op on the host
  (no `aten::` fallback counters), and updates every KV-cache buffer in place (aliased);
- multi-LoRA programs (stacked adapters, each row's adapter slot an input) lower and give a mixed
  batch the CPU engine's tokens;
- a compiled folder holds each program's HLO module, text and parameter map; `debug=True` and
  `nxdi compile --dump-hlo` write the HLO text; a folder compiled for xla is refused by the cpu
  backend with the fix.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_xla.debug.metrics as met

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.shell.cli.main import main
from nxdi.shell.exceptions import ArtifactIntegrityError
from tests.support.engine_fixtures import FAMILIES, PROMPTS, load_model, nxdi_generate, teacher_forced

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_STEPS = 6
BUCKETS = {"enable_bucketing": True, "context_encoding_buckets": [16, 64], "token_generation_buckets": [32, 64]}


@pytest.fixture
def xla_model(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Callable[..., Any]:
    """`xla_model(variant, **neuron_config)`: compiled for the xla backend into tmp_path, loaded."""

    def make(variant: str, **kwargs: Any) -> Any:
        return load_model(tiny_checkpoint(variant), variant, workdir=tmp_path, backend="xla", **kwargs)

    return make


@pytest.mark.parametrize("variant", [*FAMILIES, "llama3-tied"])
def test_tokens_and_logits_equal_the_cpu_engine(
    variant: str, xla_model: Callable[..., Any], loaded_model: Callable[..., Any]
) -> None:
    model, cpu = xla_model(variant, batch_size=4), loaded_model(variant, batch_size=4)
    tokens = nxdi_generate(model, PROMPTS)
    assert torch.equal(tokens, nxdi_generate(cpu, PROMPTS))
    ours = teacher_forced(model, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    theirs = teacher_forced(cpu, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    for row in range(len(PROMPTS)):
        for step in range(LOGIT_STEPS):
            err = max_relative_logit_error(theirs[row, step], ours[row, step])
            assert err <= 1e-5, f"row {row} step {step}: {err}"


@pytest.mark.parametrize(
    "sampling",
    [None, {"top_k": 1}, {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.8}],
    ids=["host-greedy", "device-greedy", "device-sampling"],
)
def test_bucketing_and_on_device_sampling_give_the_cpu_engine_tokens(
    sampling: dict[str, Any] | None, xla_model: Callable[..., Any], loaded_model: Callable[..., Any]
) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, **BUCKETS}
    if sampling is not None:
        kwargs["on_device_sampling_config"] = sampling
    model, cpu = xla_model("qwen2", **kwargs), loaded_model("qwen2", **kwargs)
    settings = (
        {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.8}
        if sampling and sampling.get("do_sample")
        else {}
    )
    outputs = []
    for m in (model, cpu):
        m.set_seed(7)
        outputs.append(nxdi_generate(m, PROMPTS, **settings))
    assert torch.equal(*outputs)


def test_a_padded_batch_writes_only_its_rows(xla_model: Callable[..., Any], loaded_model: Callable[..., Any]) -> None:
    model, cpu = xla_model("mistral", batch_size=4), loaded_model("mistral", batch_size=4)
    two = [PROMPTS[2], PROMPTS[0]]  # 2 rows of a batch of 4: the rest are padding, writing nowhere
    assert torch.equal(nxdi_generate(model, two), nxdi_generate(cpu, two))
    assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(cpu, PROMPTS))


def test_generation_under_inference_mode(xla_model: Callable[..., Any], loaded_model: Callable[..., Any]) -> None:
    """Callers often generate under `torch.inference_mode()`; the device cache was made outside it."""
    model, cpu = xla_model("llama", batch_size=4), loaded_model("llama", batch_size=4)
    with torch.inference_mode():
        assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(cpu, PROMPTS))


def test_each_program_compiles_once_runs_on_the_device_and_updates_the_cache_in_place(
    xla_model: Callable[..., Any],
) -> None:
    met.clear_all()
    model = xla_model("llama", batch_size=3, **BUCKETS)  # a batch no other test compiles: XLA caches per process
    programs = len(BUCKETS["context_encoding_buckets"]) + len(BUCKETS["token_generation_buckets"])
    # one compile per program at load (warm-up), plus the graph that zeroes the cache
    assert met.counter_value("UncachedCompile") == programs + 1
    cache_tensors = 2 * model.model_spec.num_layers
    aliases = [value for _, value in met.metric_data("InputOutputAliasCount")[2]]
    assert sorted(aliases)[-programs:] == [cache_tensors] * programs  # every step donates every cache buffer

    met.clear_all()
    tokens = nxdi_generate(model, PROMPTS[:3])  # positions up to 45: both token-generation buckets
    assert tokens.shape == (3, 32)
    assert not met.counter_value("UncachedCompile"), "generating compiled again (a shape changed per position)"
    assert met.counter_value("CachedCompile") >= 32
    fallbacks = [name for name in met.counter_names() if name.startswith("aten::")]
    assert fallbacks == [], f"ops ran on the host: {fallbacks}"


def test_the_folder_holds_each_program_hlo_module(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, LlamaInferenceConfig

    path, out = tiny_checkpoint("llama"), tmp_path / "compiled"
    config = LlamaInferenceConfig(
        NeuronConfig(seq_len=64, torch_dtype="float32"), load_config=load_pretrained_config(path)
    )
    MODEL_TYPES["llama"]["causal-lm"](path, config, backend="xla").compile(out, debug=True)
    files = sorted((out / "programs").iterdir())
    assert [f.suffix for f in files] == [".xla", ".xla"]
    with zipfile.ZipFile(files[0]) as z:
        assert sorted(z.namelist()) == ["constants.safetensors", "module.hlo.pb", "module.hlo.txt", "parameters.json"]
        doc = json.loads(z.read("parameters.json"))
        parameters = doc["parameters"]
        assert len(z.read("module.hlo.pb")) > 1000 and z.read("module.hlo.txt").startswith(b"HloModule")
    kinds = {p["kind"] for p in parameters}
    assert {"weight", "cache", "input"} <= kinds
    assert any(p["name"] == "layers.0.k" and p["kind"] == "cache" for p in parameters)
    cache = [i for i, p in enumerate(parameters) if p["kind"] == "cache"]
    assert sorted(a["parameter"] for a in doc["aliases"]) == cache  # each updated cache reuses its buffer
    assert sorted(p.name for p in (out / "hlo").iterdir()) == [
        "context_encoding_64.hlo.txt",
        "token_generation_64.hlo.txt",
    ]

    with pytest.raises(ArtifactIntegrityError, match="NXDI_BACKEND=xla"):
        MODEL_TYPES["llama"]["causal-lm"](out, backend="cpu").load(out)


def test_nxdi_compile_dumps_the_hlo(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compile", "--model-path", str(tiny_checkpoint("qwen3")), "--compiled-model-path", str(tmp_path / "c")]
    argv += ["--backend", "xla", "--dump-hlo", str(tmp_path / "hlo"), "--seq-len", "64", "--torch-dtype", "float32"]
    assert main(argv) == 0
    assert "wrote the HLO text of 2 programs" in capsys.readouterr().out
    text = (tmp_path / "hlo" / "token_generation_64.hlo.txt").read_text()
    assert text.startswith("HloModule") and "ENTRY" in text


@pytest.mark.parametrize("quant", ["per_channel_symmetric", "per_tensor_symmetric"])
def test_quantized_weights_lower_and_give_the_cpu_engine_tokens(
    quant: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """int8 weights (dequantized in the program) lower to HLO, run without host fallbacks, and give
    the CPU engine's tokens and logits."""
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES

    path = tiny_checkpoint("llama")
    kwargs = {"quantized": True, "quantized_checkpoints_path": str(tmp_path), "quantization_type": quant}
    config = CONFIG_TYPES["llama"](NeuronConfig(**kwargs), load_config=load_pretrained_config(path))
    MODEL_TYPES["llama"]["causal-lm"].save_quantized_state_dict(path, config)
    met.clear_all()
    model = load_model(path, "llama", workdir=tmp_path, backend="xla", batch_size=4, **kwargs)
    cpu = load_model(path, "llama", batch_size=4, **kwargs)
    tokens = nxdi_generate(model, PROMPTS)
    assert torch.equal(tokens, nxdi_generate(cpu, PROMPTS))
    ours = teacher_forced(model, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    theirs = teacher_forced(cpu, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    assert max_relative_logit_error(theirs, ours) <= 1e-5
    assert not [name for name in met.counter_names() if name.startswith("aten::")]


@pytest.mark.parametrize(
    "kv", [{"kv_cache_quant": True}, {"kv_quant_config": {"quant_dtype": "float8_e5m2"}}], ids=["e4m3fn", "e5m2"]
)
def test_a_float8_kv_cache_lowers_and_gives_the_cpu_engine_tokens(
    kv: dict[str, Any], tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """A float8 KV cache is a float8 HLO parameter, written (scatter) and read (convert) in the
    program, aliased in place across buckets: the CPU engine's tokens and logits, no host fallbacks."""
    path = tiny_checkpoint("llama")
    met.clear_all()
    model = load_model(path, "llama", workdir=tmp_path, backend="xla", batch_size=4, **BUCKETS, **kv)
    cpu = load_model(path, "llama", batch_size=4, **BUCKETS, **kv)
    tokens = nxdi_generate(model, PROMPTS, max_new_tokens=40)
    assert torch.equal(tokens, nxdi_generate(cpu, PROMPTS, max_new_tokens=40))
    ours = teacher_forced(model, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    theirs = teacher_forced(cpu, PROMPTS, tokens[:, : LOGIT_STEPS - 1])
    assert max_relative_logit_error(theirs, ours) <= 1e-5
    assert not [name for name in met.counter_names() if name.startswith("aten::")]
    hlo = zipfile.ZipFile(next((tmp_path).rglob("token_generation_32.xla"))).read("module.hlo.txt").decode()
    dtype = "f8e4m3fn" if "kv_cache_quant" in kv else "f8e5m2"
    assert f"{dtype}[" in hlo.split("ENTRY")[1].split("\n")[0]  # a float8 cache parameter


def _same_routing(ours: Any, theirs: Any) -> None:
    for a, b in zip(ours.router_logits, theirs.router_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(ours.expert_index, theirs.expert_index, strict=True):
        assert torch.equal(a, b)


def test_routing_outputs_equal_the_cpu_engine(xla_model: Callable[..., Any], loaded_model: Callable[..., Any]) -> None:
    """A mixture of experts' router logits and chosen experts, extra named outputs of the lowered
    programs, as the CPU engine gives them: prefill of a padded batch, then a decode step."""
    routing = {"return_router_logits": True, "return_expert_index": True}
    model, cpu = xla_model("mixtral", batch_size=2, **routing), loaded_model("mixtral", batch_size=2, **routing)
    ids = torch.tensor([[1, 5, 7, 9], [0, 0, 3, 4]])
    mask = (ids != 0).long()
    ours, theirs = model(ids, attention_mask=mask), cpu(ids, attention_mask=mask)
    _same_routing(ours, theirs)
    step, position = ours.logits[:, -1].argmax(-1)[:, None], mask.sum(1, keepdim=True)  # [[4], [2]]
    _same_routing(model(step, position_ids=position), cpu(step, position_ids=position))


def test_speculation_programs_lower_and_give_the_cpu_engines_tokens(
    xla_model: Callable[..., Any], loaded_model: Callable[..., Any]
) -> None:
    """speculation_length=4: the speculation programs lower to HLO; a k-token step's logits equal
    the CPU engine's, and speculative generation with a draft gives the same tokens."""
    from nxdi.shell.generation import HuggingFaceGenerationAdapter
    from tests.support.engine_fixtures import padded

    model = xla_model("llama", batch_size=4, speculation_length=4)
    cpu = loaded_model("llama", batch_size=4, speculation_length=4)
    draft = loaded_model("llama", batch_size=4, torch_dtype="bfloat16")  # a draft that disagrees sometimes
    ids, mask = padded(PROMPTS, "right")
    outs = []
    for m in (model, cpu):
        outs.append(
            HuggingFaceGenerationAdapter(m).generate(
                ids, attention_mask=mask, assistant_model=draft, max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        )
    assert torch.equal(outs[0], outs[1])
    step = torch.randint(3, 100, (4, 4), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, cpu):
        m.reset()
        m.forward(ids, attention_mask=mask)
        logits.append(m.forward(step, position_ids=mask.sum(-1, keepdim=True) + torch.arange(4)).logits)
    for row in range(4):
        for i in range(4):
            assert max_relative_logit_error(logits[1][row, i], logits[0][row, i]) <= 1e-5, (row, i)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_fused_speculation_programs_lower_and_give_the_cpu_engines_tokens(
    sampling: bool, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """enable_fused_speculation: the context and fused programs (both models' weights and caches,
    the draft's k steps unrolled, acceptance inside: greedy, or speculative sampling) lower to
    HLO; generation (seeded alike) and one fused step's outputs equal the CPU engine's."""
    import nxdi
    from nxdi.testing import checkpoints
    from tests.support.engine_fixtures import padded
    from tests.support.fused_models import K, fused_config

    target = tiny_checkpoint("llama")
    draft, _ = checkpoints.build_checkpoint(
        tmp_path / "draft", "llama", checkpoints.SaveFormat.SAFETENSORS, seed=7, num_hidden_layers=1
    )
    ods = {"do_sample": True} if sampling else {"top_k": 1}
    settings = {"batch_size": 4, "output_logits": True, "on_device_sampling_config": ods}
    model = nxdi.NeuronLlamaForCausalLM(target, fused_config(target, draft, **settings), backend="xla")
    model.compile(tmp_path / "xla", debug=True)
    model.load(tmp_path / "xla")
    hlo = sorted(p.name for p in (tmp_path / "xla" / "hlo").iterdir())
    assert hlo == ["context_encoding_64.hlo.txt", f"fused_speculation_{64 + K}.hlo.txt"]
    cpu = nxdi.NeuronLlamaForCausalLM(target, fused_config(target, draft, **settings))
    cpu.to_cpu()
    generation = {"do_sample": True, "top_k": 20, "temperature": 0.8} if sampling else {}
    try:
        tokens = []
        for m in (model, cpu):
            m.set_seed(5)
            tokens.append(nxdi_generate(m, PROMPTS, max_new_tokens=12, **generation))
        assert torch.equal(tokens[0], tokens[1])
        ids, mask = padded(PROMPTS, "right")
        outs = []
        for m in (model, cpu):
            m.set_seed(6)
            m.reset()
            first = m.forward(ids, attention_mask=mask).fused_outputs
            outs.append(m.forward(first[1], position_ids=first[3]).fused_outputs)
        for i in (0, 1, 3):
            assert torch.equal(outs[0][i], outs[1][i]), i
        for row in range(4):
            for i in range(K):
                assert max_relative_logit_error(outs[1][5][row, i], outs[0][5][row, i]) <= 1e-5, (row, i)
    finally:
        model.close()


def test_eagle_fused_programs_lower_and_give_the_cpu_engines_tokens(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any], tmp_path: Path
) -> None:
    """enable_eagle_speculation: the context and fused programs with an EAGLE draft (its pairs, the
    hidden state threaded through the draft's k steps, the re-pair run and the hidden-state cache)
    lower to HLO; greedy generation and one fused step's outputs equal the CPU engine's."""
    import nxdi
    from nxdi.testing import eagle
    from tests.support.engine_fixtures import padded
    from tests.support.fused_models import K, eagle_config

    target, hf = tiny_checkpoint("llama"), tiny_model("llama")
    draft = eagle.save_eagle_draft(eagle.from_target(hf, seed=3), hf.lm_head.weight, tmp_path / "draft")
    settings = {"batch_size": 4, "output_logits": True}
    model = nxdi.NeuronLlamaForCausalLM(target, eagle_config(target, draft, **settings), backend="xla")
    model.compile(tmp_path / "xla", debug=True)
    model.load(tmp_path / "xla")
    hlo = sorted(p.name for p in (tmp_path / "xla" / "hlo").iterdir())
    assert hlo == ["context_encoding_64.hlo.txt", f"fused_speculation_{64 + K}.hlo.txt"]
    cpu = nxdi.NeuronLlamaForCausalLM(target, eagle_config(target, draft, **settings))
    cpu.to_cpu()
    try:
        tokens = [nxdi_generate(m, PROMPTS, max_new_tokens=12) for m in (model, cpu)]
        assert torch.equal(tokens[0], tokens[1])
        ids, mask = padded(PROMPTS, "right")
        outs = []
        for m in (model, cpu):
            m.reset()
            first = m.forward(ids, attention_mask=mask).fused_outputs
            outs.append(m.forward(first[1], position_ids=first[3]).fused_outputs)
        for i in (0, 1, 3):
            assert torch.equal(outs[0][i], outs[1][i]), i
        for row in range(4):
            for i in range(K):
                assert max_relative_logit_error(outs[1][4][row, i], outs[0][4][row, i]) <= 1e-4, (row, i)
                assert max_relative_logit_error(outs[1][5][row, i], outs[0][5][row, i]) <= 1e-5, (row, i)
    finally:
        model.close()


def test_eagle_token_tree_programs_lower_and_give_the_cpu_engines_tokens(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any], tmp_path: Path
) -> None:
    """token_tree_config: the tree step (the draft's level-by-level expansion with its tree masks,
    the target's tree pass, in-program acceptance, KV compaction, the re-pair run) lowers to HLO;
    greedy generation and one tree step's outputs equal the CPU engine's."""
    import nxdi
    from nxdi.testing import eagle
    from tests.support.engine_fixtures import padded
    from tests.support.fused_models import eagle_config

    target, hf = tiny_checkpoint("llama"), tiny_model("llama")
    draft = eagle.save_eagle_draft(eagle.from_target(hf, seed=3), hf.lm_head.weight, tmp_path / "draft")
    tree = {"0": [1, 2], "1": [3, 4], "2": [5], "3": [6]}
    settings = {"batch_size": 4, "token_tree_config": tree, "speculation_length": 7}
    model = nxdi.NeuronLlamaForCausalLM(target, eagle_config(target, draft, **settings), backend="xla")
    model.compile(tmp_path / "xla", debug=True)
    model.load(tmp_path / "xla")
    hlo = sorted(p.name for p in (tmp_path / "xla" / "hlo").iterdir())
    assert hlo == ["context_encoding_64.hlo.txt", f"fused_speculation_{64 + 7}.hlo.txt"]
    cpu = nxdi.NeuronLlamaForCausalLM(target, eagle_config(target, draft, **settings))
    cpu.to_cpu()
    try:
        tokens = [nxdi_generate(m, PROMPTS, max_new_tokens=12) for m in (model, cpu)]
        assert torch.equal(tokens[0], tokens[1])
        ids, mask = padded(PROMPTS, "right")
        outs = []
        for m in (model, cpu):
            m.reset()
            first = m.forward(ids, attention_mask=mask).fused_outputs
            outs.append(m.forward(first[1], position_ids=first[3]).fused_outputs)
        assert outs[0][0].shape == (4, 4)
        for i in (0, 1, 3):
            assert torch.equal(outs[0][i], outs[1][i]), i
    finally:
        model.close()


def test_medusa_tree_programs_lower_and_give_the_cpu_engines_tokens(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """is_medusa=True: the tree programs (tree attention, in-program acceptance, KV compaction and
    the heads) lower to HLO and run without host fallbacks; a tree step's logits and outputs equal
    the CPU engine's, and Medusa generation gives its tokens and acceptance counts."""
    import shutil

    from nxdi.shell import medusa as medusa_loop
    from nxdi.shell.generation import HuggingFaceGenerationAdapter
    from nxdi.testing import checkpoints
    from nxdi.testing import medusa as testing_medusa
    from tests.support.engine_fixtures import padded

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    config = checkpoints.tiny_config("llama")
    testing_medusa.save_medusa_heads(testing_medusa.random_medusa_heads(config, 4, seed=1), folder)
    tree = [list(p) for p in testing_medusa.DEFAULT_TREE]
    medusa = {"is_medusa": True, "medusa_speculation_length": 12, "num_medusa_heads": 4, "medusa_tree": tree}
    met.clear_all()
    model = load_model(folder, "llama", workdir=tmp_path, backend="xla", batch_size=4, **medusa)
    cpu = load_model(folder, "llama", batch_size=4, **medusa)
    ids, mask = padded(PROMPTS, "right")
    outs, stats = [], []
    for m in (model, cpu):
        adapter = HuggingFaceGenerationAdapter(m)
        outs.append(
            adapter.generate(
                ids, attention_mask=mask, assistant_model=adapter, max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        )
        stats.append(adapter.speculation_stats)
    assert torch.equal(outs[0], outs[1]) and stats[0] == stats[1] and stats[0]["tree_steps"] > 0
    tokens = torch.randint(3, 150, (4, 12), generator=torch.Generator().manual_seed(0))
    steps = []
    for m in (model, cpu):
        m.reset()
        m.forward(ids, attention_mask=mask)
        steps.append(medusa_loop.tree_step(m, tokens, mask.sum(-1)))
    assert steps[0].logits is not None and steps[1].logits is not None
    assert max_relative_logit_error(steps[1].logits, steps[0].logits) <= 1e-5
    assert torch.equal(steps[0].tokens, steps[1].tokens) and torch.equal(steps[0].candidates, steps[1].candidates)
    assert not [name for name in met.counter_names() if name.startswith("aten::")]


def test_lora_programs_lower_and_give_the_cpu_engines_tokens(
    tiny_model: Callable[[str], Any], tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Three PEFT adapters and a base-model row in one batch: the xla programs' greedy tokens equal
    the CPU engine's."""
    from nxdi.shell.config import LoraServingConfig
    from tests.support.lora_adapters import ROWS, save_adapters

    paths = save_adapters(tiny_model("llama"), tmp_path / "adapters")

    def make(**backend: Any) -> Any:
        lora = LoraServingConfig(max_loras=3, lora_ckpt_paths=paths, enable_base_model_only=True)
        path = tiny_checkpoint("llama")
        return load_model(path, "llama", workdir=tmp_path, batch_size=4, lora_config=lora, **backend)

    names = [adapter or 0 for adapter in ROWS]
    xla, cpu = make(backend="xla"), make()
    got, want = (nxdi_generate(m, PROMPTS, max_new_tokens=12, adapter_ids=names) for m in (xla, cpu))
    assert torch.equal(got, want)

"""KV-cache quantization end to end: `kv_cache_quant=True` / `kv_quant_config` on the CPU engine.

The cache is allocated as float8 (half the bytes of bf16, what the planner reports), a prefill
stores the float8 cast of what an unquantized model stores, logits move a little, and greedy
tokens of a briefly trained bf16 model stay those of the unquantized model. It runs with the block
KV layout, over two rank processes, and from a compiled folder (written in place on the cpu backend).
The xla backend's float8 cache is checked against this engine in tests/xla.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.core.planning import memory
from nxdi.core.programs import kv_cache
from nxdi.shell.cli.main import main
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import ArtifactIntegrityError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi.testing import checkpoints
from nxdi.testing.training import progression_batch, train_briefly
from tests.support.block_serving import serve_rows
from tests.support.engine_fixtures import PROMPTS, load_model, nxdi_generate, padded, runtime_of, teacher_forced
from tests.support.serving import REQUESTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCKS = dict(
    batch_size=4,
    ctx_batch_size=1,
    is_continuous_batching=True,
    is_block_kv_layout=True,
    pa_block_size=4,
    pa_num_blocks=96,
)


def _cache_tensors(model: Any) -> tuple[torch.Tensor, ...]:
    cache = runtime_of(model).cache
    return (*cache.k, *cache.v)


def _cache_bytes(model: Any) -> int:
    return sum(t.nbytes for t in _cache_tensors(model))


@pytest.mark.parametrize(
    ("quant", "dtype"),
    [({"kv_cache_quant": True}, E4M3), ({"kv_quant_config": {"quant_dtype": E5M2}}, E5M2)],
    ids=["kv_cache_quant", "kv_quant_config-e5m2"],
)
def test_the_cache_is_float8_half_of_bf16_and_what_the_planner_reports(
    quant: dict[str, Any], dtype: torch.dtype, loaded_model: Callable[..., Any], tiny_checkpoint: Callable[..., Path]
) -> None:
    model = loaded_model("llama", batch_size=2, torch_dtype="bfloat16", **quant)
    bf16 = loaded_model("llama", batch_size=2, torch_dtype="bfloat16")
    assert {t.dtype for t in _cache_tensors(model)} == {dtype}
    assert {t.dtype for t in _cache_tensors(bf16)} == {torch.bfloat16}
    assert 2 * _cache_bytes(model) == _cache_bytes(bf16)
    plan = memory.memory_plan_for(model.model_spec, model.spec).unwrap()
    assert plan.kv_cache_bytes_per_core == _cache_bytes(model)
    if "kv_cache_quant" in quant:  # `nxdi plan` takes the flag (kv_quant_config has none)
        flags = ["--seq-len", "64", "--batch-size", "2", "--torch-dtype", "bfloat16", "--kv-cache-quant", "--json"]
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["plan", "--model-path", str(tiny_checkpoint("llama")), *flags]) == 0
        doc = json.loads(out.getvalue())
        assert doc["kv_cache"]["dtype"] == "float8_e4m3fn"
        assert doc["memory"]["kv_cache_bytes_per_core"] == _cache_bytes(model)


def test_a_prefill_stores_the_float8_cast_of_the_unquantized_cache(loaded_model: Callable[..., Any]) -> None:
    """fp32 compute on both sides: layer 0's keys and values depend on the embeddings alone, so the
    quantized model stores byte for byte the float8 cast of the fp32 model's; later layers read
    attention over the quantized cache, so they and the logits come close, not equal."""
    base = loaded_model("llama", batch_size=4)
    quant = loaded_model("llama", batch_size=4, kv_cache_quant=True)
    ids, mask = padded(PROMPTS, "right")
    logits = []
    for m in (base, quant):
        m.reset()
        logits.append(m.forward(ids, attention_mask=mask).logits[:, -1])
    theirs, ours = runtime_of(base).cache, runtime_of(quant).cache
    for want, got in ((theirs.k[0], ours.k[0]), (theirs.v[0], ours.v[0])):
        assert got.dtype == E4M3
        assert torch.equal(kv_cache.bits(got), kv_cache.bits(kv_cache.store(want, E4M3)))
        assert not torch.equal(got.float(), want), "the cast changed values: the cache is really float8"
    for want, got in zip((*theirs.k[1:], *theirs.v[1:]), (*ours.k[1:], *ours.v[1:]), strict=True):
        # e4m3 keeps 3 mantissa bits: a cast errs by up to 1/16 of a value (measured here: up to
        # 0.056 of the largest value, cast and drift from layer 0 together)
        scaled = float((got.float() - want).abs().max() / want.abs().max())
        assert scaled < 0.1, f"a later layer's cache strays {scaled:.3f} of its largest value from the fp32 one"
    err = max(max_relative_logit_error(logits[0][r], logits[1][r]) for r in range(len(PROMPTS)))
    assert 0 < err < 0.05, f"max logit error relative to the largest logit: {err:.4f}"


def test_seq_ids_choose_the_float8_cache_rows_written(loaded_model: Callable[..., Any]) -> None:
    """Rows named by seq_ids are written back into the float8 cache row by row (on its bytes)."""
    model = loaded_model("llama", batch_size=2, kv_cache_quant=True)
    ids, mask = padded([PROMPTS[0], PROMPTS[2]], "right")
    written = []
    for seq_ids in ([0, 1], [1, 0]):
        model.reset()
        runtime_of(model).reset_cache()
        model.forward(ids, attention_mask=mask, seq_ids=torch.tensor(seq_ids))
        written.append([kv_cache.bits(t).clone() for t in _cache_tensors(model)])
    for straight, swapped in zip(*written, strict=True):
        assert torch.count_nonzero(straight[0]) > 0 and torch.equal(straight[[1, 0]], swapped)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly trained llama stored in bf16: confident logits, like real weights, at every position
    the test generates (trained on 80 tokens: past its training length a model's top logits tie, and
    bf16 itself then flips greedy tokens against fp32; trained on 33 only 87% of bf16's tokens were fp32's)."""
    model = checkpoints.build_model("llama", initializer_range=0.02)
    train_briefly(model, steps=150, length=80)
    folder = tmp_path_factory.mktemp("trained")
    return checkpoints.save_checkpoint(model.to(torch.bfloat16), folder, checkpoints.SaveFormat.SAFETENSORS)


def test_float8_greedy_tokens_match_the_unquantized_bf16_model(trained: Path) -> None:
    """Measured: every one of 4 x 64 tokens matches; max logit error 0.035 of the largest logit."""
    new = 64
    prompts = progression_batch(160, batch=4, length=8, generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(torch_dtype="bfloat16", batch_size=4, seq_len=128)
    base = load_model(trained, "llama", **common)
    quant = load_model(trained, "llama", kv_cache_quant=True, **common)
    want, got = (nxdi_generate(m, prompts, max_new_tokens=new) for m in (base, quant))
    per_row = (want == got).float().mean(1).tolist()
    match = float((want == got).float().mean())
    # Logits of both models fed the unquantized model's tokens (teacher forcing), position by position.
    theirs, ours = (teacher_forced(m, prompts, want[:, : new - 1]) for m in (base, quant))
    err = max(max_relative_logit_error(theirs[r, i], ours[r, i]) for r in range(4) for i in range(new))
    report = f"tokens matching: {match:.3f} (per row {per_row}); max logit error / largest logit: {err:.4f}"
    print(report)
    assert match >= 0.95, report
    assert err < 0.05, report


def test_the_block_kv_layout_with_a_float8_cache_gives_the_contiguous_tokens_in_place(
    loaded_model: Callable[..., Any],
) -> None:
    block = loaded_model("llama", backend="cpu", kv_cache_quant=True, **BLOCKS)  # compiled programs
    assert {t.dtype for t in _cache_tensors(block)} == {E4M3}
    before = [t.data_ptr() for t in _cache_tensors(block)]
    tokens, _ = serve_rows(block)
    assert [t.data_ptr() for t in _cache_tensors(block)] == before, "no copy of the block cache per step"
    contiguous = loaded_model("llama", batch_size=len(REQUESTS), kv_cache_quant=True)
    most = max(r.new_tokens for r in REQUESTS)
    want = nxdi_generate(contiguous, [r.prompt for r in REQUESTS], max_new_tokens=most)
    assert tokens == [want[i, : r.new_tokens].tolist() for i, r in enumerate(REQUESTS)]


@pytest.mark.parametrize(
    "ranks", [{"tp_degree": 2}, {"tp_degree": 4, "flash_decoding_enabled": True}], ids=["tp2", "tp4-flash-decoding"]
)
def test_rank_processes_with_a_float8_cache_give_the_one_rank_tokens(
    ranks: dict[str, Any], tp_model: Callable[..., Any], loaded_model: Callable[..., Any]
) -> None:
    """With flash decoding each rank of a group holds a share of a KV head's positions; a rank that
    does not own a new token's position writes the slot's old float8 bytes back."""
    model = tp_model("llama", batch_size=4, kv_cache_quant=True, **ranks)
    one = loaded_model("llama", batch_size=4, kv_cache_quant=True)
    assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(one, PROMPTS))


def test_compile_then_load_from_the_folder_keeps_the_float8_cache(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, loaded_model: Callable[..., Any]
) -> None:
    path = tiny_checkpoint("llama")

    def config(**quant: Any) -> LlamaInferenceConfig:
        neuron = NeuronConfig(torch_dtype="float32", seq_len=64, batch_size=4, save_sharded_checkpoint=True, **quant)
        return LlamaInferenceConfig(neuron, load_config=load_pretrained_config(path))

    NeuronLlamaForCausalLM(path, config(kv_cache_quant=True)).compile(tmp_path)
    assert json.loads((tmp_path / "neuron_config.json").read_text())["neuron_config"]["kv_cache_quant"] is True
    model = NeuronLlamaForCausalLM(tmp_path)  # the configuration read back from the folder
    model.load(tmp_path)
    assert model.neuron_config.kv_cache_quant and {t.dtype for t in _cache_tensors(model)} == {E4M3}
    eager = loaded_model("llama", batch_size=4, kv_cache_quant=True)
    assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(eager, PROMPTS))
    with pytest.raises(ArtifactIntegrityError, match="graph_key"):  # a quantized cache is another graph
        NeuronLlamaForCausalLM(path, config()).load(tmp_path)

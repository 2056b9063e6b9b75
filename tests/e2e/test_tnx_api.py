"""The transformers-neuronx API (`nxdi.shell.tnx`) on the nxdi engine, against transformers.

- `sample(top_k=1)` gives transformers' greedy tokens (batch 1, and batch 2 left-padded through
  `start_ids`), as does `HuggingFaceGenerationModelAdapter(config, model).generate()`.
- `no_repeat_ngram_size` bans what transformers' `no_repeat_ngram_size` bans (same tokens); the
  streamer gets each step's [B, 1] tokens; a stopping criterion stops after the step it says so;
  rows past EOS repeat EOS.
- `NeuronAutoModelForCausalLM` picks the family's class; `save`/`load` skip compiling; int8
  weight storage stores int8; continuous batching routes `start_ids` to sequence slots.
- Bad input is refused naming it: unknown arguments and settings, a family that does not run
  yet, another family's checkpoint, a sequence past n_positions, on-device sampling with host-only
  options, and nxdi's HuggingFaceGenerationAdapter called the transformers-neuronx way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig

import nxdi
from nxdi.core import families
from nxdi.shell.tnx import (
    GQA,
    ContinuousBatchingConfig,
    GenerationConfig,
    HuggingFaceGenerationModelAdapter,
    LlamaForSampling,
    MistralForSampling,
    NeuronAutoModelForCausalLM,
    NeuronConfig,
    QuantizationConfig,
)
from nxdi.shell.tnx.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from nxdi.testing import checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 3]])
LENGTH = 20


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Callable[..., Path]) -> Any:
    model = LlamaForSampling.from_pretrained(str(tiny_checkpoint("llama")), n_positions=128, batch_size=1)
    model.to_neuron()
    yield model
    model.nxdi_model.close()


@pytest.fixture(scope="module")
def llama2(tiny_checkpoint: Callable[..., Path]) -> Any:
    model = NeuronAutoModelForCausalLM.from_pretrained(str(tiny_checkpoint("llama")), n_positions=128, batch_size=2)
    model.to_neuron()
    yield model
    model.nxdi_model.close()


def _hf(tiny_model: Callable[[str], Any], ids: torch.Tensor, mask: torch.Tensor | None = None, **kw: Any) -> Any:
    hf = tiny_model("llama")
    return hf.generate(ids, attention_mask=mask, max_length=LENGTH, do_sample=False, pad_token_id=0, **kw)


def test_greedy_sample_equals_transformers(llama: Any, tiny_model: Callable[[str], Any]) -> None:
    torch.testing.assert_close(llama.sample(PROMPT, LENGTH, top_k=1), _hf(tiny_model, PROMPT))


def test_left_padded_batch_through_start_ids(llama2: Any, tiny_model: Callable[[str], Any]) -> None:
    assert type(llama2).__name__ == "LlamaForSampling"  # the auto class picked the family's class
    ids = torch.tensor([[0, 0, 0, 1, 5, 7], [1, 5, 7, 9, 11, 3]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = llama2.sample(ids, LENGTH, top_k=1, start_ids=torch.tensor([3, 0]))
    torch.testing.assert_close(out, _hf(tiny_model, ids, mask))


def test_a_prompt_past_the_largest_context_length_estimate_still_gives_transformers_tokens(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    """context_length_estimate=4 with 6- and 3-token (left-padded) prompts: the first 4 columns are
    encoded in parallel, the rest one per token step, as transformers-neuronx does."""
    model = LlamaForSampling.from_pretrained(
        str(tiny_checkpoint("llama")), n_positions=64, batch_size=2, context_length_estimate=4
    )
    model.to_neuron()
    try:
        ids = torch.tensor([[0, 0, 0, 1, 5, 7], [1, 5, 7, 9, 11, 3]])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        out = model.sample(ids, LENGTH, top_k=1, start_ids=torch.tensor([3, 0]))
        torch.testing.assert_close(out, _hf(tiny_model, ids, mask))
        with pytest.raises(nxdi.IncompatibleConfigError, match=r"start_ids=\[4, 0\].*padding fills the whole first 4"):
            model.sample(
                torch.tensor([[0, 0, 0, 0, 1, 5], [1, 5, 7, 9, 11, 3]]), LENGTH, start_ids=torch.tensor([4, 0])
            )
    finally:
        model.nxdi_model.close()


def test_no_repeat_ngram_size_bans_as_transformers(llama: Any, tiny_model: Callable[[str], Any]) -> None:
    plain = llama.sample(PROMPT, LENGTH, top_k=1)
    banned = llama.sample(PROMPT, LENGTH, top_k=1, no_repeat_ngram_size=2)
    assert not torch.equal(plain, banned)  # the tiny model repeats itself without the ban
    bigrams = list(zip(banned[0].tolist(), banned[0, 1:].tolist(), strict=False))
    assert len(bigrams) == len(set(bigrams))
    torch.testing.assert_close(banned, _hf(tiny_model, PROMPT, no_repeat_ngram_size=2))


class _Record:
    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.ended = 0

    def put(self, tokens: torch.Tensor) -> None:
        self.tokens.append(tokens)

    def end(self) -> None:
        self.ended += 1


class _AfterCalls(StoppingCriteria):
    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_a_stopping_criterion_without_call_cannot_be_made() -> None:
    class Incomplete(StoppingCriteria):
        pass

    with pytest.raises(TypeError, match="__call__"):
        Incomplete()  # type: ignore[abstract]


def test_streamer_and_stopping_criteria(llama: Any) -> None:
    streamer = _Record()
    out = llama.sample(
        PROMPT, LENGTH, top_k=1, streamer=streamer, stopping_criteria_list=StoppingCriteriaList([_AfterCalls(3)])
    )
    assert out.shape == (1, PROMPT.shape[1] + 3) and streamer.ended == 1
    assert [t.shape for t in streamer.tokens] == [(1, 1)] * 3
    torch.testing.assert_close(torch.cat(streamer.tokens, dim=-1), out[:, PROMPT.shape[1] :])


def test_rows_past_eos_repeat_eos(llama: Any) -> None:
    greedy = llama.sample(PROMPT, LENGTH, top_k=1)
    new = greedy[0, PROMPT.shape[1] :].tolist()
    first = next(i for i, t in enumerate(new) if i > 0 and t not in new[:i])  # a later token seen first there
    out = llama.sample(PROMPT, LENGTH, top_k=1, eos_token_override=new[first])
    torch.testing.assert_close(out, greedy[:, : PROMPT.shape[1] + first + 1])  # one row: stops at its EOS


def test_finished_rows_repeat_eos_in_a_batch(llama2: Any) -> None:
    ids = torch.cat([PROMPT, torch.tensor([[1, 4, 4, 8, 9, 10]])])
    width = ids.shape[1]
    greedy = llama2.sample(ids, LENGTH, top_k=1)
    eos = int(greedy[0, width + 2])
    expected = greedy.clone()
    for row in expected:
        hits = (row[width:] == eos).nonzero()
        if len(hits):
            row[width + int(hits[0]) :] = eos
    done = [(row[width:] == eos).nonzero() for row in expected]
    if all(len(d) for d in done):  # every row finished: the loop stops at the last one's EOS
        expected = expected[:, : width + max(int(d[0]) for d in done) + 1]
    out = llama2.sample(ids, LENGTH, top_k=1, eos_token_override=eos)
    torch.testing.assert_close(out, expected)
    assert int((out[0, width:] == eos).sum()) > 1  # row 0 repeats it


def test_sampling_is_seeded_and_within_top_k(llama: Any) -> None:
    torch.manual_seed(0)
    a = llama.sample(PROMPT, LENGTH, top_k=5, temperature=2.0)
    torch.manual_seed(0)
    b = llama.sample(PROMPT, LENGTH, top_k=5, temperature=2.0)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, llama.sample(PROMPT, LENGTH, top_k=1))


def test_hf_generation_model_adapter(
    llama: Any, tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    adapter = HuggingFaceGenerationModelAdapter(AutoConfig.from_pretrained(tiny_checkpoint("llama")), llama)
    adapter.reset_generation()
    out = adapter.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_length=LENGTH, do_sample=False)
    torch.testing.assert_close(out, _hf(tiny_model, PROMPT))
    with pytest.raises(TypeError, match=r"HuggingFaceGenerationAdapter\(config, model\) is transformers-neuronx's"):
        nxdi.HuggingFaceGenerationAdapter(AutoConfig.from_pretrained(tiny_checkpoint("llama")), llama.nxdi_model)
    with pytest.raises(TypeError, match="HuggingFaceGenerationModelAdapter"):
        nxdi.HuggingFaceGenerationAdapter(llama)
    with pytest.raises(ValueError, match="'mistral' config but the model is 'llama'"):
        HuggingFaceGenerationModelAdapter(AutoConfig.from_pretrained(tiny_checkpoint("mistral")), llama)


def test_save_then_load_skips_compiling(llama: Any, tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    llama.save(tmp_path / "saved")
    again = LlamaForSampling.from_pretrained(str(tiny_checkpoint("llama")), n_positions=128)
    again.load(tmp_path / "saved")
    again.to_neuron()
    assert not again.nxdi_model.is_compiled or again._compiled == str(tmp_path / "saved")
    torch.testing.assert_close(again.sample(PROMPT, LENGTH, top_k=1), llama.sample(PROMPT, LENGTH, top_k=1))
    again.nxdi_model.close()
    other = LlamaForSampling.from_pretrained(str(tiny_checkpoint("llama")), n_positions=64)
    other.load(tmp_path / "saved")
    with pytest.raises(nxdi.ArtifactIntegrityError):
        other.to_neuron()  # compiled for n_positions=128


def test_int8_weight_storage(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    config = NeuronConfig(quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="f32"))
    model = LlamaForSampling.from_pretrained(
        str(tiny_checkpoint("llama")), n_positions=64, amp="f32", neuron_config=config
    )
    spec = model.nxdi_model.spec
    assert spec.quantized and spec.quantization_dtype == "int8" and spec.quantization_type == "per_channel_symmetric"
    model.to_neuron()
    stored = safetensors.torch.load_file(Path(spec.quantized_checkpoints_path) / "model.safetensors")
    assert any(t.dtype == torch.int8 for t in stored.values())
    assert model.sample(PROMPT, 12, top_k=1).shape == (1, 12)
    model.save(tmp_path / "q")  # the int8 weights go with it
    assert (tmp_path / "q" / "weights" / "tp0_sharded_checkpoint.safetensors").is_file()
    model.nxdi_model.close()
    with pytest.raises(ValueError, match="amp='bf16': with quant it must equal dequant_dtype='f32'"):
        LlamaForSampling.from_pretrained(str(tiny_checkpoint("llama")), amp="bf16", neuron_config=config)


def test_continuous_batching_routes_start_ids_to_slots(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=2))
    model = LlamaForSampling.from_pretrained(
        str(tiny_checkpoint("llama")), n_positions=64, batch_size=1, neuron_config=config
    )
    spec = model.nxdi_model.spec
    assert spec.is_continuous_batching and (spec.ctx_batch_size, spec.tkg_batch_size) == (1, 2)
    model.to_neuron()
    out = model.sample(PROMPT, LENGTH, top_k=1, start_ids=torch.tensor([1]))
    torch.testing.assert_close(out, _hf(tiny_model, PROMPT))
    model.nxdi_model.close()


def test_fuse_qkv_and_shard_over_sequence_map_onto_nxdi(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    path = str(tiny_checkpoint("llama"))
    fused = LlamaForSampling.from_pretrained(path, n_positions=64, neuron_config=NeuronConfig(fuse_qkv=True))
    assert fused.nxdi_model.spec.fused_qkv
    fused.to_neuron()
    torch.testing.assert_close(fused.sample(PROMPT, LENGTH, top_k=1), _hf(tiny_model, PROMPT))
    fused.nxdi_model.close()
    with pytest.warns(UserWarning, match="no effect on the CPU backend: flash_decoding_enabled"):
        flash = LlamaForSampling.from_pretrained(
            path, n_positions=64, neuron_config=NeuronConfig(shard_over_sequence=True)
        )
    assert flash.nxdi_model.spec.flash_decoding_enabled


def test_settings_without_cpu_effect_are_reported_once(tiny_checkpoint: Callable[..., Path]) -> None:
    config = NeuronConfig(attention_layout="BSH", on_device_embedding=True, group_query_attention=GQA.SHARD_OVER_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MistralForSampling.from_pretrained(
            str(tiny_checkpoint("mistral")), n_positions=64, tp_degree=2, neuron_config=config
        )
    said = [str(w.message) for w in caught if "transformers-neuronx settings" in str(w.message)]
    assert len(said) == 1
    for part in ("attention_layout='BSH'", "on_device_embedding=True", "GQA.SHARD_OVER_BATCH", "batch sizes divisible"):
        assert part in said[0]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: NeuronConfig(attention_layout="SBH"), r"attention_layout='SBH': must be one of"),
        (lambda: NeuronConfig(fuse_qvk=True), r"fuse_qvk=True: is not a transformers-neuronx NeuronConfig setting"),
        (lambda: NeuronConfig(sparse_attn=object()), r"sparse_attn=.*is not supported by nxdi"),
        (lambda: NeuronConfig(group_query_attention="heads"), r"group_query_attention='heads': must be a TnxStrategy"),
        (lambda: GenerationConfig(top_k=[1, 2]), r"top_k=\[1, 2\]: a list needs per_batch_line=True"),
        (lambda: GenerationConfig(top_p_min_tokens=4), r"top_p_min_tokens=4: .* set 1"),
        (lambda: QuantizationConfig(quant_dtype="s4"), r"quant_dtype='s4'"),
        (lambda: ContinuousBatchingConfig(), r"batch_size_for_shared_caches=None"),
    ],
    ids=["layout", "unknown", "refused", "gqa", "list", "min-tokens", "quant", "cb"],
)
def test_bad_settings_are_refused_by_name(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_arguments_are_refused_by_name(llama: Any, tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(
        ValueError, match=r"unroll=4: is not a from_pretrained argument\n  amp='fp8': must be one of f32, bf16, f16"
    ):
        LlamaForSampling.from_pretrained(path, amp="fp8", unroll=4)
    with pytest.raises(ValueError, match=r"MistralForSampling loads model_type mistral, not 'llama'"):
        MistralForSampling.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="download the model to a folder"):
        LlamaForSampling.from_pretrained("openlm-research/open_llama_3b")
    gpt2 = checkpoints.save_checkpoint(
        checkpoints.build_model("gpt2"), tmp_path / "gpt2", checkpoints.SaveFormat.SAFETENSORS
    )
    from nxdi.shell.tnx import GPT2ForSamplingWithContextBroadcasting

    if not any("gpt2" in r.model_types for r in families.runnable()):
        with pytest.raises(ValueError, match="model_type 'gpt2' does not run on the nxdi engine yet"):
            GPT2ForSamplingWithContextBroadcasting.from_pretrained(str(gpt2))
    with pytest.raises(
        ValueError, match=r"cache_ids=None: is not a sample\(\) argument; sequence_length=129: exceeds n_positions=128"
    ):
        llama.sample(PROMPT, 129, cache_ids=None)
    with pytest.raises(ValueError, match=r"update_generation_config.*without on_device_generation"):
        llama.update_generation_config(GenerationConfig(dynamic=True))


def test_on_device_generation_greedy_equals_transformers(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    """Greedy on device, and per-row parameters updated between calls (top_k=1 rows stay greedy)."""
    path = str(tiny_checkpoint("llama"))
    generation = GenerationConfig(do_sample=True, dynamic=True, per_batch_line=True, top_k=[1, 5], global_top_k=16)
    config = NeuronConfig(on_device_generation=generation)
    model = LlamaForSampling.from_pretrained(path, n_positions=64, batch_size=2, neuron_config=config)
    model.to_neuron()
    ids = torch.cat([PROMPT, PROMPT])
    generation.top_k = [1, 1]
    model.update_generation_config(generation)
    torch.testing.assert_close(model.sample(ids, LENGTH), _hf(tiny_model, ids))
    generation.top_k = [1, 20]
    with pytest.raises(ValueError, match=r"top_k=\[1, 20\]: exceeds the compiled global_top_k=16"):
        model.update_generation_config(generation)
    generation.top_k = [1, 16]  # row 1 samples, row 0 stays greedy
    model.update_generation_config(generation)
    torch.manual_seed(0)
    out = model.sample(ids, LENGTH)
    torch.testing.assert_close(out[:1], _hf(tiny_model, PROMPT))
    model.nxdi_model.close()


def test_on_device_generation_refuses_host_options(tiny_checkpoint: Callable[..., Path]) -> None:
    config = NeuronConfig(on_device_generation=GenerationConfig(do_sample=True, top_k=3))
    model = LlamaForSampling.from_pretrained(str(tiny_checkpoint("llama")), n_positions=64, neuron_config=config)
    with pytest.raises(ValueError, match=r"top_k=5: the model samples on device(.|\n)*no_repeat_ngram_size=2"):
        model.sample(PROMPT, 12, top_k=5, no_repeat_ngram_size=2)
    with pytest.raises(ValueError, match="dynamic=True"):
        model.update_generation_config(GenerationConfig(do_sample=True, top_k=4))

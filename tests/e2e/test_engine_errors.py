"""Bad inputs through the documented API: each raises one clear error naming what is wrong and the fix."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.effects.checkpoint import CorruptCheckpointError, UnsafeShardPathError
from nxdi.shell.exceptions import CheckpointValidationError, IncompatibleConfigError
from nxdi.testing.checkpoints import write_checkpoint_file
from tests.support.engine_fixtures import (
    PAD,
    PROMPTS,
    hf_generate,
    hf_logits,
    load_model,
    nxdi_generate,
    padded,
    program_calls,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = tuple(range(3, 23))  # 20 tokens
SHORT_CONTEXT = dict(batch_size=1, seq_len=32, max_context_length=16)


def test_a_prompt_longer_than_max_context_length_names_the_length_bucket_and_fix(
    loaded_model: Callable[..., Any],
) -> None:
    model = loaded_model("llama", **SHORT_CONTEXT)
    expected = r"input length 20 exceeds the largest context_encoding bucket \(16\).*allow_input_truncation=True"
    with pytest.raises(IncompatibleConfigError, match=expected):
        model.forward(torch.tensor([LONG]))
    with pytest.raises(IncompatibleConfigError, match=expected):
        nxdi_generate(model, [LONG], max_new_tokens=4)
    bucketed = loaded_model("llama", **SHORT_CONTEXT, enable_bucketing=True, context_encoding_buckets=[4, 8])
    with pytest.raises(IncompatibleConfigError, match=r"input length 20 .* bucket \(8\).*allow_input_truncation"):
        bucketed.forward(torch.tensor([LONG]))


def test_allow_input_truncation_keeps_the_first_max_context_length_tokens(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """As the reference does with right padding: the prompt is cut to its first 16 tokens, and
    generation continues from there (as transformers does on the cut prompt)."""
    model = loaded_model("llama", **SHORT_CONTEXT, allow_input_truncation=True)
    model.reset()
    warned = r"input length 20 exceeds max_context_length=16 .* keeps each prompt's first 16 tokens"
    with pytest.warns(UserWarning, match=warned):
        logits = model.forward(torch.tensor([LONG])).logits[0, -1]
    expected = hf_logits(tiny_model("llama"), LONG[:16])[-1]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    with pytest.warns(UserWarning, match=warned):
        ours = nxdi_generate(model, [LONG], max_new_tokens=8)
    assert torch.equal(ours, hf_generate(tiny_model("llama"), [LONG[:16]], max_new_tokens=8))


def test_generation_past_seq_len_raises_before_starting(loaded_model: Callable[..., Any]) -> None:
    """A 10-token prompt fills positions 0-9; N new tokens feed positions 10..8+N, so seq_len 32 allows N=23."""
    model = loaded_model("llama", **SHORT_CONTEXT)
    prompt = [PROMPTS[0]]
    assert nxdi_generate(model, prompt, max_new_tokens=23).shape == (1, 23)
    for limit in ({"max_new_tokens": 24}, {"max_length": 34}):
        with program_calls(model) as calls, pytest.raises(IncompatibleConfigError, match=r"max_length=32.*Fix: raise"):
            nxdi_generate(model, prompt, **limit)
        assert calls == [], "nothing ran"
    with pytest.raises(IncompatibleConfigError, match=r"position 32 is past max_length=32"):
        model.forward(torch.tensor([[5]]), position_ids=torch.tensor([[32]]))


def test_several_tokens_after_a_cached_prefix_are_honoured_not_dropped(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """Positions 10..12 continue a 10-token cached row: three decode steps, the last one's logits."""
    model = loaded_model("llama", batch_size=1)
    model.reset()
    model.forward(torch.tensor([PROMPTS[0]]))
    logits = model.forward(torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[10, 11, 12]])).logits[0, -1]
    expected = hf_logits(tiny_model("llama"), [*PROMPTS[0], 5, 6, 7])[-1]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    with pytest.raises(IncompatibleConfigError, match=r"position_ids\[0\]=\[13, 15, 16\]: row 0 decodes 3 tokens"):
        model.forward(torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[13, 15, 16]]))


def test_bad_sampling_params_rows_are_all_listed(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=2, on_device_sampling_config={"dynamic": True, "top_k": 5})
    ids, mask = padded(PROMPTS[:2], "right")
    bad = torch.tensor([[1.5, 2.0, -1.0], [300.0, 0.0, 1.0]])
    with pytest.raises(IncompatibleConfigError) as caught:
        model.forward(ids, attention_mask=mask, sampling_params=bad)
    assert caught.value.error is not None
    fields = [p.field for p in caught.value.error.problems]
    assert fields == [
        "sampling_params[0].top_k",
        "sampling_params[0].top_p",
        "sampling_params[0].temperature",
        "sampling_params[1].top_k",
        "sampling_params[1].top_p",
    ]
    message = str(caught.value)
    for text in ("must be represented as integers", "must be in (0, 1]", "must be >= 0", "must be -1 or in [0, 256]"):
        assert text in message
    with pytest.raises(IncompatibleConfigError, match=re.escape("sampling_params[1]=(0.0, 1.0, 0.0): invalid")):
        nxdi_generate(model, PROMPTS[:2], sampling_params=torch.tensor([[1, 1.0, 1.0], [0, 1.0, 0.0]]))
    with pytest.raises(IncompatibleConfigError, match=r"expected shape \(batch_size, 3\)"):
        model.forward(ids, attention_mask=mask, sampling_params=torch.ones(2, 2))
    with pytest.raises(IncompatibleConfigError, match=r"1 rows for a batch of 2"):
        model.forward(ids, attention_mask=mask, sampling_params=torch.ones(1, 3))


def test_seq_ids_outside_the_cache_rows_are_refused_with_every_problem(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=2)
    ids, mask = padded(PROMPTS[:2], "right")
    with pytest.raises(
        IncompatibleConfigError, match=r"seq_ids=\[0, 5\]: holds ids \[5\] outside the KV cache rows 0..1"
    ):
        model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([0, 5]))
    with pytest.raises(IncompatibleConfigError) as caught:
        model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([-1, 7]))
    assert "negative ids [-1]" in str(caught.value) and "ids [7] outside" in str(caught.value)
    with pytest.raises(IncompatibleConfigError, match=r"duplicate ids \[1\]"):
        model.forward(ids, attention_mask=mask, seq_ids=torch.tensor([1, 1]))
    with pytest.raises(IncompatibleConfigError, match=r"kv_cache_batch_size >= 3"):
        nxdi_generate(model, PROMPTS[:3], max_new_tokens=2)  # 3 rows need 3 cache rows


def test_unsupported_features_are_all_listed(tiny_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(IncompatibleConfigError) as caught:
        load_model(
            tiny_checkpoint("llama"),
            "llama",
            pp_degree=2,
            enable_fused_speculation=True,
            speculation_length=4,
            kv_quant_config={"direct_cast": False},  # scaled KV quantization: a refused sub-config attribute
            lora_config={"max_loras": 2, "eviction_policy": "lfu"},  # an eviction policy without dynamic_multi_lora
        )
    assert caught.value.error is not None
    assert {p.field for p in caught.value.error.problems} == {
        "pp_degree",
        "fused_spec_config",  # fused speculation runs, given its draft and on-device sampling
        "on_device_sampling_config",
        "kv_quant_config.direct_cast",
        "lora_config.eviction_policy",
        "speculation_length",  # multi-LoRA does not run with speculation yet
        "enable_fused_speculation",
    }
    assert "Cannot run on the CPU backend: 7 problems" in str(caught.value)


def test_forward_before_loading_says_how_to_load(tiny_checkpoint: Callable[..., Path]) -> None:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM

    path = tiny_checkpoint("llama")
    config = LlamaInferenceConfig(NeuronConfig(torch_dtype="float32"), load_config=load_pretrained_config(path))
    with pytest.raises(RuntimeError, match=r"not loaded: call load\(compiled_model_path\) or to_cpu\(\) first"):
        NeuronLlamaForCausalLM(path, config).forward(torch.tensor([[3, 4]]))


# --- bad checkpoints, through NeuronLlamaForCausalLM(...).to_cpu() ---------------------------------


def _state(tiny_model: Callable[[str], Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tiny_model("llama").state_dict().items()}


def _missing(d: Path, sd: dict[str, torch.Tensor], src: Path) -> None:
    del sd["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint_file(d / "model.safetensors", sd)


def _unexpected(d: Path, sd: dict[str, torch.Tensor], src: Path) -> None:
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    write_checkpoint_file(d / "model.safetensors", sd)


def _misshapen(d: Path, sd: dict[str, torch.Tensor], src: Path) -> None:
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    write_checkpoint_file(d / "model.safetensors", sd)


def _truncated(d: Path, sd: dict[str, torch.Tensor], src: Path) -> None:
    data = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 64])


def _outside(d: Path, sd: dict[str, torch.Tensor], src: Path) -> None:
    write_checkpoint_file(d / "model-00001-of-00001.safetensors", sd)
    write_checkpoint_file(d.parent / "elsewhere.safetensors", {"model.norm.weight": sd["model.norm.weight"]})
    weight_map = dict.fromkeys(sd, "model-00001-of-00001.safetensors") | {
        "model.norm.weight": "../elsewhere.safetensors"
    }
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    ("damage", "error", "names"),
    [
        (_missing, CheckpointValidationError, r"model\.layers\.1\.mlp\.up_proj\.weight: is required but missing"),
        (_unexpected, CheckpointValidationError, r"model\.layers\.0\.mlp\.extra\.weight=\(3,\): is not a weight"),
        (_misshapen, CheckpointValidationError, r"k_proj\.weight=\(5, 64\): has shape \(5, 64\), expected \(32, 64\)"),
        (_truncated, CorruptCheckpointError, r"model\.safetensors: not a valid safetensors file"),
        (_outside, UnsafeShardPathError, r"shard '\.\./elsewhere\.safetensors' lies outside"),
    ],
    ids=["missing-key", "unexpected-key", "wrong-shape", "truncated-file", "index-outside-dir"],
)
def test_a_bad_checkpoint_raises_one_clear_error_naming_the_key_or_file(
    damage: Callable[[Path, dict[str, torch.Tensor], Path], None],
    error: type[Exception],
    names: str,
    tiny_checkpoint: Callable[..., Path],
    tiny_model: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM

    src = tiny_checkpoint("llama")
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    damage(path, _state(tiny_model), src)
    config = LlamaInferenceConfig(NeuronConfig(torch_dtype="float32"), load_config=load_pretrained_config(path))
    model = NeuronLlamaForCausalLM(path, config)
    with pytest.raises(error, match=names) as caught:
        model.to_cpu()
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).count("\n  - ") <= 1, "one problem, stated once"
    with pytest.raises(RuntimeError, match="not loaded"):
        model.forward(torch.tensor([[3, PAD]]))

"""GPT-2, OPT, BLOOM, GPT-J and GPT-NeoX through the documented API, against transformers.

`test_families.py` checks every runnable record (these five included) at batch 2; here each of
them, and the layer variants their configs switch (OPT's post-norm layers, GPT-NeoX's sequential
residual), runs at batch 1 and at a left-padded batch 4 of uneven prompts: greedy tokens equal
transformers' and fp32 logits within 1e-4 of the largest, prefill and decode. Also: what the
engine loads is what `nxdi plan` counts, BLOOM's ALiBi slopes, and the refusals (each names the
setting).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers
from returns.result import Failure

from nxdi.core import families
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.planning import sharding
from nxdi.core.planning.partition import check_partition
from nxdi.core.programs import attention
from nxdi.effects import weight_loader as weight_io
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES
from nxdi.testing import checkpoints
from nxdi.testing.strategies.decoders import plan_of
from tests.support.block_serving import serve_rows
from tests.support.engine_fixtures import PROMPTS, hf_logits, load_model, nxdi_generate, padded
from tests.support.serving import REQUESTS

VARIANTS = ("gpt2", "opt", "opt-post-ln", "bloom", "gptj", "gpt_neox", "gpt_neox-sequential")
NEW_TOKENS = 12
BLOCKS = dict(
    batch_size=4,
    ctx_batch_size=1,
    is_continuous_batching=True,
    is_block_kv_layout=True,
    pa_block_size=4,
    pa_num_blocks=96,
)
"""A serving client's block KV layout (as in test_engine_block_kv)."""


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_equal_transformers(
    variant: str, batch: int, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """Batch 4 holds prompts of 1 to 14 tokens, left padded (transformers' own convention)."""
    prompts = PROMPTS[:batch]
    model = loaded_model(variant, batch_size=batch)
    ours = nxdi_generate(model, prompts, side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_greedy(variant, prompts, NEW_TOKENS))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"max |diff| {err} vs max |logit| {expected.abs().max().item()}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_decode_logits_match_transformers(
    variant: str, loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    model = loaded_model(variant, batch_size=4, output_logits=True)
    hf = tiny_model(variant)
    ids, mask = padded(PROMPTS[:4], "left")
    model.reset()
    out = model(ids, attention_mask=mask)
    sequences = [list(p) for p in PROMPTS[:4]]
    for _ in range(3):
        for row, seq in enumerate(sequences):
            _close(out.logits[row, 0], hf_logits(hf, seq)[-1])
        nxt = out.logits[:, 0].argmax(-1)
        positions = torch.tensor([[len(s)] for s in sequences])
        for seq, t in zip(sequences, nxt.tolist(), strict=True):
            seq.append(t)
        out = model(nxt[:, None], position_ids=positions)


@pytest.mark.parametrize("variant", ["gpt2", "opt-post-ln", "gptj", "gpt_neox"])
def test_the_block_kv_layout_gives_every_request_transformers_tokens(
    variant: str, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """Scattered block tables (a serving client's): learned positions and rotary ones read each
    token's position from its position id. (BLOOM's ALiBi refuses the block layout, below.)"""
    model = loaded_model(variant, **BLOCKS)
    tokens, _ = serve_rows(model)
    most = max(r.new_tokens for r in REQUESTS)
    expected = hf_greedy(variant, [r.prompt for r in REQUESTS], most)
    assert tokens == [expected[i, : r.new_tokens].tolist() for i, r in enumerate(REQUESTS)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_plan_counts_what_the_engine_loads(
    variant: str, tiny_model: Callable[[str], Any], tiny_checkpoint: Callable[..., Path]
) -> None:
    """The sharding plan `nxdi plan` sizes memory from names and shapes exactly the tensors the engine
    loads, and ModelSpec.num_params counts the checkpoint's parameters."""
    spec = families.parse_model_spec(tiny_model(variant).config.to_dict()).unwrap()
    loaded = weight_io.get_state_dict(tiny_checkpoint(variant), plan_of(spec)).unwrap()
    planned = {
        w.name.format(i=i): w.shape
        for w in sharding.shard_plan(spec, tp=1, fused_qkv=True).unwrap().weights
        for i in (range(spec.num_layers) if w.per_layer else (0,))
    }
    assert {k: tuple(v.shape) for k, v in loaded.items()} == planned
    hf = tiny_model(variant)
    assert spec.num_params() == sum({id(p): p.numel() for p in hf.parameters()}.values())


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 12, 16, 20, 32, 112])
def test_alibi_slopes_are_bloom_s(heads: int) -> None:
    mask = torch.ones(1, 3, dtype=torch.long)
    theirs = transformers.models.bloom.modeling_bloom.build_alibi_tensor(mask, heads, torch.float32)
    assert torch.equal(attention.alibi_slopes(heads), theirs[:, 0, 1])


def _refused(tmp_path: Path, variant: str, *, config: dict[str, Any] | None = None, **neuron: Any) -> str:
    """The message of the IncompatibleConfigError (or ValueError) a model of `variant` is refused with."""
    model = checkpoints.build_model(variant, **(config or {}))
    path = checkpoints.save_checkpoint(model, tmp_path / variant, checkpoints.SaveFormat.SAFETENSORS)
    with pytest.raises((IncompatibleConfigError, ValueError)) as info:
        load_model(path, variant, batch_size=1, **neuron)
    return str(info.value)


@pytest.mark.parametrize(
    ("variant", "settings", "names"),
    [
        ("bloom", {"flash_decoding_enabled": True, "tp_degree": 2}, ("flash_decoding_enabled",)),
        ("bloom", {"is_block_kv_layout": True, "pa_num_blocks": 4, "pa_block_size": 32}, ("is_block_kv_layout",)),
        ("bloom", {"tp_degree": 3}, ("tp_degree",)),
    ],
)
def test_settings_a_family_cannot_run_with_are_refused(
    variant: str, settings: dict[str, Any], names: tuple[str, ...], tmp_path: Path
) -> None:
    message = _refused(tmp_path, variant, **settings)
    assert all(name in message for name in names), message


QUANT = {"quantization_type": "per_channel_symmetric"}
STORED = {  # a linear of each layout: Conv1D [in, out], head-by-head fused QKV, GPT-J's reordered rotary rows
    "gpt2": "h.0.attn.c_attn.weight",
    "opt": "layers.0.self_attn.out_proj.weight",
    "bloom": "h.0.self_attention.query_key_value.weight",
    "gptj": "h.0.attn.q_proj.weight",
    "gpt_neox": "layers.0.attention.query_key_value.weight",
}


@pytest.mark.parametrize("variant", list(STORED))
def test_int8_weights_in_each_stored_layout_keep_the_float_models_tokens(variant: str, tmp_path: Path) -> None:
    """save_quantized_state_dict, then a model of the quantized checkpoint: its linears are stored
    int8 in the checkpoint's own layout (a Conv1D weight [in, out] with the [out, 1] scale of its
    output columns), and on a briefly trained checkpoint the teacher-forced argmax equals the float
    model's at >= 95% of 2 x 32 positions, with a logit error above 0 (it took effect) and small."""
    from nxdi.core.host.logit_validation import max_relative_logit_error
    from nxdi.testing.training import train_briefly
    from tests.support.engine_fixtures import teacher_forced

    hf = checkpoints.build_model(variant, initializer_range=0.02)
    train_briefly(hf, steps=100)
    path = checkpoints.save_checkpoint(hf, tmp_path / "float", checkpoints.SaveFormat.SAFETENSORS)
    out = tmp_path / "int8"
    out.mkdir()
    settings = dict(batch_size=2, seq_len=48, quantized=True, quantized_checkpoints_path=str(out), **QUANT)
    config = CONFIG_TYPES[variant](NeuronConfig(**settings), load_config=load_pretrained_config(path))
    MODEL_TYPES[variant]["causal-lm"].save_quantized_state_dict(path, config)
    saved = safetensors.torch.load_file(str(out / "model.safetensors"))
    source = dict(hf.state_dict())
    key = STORED[variant]
    stored = next(v for k, v in source.items() if k.endswith(key))
    values, scale = saved[key], saved[key.removesuffix("weight") + "scale"]
    assert values.dtype == torch.int8 and values.shape == stored.shape
    assert scale.shape == ((stored.shape[1], 1) if variant == "gpt2" else (stored.shape[0], 1))
    prompts = (PROMPTS[1], PROMPTS[3])
    floats = load_model(path, variant, batch_size=2, seq_len=48)
    tokens = nxdi_generate(floats, prompts, max_new_tokens=32)
    want = teacher_forced(floats, prompts, tokens[:, :-1])
    got = teacher_forced(load_model(path, variant, **settings), prompts, tokens[:, :-1])
    match = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    error = max_relative_logit_error(want, got)
    print(f"{variant} int8 per-channel: {match:.1%} teacher-forced argmax equal, max relative logit error {error:.4f}")
    assert match >= 0.95 and 0 < error < 0.05, (match, error)


@pytest.mark.parametrize("variant", ["bloom", "gptj", "gpt_neox"])
def test_blocks_along_rows_stored_in_another_order_are_refused(variant: str, tiny_model: Callable[[str], Any]) -> None:
    """A fused QKV stored head by head, or GPT-J's reordered q/k rows: row blocks would straddle
    rows the plan puts apart, so blockwise quantization must block the input axis only."""
    from nxdi.core.weight_plan import WeightQuant, weight_plan_for

    spec = families.parse_model_spec(tiny_model(variant).config.to_dict()).unwrap()
    table = families.record_for(spec.model_type).unwrap().weights
    rows = WeightQuant(type="blockwise_symmetric", block_axis=(0,), block_size=(2,))
    error = weight_plan_for(table, spec, quant=rows).failure()
    assert error.fields() == {"quantization_block_axis"} and "quantization_block_axis=[1]" in str(error), error
    columns = WeightQuant(type="blockwise_symmetric", block_axis=(1,), block_size=(2,))
    assert not isinstance(weight_plan_for(table, spec, quant=columns), Failure)


@pytest.mark.parametrize(
    ("variant", "config", "name"),
    [
        ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
        ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gptj", {"rotary_dim": 5}, "rotary_dim"),
    ],
)
def test_configs_nxdi_does_not_run_are_refused_naming_the_field(
    variant: str, config: dict[str, Any], name: str
) -> None:
    raw = checkpoints.tiny_config(variant, **config).to_dict()
    error = families.parse_model_spec(raw).failure()
    assert name in str(error), error


@pytest.mark.parametrize("variant", ["gpt2", "opt", "bloom", "gptj", "gpt_neox"])
@pytest.mark.parametrize(
    "settings",
    [
        {"lora_config": {"max_loras": 1, "target_modules": ["q_proj"]}},
        {"is_eagle_draft": True},
    ],
    ids=["lora", "eagle-draft"],
)
def test_lora_and_eagle_are_refused_naming_the_setting(
    variant: str, settings: dict[str, Any], tiny_model: Callable[[str], Any]
) -> None:
    spec = families.parse_model_spec(tiny_model(variant).config.to_dict()).unwrap()
    neuron = parse_neuron_spec(settings).unwrap().spec
    error = check_partition(spec, neuron).failure()
    assert next(iter(settings)) in str(error) and variant in str(error), error


CONFIG_CASES = [
    ("gpt2", {"scale_attn_weights": False}),
    ("opt", {"enable_bias": False, "activation_function": "gelu"}),
    ("bloom", {"n_head": 8}),
    ("gptj", {"rotary_dim": 16}),
    (
        "gpt_neox",
        {
            "attention_bias": False,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 500.0,
                "partial_rotary_factor": 1.0,
            },
        },
    ),
]


@pytest.mark.parametrize(("variant", "overrides"), CONFIG_CASES, ids=[v for v, _ in CONFIG_CASES])
def test_config_options_match_transformers(variant: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    """Options the tiny configs leave at their defaults: unscaled GPT-2 attention, a bias-free OPT,
    BLOOM with 8 heads' slopes, GPT-J rotating whole heads, GPT-NeoX with scaled full RoPE, tied."""
    hf = checkpoints.build_model(variant, **overrides)
    path = checkpoints.save_checkpoint(hf, tmp_path / variant, checkpoints.SaveFormat.SAFETENSORS)
    model = load_model(path, variant, batch_size=4, output_logits=True)
    ids, mask = padded(PROMPTS[:4], "left")
    out = model(ids, attention_mask=mask)
    for row, prompt in enumerate(PROMPTS[:4]):
        _close(out.logits[row, 0], hf_logits(hf, prompt)[-1])


def test_a_hub_style_gpt2_checkpoint_loads(
    tiny_checkpoint: Callable[..., Path], hf_greedy: Callable[..., torch.Tensor], tmp_path: Path
) -> None:
    """The hub's gpt2 checkpoint was saved from the base model: keys without `transformer.`, no
    lm_head (tied), and each layer's causal-mask buffer `h.{i}.attn.bias`, which is skipped."""
    source = tiny_checkpoint("gpt2")
    tensors = safetensors.torch.load_file(str(source / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    hub |= {f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 8, 8)) for i in range(2)}
    folder = tmp_path / "gpt2-hub"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    safetensors.torch.save_file(hub, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(folder, "gpt2", batch_size=4)
    ours = nxdi_generate(model, PROMPTS[:4], side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_greedy("gpt2", PROMPTS[:4], NEW_TOKENS))

"""Fused speculation's pure parts: the fused program with stand-in models (which tokens it emits,
what it writes in both caches, the clamp at max_length, the draft state it threads), its program
keys, the checks of a target and its draft, and FusedSpecNeuronConfig's save / load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import Tensor

import nxdi
from nxdi.core.config.fused_checks import DraftSide, check_fused_pair, draft_spec
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.families import parse_model_spec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import fused_programs
from nxdi.core.programs import fused_speculation as fused
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepSpec
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import FusedSpecNeuronConfig, InferenceConfig, load_pretrained_config
from nxdi.testing import checkpoints

V, K, MAX = 16, 4, 24
_NO_WEIGHTS = fused.FusedWeights(target=None, draft=None)
"""The stand-in models hold no weights."""


def _model(**overrides: Any) -> ModelSpec:
    return parse_model_spec(checkpoints.tiny_config("llama", num_hidden_layers=1, **overrides).to_dict()).unwrap()


def _write(cache: KVCache, ids: Tensor, positions: Tensor) -> KVCache:
    """The stand-ins' cache write: each input's token id at its position (layer 0's keys, [B, 1, T, 1])."""
    k = cache.k[0].scatter(2, positions[:, None, :, None], ids[:, None, :, None].to(cache.k[0].dtype))
    return KVCache(k=(k,), v=cache.v)


def _one_hot(tokens: Tensor) -> Tensor:
    return torch.nn.functional.one_hot(tokens, V).float() * 10.0


def _target(truth: Tensor) -> Any:
    """A target whose next token after the input at position q is truth[b, q + 1]."""

    def forward(weights: Any, cache: KVCache, x: StepInputs, **kwargs: Any) -> tuple[Tensor, KVCache, dict]:
        assert kwargs["all_logits"]
        return _one_hot(truth.gather(1, x.position_ids + 1)), _write(cache, x.input_ids, x.position_ids), {}

    return forward


def _draft(proposes: Tensor) -> Any:
    """A draft proposing proposes[b, q + 1] after position q; its state counts its steps."""

    def step(weights: Any, cache: KVCache, ids: Tensor, positions: Tensor, state: Any) -> tuple[Tensor, KVCache, Any]:
        return _one_hot(proposes.gather(1, positions + 1)), _write(cache, ids, positions), state + 1

    return step


def _spec(*, do_sample: bool = False, output_logits: bool = True) -> fused.FusedSpec:
    target = StepSpec(model=_model(), on_device_sampling=True, do_sample=do_sample, output_logits=output_logits)
    return fused.FusedSpec(target=target, draft=StepSpec(model=_model()), speculation_length=K, max_length=MAX)


def _caches(b: int) -> KVCache:
    one = KVCache(k=(torch.full((b, 1, MAX + K, 1), -7.0),), v=(torch.zeros(b, 1, MAX + K, 1),))
    return fused.join_caches(one, one)


def _run(spec: fused.FusedSpec, truth: Tensor, proposes: Tensor, cur: Tensor, at: Tensor, params: Tensor) -> Any:
    x = StepInputs(input_ids=cur, position_ids=at, last_index=torch.zeros(len(cur), dtype=torch.int64))
    uniforms = torch.full((len(cur), K), 0.5)
    return fused.fused_step(
        _target(truth), _draft(proposes), _NO_WEIGHTS, _caches(len(cur)), x, params, uniforms, spec=spec, state=0
    )


def _scenario() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row 0 agrees with the target everywhere; row 1 disagrees from its first proposal; row 2
    agrees for one proposal; row 3 agrees everywhere but sits two positions before max_length."""
    g = torch.Generator().manual_seed(0)
    truth = torch.randint(1, V, (4, MAX + K + 1), generator=g)
    proposes = truth.clone()
    proposes[1, 6] = (truth[1, 6] + 1) % V  # row 1 at 5: d_1 (for position 6) is wrong
    proposes[2, 12] = (truth[2, 12] + 1) % V  # row 2 at 10: d_2 (for position 12) is wrong
    at = torch.tensor([[5], [5], [10], [MAX - 2]])
    return truth, proposes, truth.gather(1, at), at


def test_a_fused_step_emits_the_accepted_prefix_then_the_targets_token_and_clamps_at_max_length() -> None:
    truth, proposes, cur, at = _scenario()
    out, cache = _run(_spec(), truth, proposes, cur, at, torch.ones(4, 3))
    counts = out.extras[fused.COUNTS]
    assert counts.tolist() == [K, 1, 2, 2]  # row 3: 4 accepted, clamped to MAX - p = 2
    for row, n in enumerate(counts.tolist()):
        p = int(at[row])
        assert out.tokens[row, :n].tolist() == truth[row, p + 1 : p + 1 + n].tolist(), row
        assert out.tokens[row, n:].tolist() == [-1] * (K - n), row
    assert out.logits.shape == (4, K, V) and out.extras[fused.DRAFT_LOGITS].shape == (4, K, V)
    # Both caches hold [cur, d_1 .. d_{k-1}] at p .. p+k-1 (the draft's k-th step writes d_{k-1}).
    target, draft = fused.split_caches(cache, 1)
    for row in range(4):
        p = int(at[row])
        fed = [int(cur[row]), *proposes[row, p + 1 : p + K].tolist()]
        assert target.k[0][row, 0, p : p + K, 0].tolist() == fed, row
        assert draft.k[0][row, 0, p : p + K, 0].tolist() == fed, row
        assert target.k[0][row, 0, :p, 0].eq(-7).all() and target.k[0][row, 0, p + K :, 0].eq(-7).all()


def test_the_draft_state_is_threaded_through_its_k_steps() -> None:
    truth, proposes, cur, at = _scenario()
    seen = []

    def step(weights: Any, cache: KVCache, ids: Tensor, positions: Tensor, state: Any) -> tuple[Tensor, KVCache, Any]:
        seen.append(state)
        return _draft(proposes)(weights, cache, ids, positions, state)

    x = StepInputs(input_ids=cur, position_ids=at, last_index=torch.zeros(4, dtype=torch.int64))
    fused.fused_step(
        _target(truth), step, _NO_WEIGHTS, _caches(4), x, torch.ones(4, 3), torch.rand(4, K), spec=_spec(), state=10
    )
    assert seen == [10, 11, 12, 13]


def test_sampling_at_temperature_zero_and_without_logits_gives_the_greedy_result() -> None:
    truth, proposes, cur, at = _scenario()
    greedy, _ = _run(_spec(), truth, proposes, cur, at, torch.ones(4, 3))
    zero = torch.tensor([[0.0, 1.0, 0.0]] * 4)
    sampled, _ = _run(_spec(do_sample=True, output_logits=False), truth, proposes, cur, at, zero)
    assert torch.equal(sampled.tokens, greedy.tokens)
    assert torch.equal(sampled.extras[fused.COUNTS], greedy.extras[fused.COUNTS])
    assert sampled.logits is None and fused.DRAFT_LOGITS not in sampled.extras
    assert _spec(output_logits=False).outputs(context=False) == (fused.TOKENS, fused.COUNTS)


# --- program keys ------------------------------------------------------------------------------


def _neuron_spec(**kwargs: Any) -> NeuronSpec:
    return parse_neuron_spec(kwargs).unwrap().spec


def test_fused_programs_attend_their_bucket_plus_k_slots() -> None:
    spec = _neuron_spec(
        seq_len=256,
        batch_size=2,
        speculation_length=K,
        enable_fused_speculation=True,
        on_device_sampling_config={"top_k": 1},
        enable_bucketing=True,
        context_encoding_buckets=[64, 256],
        token_generation_buckets=[128, 256],
    )
    keys = fused_programs.fused_keys(spec).unwrap()
    assert [(k.phase, k.length, k.batch, k.tokens) for k in keys] == [
        (Phase.CONTEXT, 64, 2, 64),
        (Phase.CONTEXT, 256, 2, 256),
        (Phase.FUSED_SPECULATION, 128 + K, 2, 1),
        (Phase.FUSED_SPECULATION, 256 + K, 2, 1),
    ]
    assert [fused_programs.fused_length(spec, p).unwrap() for p in (0, 127, 128, 255)] == [132, 132, 260, 260]
    assert fused_programs.cache_length(spec) == 256 + K
    assert keys[-1].name() == "fused_speculation_260"


# --- checks ------------------------------------------------------------------------------------


def test_the_pair_checks_list_every_disagreement() -> None:
    target = _neuron_spec(seq_len=64, batch_size=4, speculation_length=K, enable_fused_speculation=True)
    draft = _neuron_spec(seq_len=128, batch_size=2, speculation_length=K, enable_fused_speculation=True)
    problems = check_fused_pair(target, _model(), DraftSide(spec=draft, model=_model(vocab_size=99), path=None))
    assert [p.field for p in problems] == [
        "fused_spec_config.draft_model_path",
        "fused_spec_config.draft_config.vocab_size",
        "fused_spec_config.draft_config.neuron_config.batch_size",
        "fused_spec_config.draft_config.neuron_config.max_length",
        "fused_spec_config.draft_config.neuron_config.enable_fused_speculation",
    ]
    assert [p.field for p in check_fused_pair(target, _model(), None)] == ["fused_spec_config"]
    plain = _neuron_spec(seq_len=64)
    assert check_fused_pair(plain, _model(), None) == ()
    assert [p.field for p in check_fused_pair(plain, _model(), DraftSide(path="/d"))] == ["fused_spec_config"]


def test_draft_model_modules_to_not_convert_is_the_drafts_list_under_fused_speculation() -> None:
    quant = {"quantized": True, "quantized_checkpoints_path": "/q", "modules_to_not_convert": ["layers.3"]}
    pair = {"seq_len": 64, "speculation_length": K, **quant}
    target = _neuron_spec(**pair, enable_fused_speculation=True, draft_model_modules_to_not_convert=["lm_head"])
    copied = _neuron_spec(**pair, draft_model_modules_to_not_convert=["lm_head"])
    assert draft_spec(target, copied).modules_to_not_convert == ("lm_head",)
    assert draft_spec(attrs.evolve(target, draft_model_modules_to_not_convert=None), copied) == copied
    assert draft_spec(attrs.evolve(target, enable_fused_speculation=False), copied) == copied
    side = DraftSide(spec=copied, model=_model(), path="/d")
    assert check_fused_pair(target, _model(), side) == ()
    own = attrs.evolve(copied, modules_to_not_convert=("layers.0",))
    unquantized = attrs.evolve(copied, quantized=False, modules_to_not_convert=None)
    for draft, reason in ((own, "would replace"), (unquantized, "is not quantized")):
        (problem,) = check_fused_pair(target, _model(), DraftSide(spec=draft, model=_model(), path="/d"))
        assert problem.field == "draft_model_modules_to_not_convert" and reason in problem.reason


def test_fused_with_medusa_is_refused_when_the_config_is_made() -> None:
    with pytest.raises(IncompatibleConfigError, match=r"is_medusa=True: is a speculation mode of its own"):
        NeuronConfig(
            enable_fused_speculation=True,
            speculation_length=K,
            is_medusa=True,
            medusa_speculation_length=4,
            num_medusa_heads=2,
        )


# --- FusedSpecNeuronConfig save / load -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["qwen2", "mixtral"])
def test_a_draft_of_another_family_is_rebuilt_as_its_own_config_class(variant: str, tmp_path: Path) -> None:
    """A Llama target's draft config saved and loaded back is its family's config class (a
    MoENeuronConfig for Mixtral), not the target's."""
    from nxdi.shell.models import CONFIG_TYPES

    target_path, _ = checkpoints.build_checkpoint(tmp_path / "t", "llama", checkpoints.SaveFormat.SAFETENSORS)
    draft_path, _ = checkpoints.build_checkpoint(tmp_path / "d", variant, checkpoints.SaveFormat.SAFETENSORS)
    lm = nxdi.NeuronLlamaForCausalLM
    config = lm.get_config_cls()(NeuronConfig(), load_config=load_pretrained_config(target_path))
    draft_cls = CONFIG_TYPES[checkpoints.VARIANTS[variant][0]]
    draft = draft_cls(draft_cls.get_neuron_config_cls()(), load_config=load_pretrained_config(draft_path))
    config.fused_spec_config = FusedSpecNeuronConfig(
        lm._model_cls, draft_config=draft, draft_model_path=str(draft_path)
    )
    config.save(tmp_path / "saved")
    back = lm.get_config_cls().load(tmp_path / "saved").fused_spec_config.draft_config
    assert type(back) is draft_cls and type(back.neuron_config) is type(draft.neuron_config)
    assert back.neuron_config == draft.neuron_config and back.to_json_string() == draft.to_json_string()


def test_get_draft_neuron_class_resolves_the_named_class_or_none() -> None:
    ref = {"__module__": "nxdi.shell.models", "__name__": "NeuronQwen2ForCausalLM"}
    assert InferenceConfig.get_draft_neuron_class({"draft_model_cls": ref}) is nxdi.NeuronQwen2ForCausalLM
    assert InferenceConfig.get_draft_neuron_class({"draft_model_cls": None}) is None
    assert InferenceConfig.get_draft_neuron_class({}) is None
    with pytest.raises(ModuleNotFoundError, match="Gone"):
        InferenceConfig.get_draft_neuron_class({"draft_model_cls": {"__module__": "no.such", "__name__": "Gone"}})
    saved = FusedSpecNeuronConfig(nxdi.NeuronLlamaModel, draft_model_cls=nxdi.NeuronQwen2ForCausalLM).to_dict()
    assert InferenceConfig.get_draft_neuron_class(json.loads(json.dumps(saved))) is nxdi.NeuronQwen2ForCausalLM

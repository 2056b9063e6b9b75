"""The documented configuration API: NeuronConfig, InferenceConfig and friends, per the seeds."""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import LlamaConfig

import nxdi
from nxdi import (
    FusedSpecNeuronConfig,
    HybridShardingConfig,
    IncompatibleConfigError,
    InferenceConfig,
    LlamaInferenceConfig,
    LoraServingConfig,
    MissingAttributesError,
    MoENeuronConfig,
    NeuronConfig,
    OnDeviceSamplingConfig,
    RouterConfig,
    load_pretrained_config,
)
from nxdi.core.config.sub_specs import RouterSpec
from nxdi.shell.models import MixtralInferenceConfig


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=256,
        dtype="float32",
    ).save_pretrained(path)
    return path


def test_defaults_match_the_reference() -> None:
    c = NeuronConfig()
    assert (c.batch_size, c.seq_len, c.max_context_length, c.max_length, c.tp_degree) == (1, 128, 128, 128, 1)
    assert c.torch_dtype == torch.bfloat16 and c.padding_side == "right" and c.max_new_tokens is None
    assert c.on_device_sampling_config is None and c.enable_bucketing is False and c.buckets == [128]
    assert c.cast_type == "config" and c.quantize_clamp_bound == float("inf") and c.logical_nc_config == 1


def test_seed_examples_construct() -> None:
    assert NeuronConfig(logical_nc_config=2).logical_nc_config == 2
    assert NeuronConfig(sequence_parallel_enabled=True).sequence_parallel_enabled
    assert (
        NeuronConfig(
            on_device_sampling_config=OnDeviceSamplingConfig(global_topk=256)
        ).on_device_sampling_config.global_topk
        == 256
    )
    assert NeuronConfig(
        on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True)
    ).on_device_sampling_config.dynamic
    assert NeuronConfig(fused_qkv=True).fused_qkv
    c = NeuronConfig(
        enable_bucketing=True,
        context_encoding_buckets=[1024, 512],
        token_generation_buckets=[512, 1024, 2048],
        seq_len=2048,
        max_context_length=1024,
    )
    assert c.context_encoding_buckets == [512, 1024]
    q = NeuronConfig(
        quantized=True,
        quantized_checkpoints_path="/tmp/q",
        quantization_dtype="int8",
        quantization_type="per_channel_symmetric",
    )
    assert q.quantized and q.quantization_type == "per_channel_symmetric"
    assert NeuronConfig(kv_cache_quant=True).spec.kv_dtype == "float8_e4m3fn"


def test_speculation_example_deepcopy_and_assignment() -> None:
    target = NeuronConfig(speculation_length=5, trace_tokengen_model=False)
    draft = copy.deepcopy(target)
    draft.speculation_length = 0
    draft.trace_tokengen_model = True
    assert (target.speculation_length, target.trace_tokengen_model) == (5, False)
    assert (draft.speculation_length, draft.trace_tokengen_model) == (0, True)


def test_eagle_forces_fused_speculation() -> None:
    c = NeuronConfig(enable_eagle_speculation=True, speculation_length=5, seq_len=1024, trace_tokengen_model=False)
    assert c.enable_fused_speculation and c.kv_cache_tiling


def test_unknown_kwargs_are_errors_with_suggestions() -> None:
    with pytest.raises(IncompatibleConfigError) as info:
        NeuronConfig(batch_sise=2, tp_degre=4)
    message = str(info.value)
    assert "batch_sise" in message and "'batch_size'" in message and "'tp_degree'" in message
    assert isinstance(info.value, ValueError)


def test_every_problem_reported_with_field_value_and_fix() -> None:
    with pytest.raises(IncompatibleConfigError) as info:
        NeuronConfig(seq_len=64, max_context_length=128, cp_degree=3, tp_degree=4, quantized=True)
    message = str(info.value)
    for part in ("max_context_length=128", "max_length=64", "cp_degree=3", "quantized_checkpoints_path", "Fix:"):
        assert part in message
    assert {"max_context_length", "cp_degree", "quantized_checkpoints_path"} <= info.value.error.fields()


def test_a_value_bad_on_its_own_is_refused_at_assignment_and_changes_nothing() -> None:
    c = NeuronConfig(seq_len=256)
    with pytest.raises(IncompatibleConfigError, match=r"seq_len=-1"):
        c.seq_len = -1
    with pytest.raises(
        IncompatibleConfigError, match=r"seq_lne=128: is not a NeuronConfig attribute. Fix: did you mean 'seq_len'"
    ):
        c.seq_lne = 128
    assert c.seq_len == c.max_context_length == 256


def test_a_broken_cross_field_rule_waits_for_the_next_assignment() -> None:
    c = NeuronConfig(seq_len=256)
    c.max_context_length = 512  # beyond max_length: held, as clients set related attributes one by one
    for read in (lambda: c.max_context_length, lambda: c.spec, c.to_dict, lambda: c == NeuronConfig()):
        with pytest.raises(
            IncompatibleConfigError, match=r"(?s)after assigning max_context_length.*max_context_length=512"
        ):
            read()
    c.seq_len = 512  # mends it
    assert c.max_context_length == c.max_length == 512
    c.max_context_length = 1024
    c.tp_degree = 2  # still broken: the message names every assignment since it was consistent
    with pytest.raises(IncompatibleConfigError, match=r"after assigning max_context_length, tp_degree"):
        _ = c.spec
    c.max_context_length = 512
    assert (c.max_context_length, c.tp_degree) == (512, 2)


def test_update_checks_every_rule_at_once_and_changes_nothing_on_failure() -> None:
    c = NeuronConfig(seq_len=256)
    with pytest.raises(IncompatibleConfigError, match="max_context_length"):
        c.update(max_context_length=512)
    assert c.max_context_length == 256
    c.update(max_context_length=512, seq_len=512)
    assert c.max_context_length == 512


def test_assignment_re_derives_defaults() -> None:
    c = NeuronConfig(batch_size=1)
    c.seq_len = 512
    assert c.max_context_length == c.max_length == 512


def test_on_device_sampling_accepts_dicts_and_nested_assignment() -> None:
    c = NeuronConfig(on_device_sampling_config={"do_sample": True, "top_k": 50})
    assert isinstance(c.on_device_sampling_config, OnDeviceSamplingConfig)
    c.on_device_sampling_config.top_k = 5
    assert c.spec.on_device_sampling_config.top_k == 5
    with pytest.raises(IncompatibleConfigError, match="top_p"):
        c.on_device_sampling_config.top_p = 0.0
    with pytest.raises(IncompatibleConfigError, match="temprature"):
        OnDeviceSamplingConfig(temprature=0.5)


def test_deprecated_aliases_warn() -> None:
    with pytest.warns(DeprecationWarning, match="logical_neuron_cores"):
        c = NeuronConfig(logical_neuron_cores=2)
    assert c.logical_nc_config == 2
    with pytest.warns(DeprecationWarning):
        assert c.logical_neuron_cores == 2


def test_lnc_env_overrides_kwarg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.warns(UserWarning, match="overrides"):
        assert NeuronConfig(logical_nc_config=1).logical_nc_config == 2
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    assert NeuronConfig().logical_nc_config == 2


def test_moe_config_round_trips_normalize_flag() -> None:
    m = MoENeuronConfig(
        capacity_factor=2, glu_mlp=False, disable_normalize_top_k_affinities=True, router_act_fn="sigmoid"
    )
    assert m.capacity_factor == 2.0 and m.normalize_top_k_affinities is False and m.router_config.act_fn == "sigmoid"
    data = m.to_dict()
    from nxdi.core.config import codec

    again = MoENeuronConfig.from_spec(codec.parse_neuron_dict(data, moe=True).unwrap().spec)
    assert again == m and again.normalize_top_k_affinities is False


def test_router_config_is_an_object_as_in_the_reference(tmp_path: Path) -> None:
    # A dict (or RouterConfig) wins over the router_* kwargs; dtypes are torch dtypes or their names.
    m = MoENeuronConfig(router_config={"act_fn": "sigmoid", "dtype": torch.bfloat16}, router_act_fn="softmax")
    assert isinstance(m.router_config, RouterConfig)
    assert (m.router_config.act_fn, m.router_config.dtype) == ("sigmoid", torch.bfloat16)
    assert MoENeuronConfig(router_dtype=torch.float16).router_config.dtype == torch.float16
    given = MoENeuronConfig(router_config=RouterConfig(act_fn="sigmoid", dtype="float64"), router_dtype="float16")
    assert given.spec.moe is not None and given.spec.moe.router_config == RouterSpec(act_fn="sigmoid", dtype="float64")
    assert RouterConfig.from_kwargs(router_act_fn="sigmoid").act_fn == "sigmoid"
    m.router_config.dtype = torch.float64  # assigning through the sub-config re-validates the owner
    assert m.spec.moe is not None and m.spec.moe.router_config.dtype == "float64"
    # Saved as names and read back equal, through the documented save/load.
    hf = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    hf |= {"num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 64, "rope_theta": 1e4}
    hf |= {"rms_norm_eps": 1e-5, "hidden_act": "silu", "num_local_experts": 4, "num_experts_per_tok": 2}
    config = MixtralInferenceConfig(m, pad_token_id=0, intermediate_size=32, **hf)
    config.save(tmp_path)
    assert json.loads((tmp_path / "neuron_config.json").read_text())["neuron_config"]["router_config"] == {
        "act_fn": "sigmoid",
        "dtype": "float64",
    }
    again = MixtralInferenceConfig.load(tmp_path)
    assert again.neuron_config == m and again.neuron_config.router_config.dtype == torch.float64
    for bad, field in (
        ({"router_dtype": "int8"}, "router_config.dtype='int8'"),
        ({"router_config": {"act_fn": "relu"}}, "router_config.act_fn='relu'"),
        ({"router_config": 5}, "router_config=5: must be a RouterConfig or a dict"),
    ):
        with pytest.raises(IncompatibleConfigError, match=re.escape(field)):
            MoENeuronConfig(**bad)


def test_hybrid_sharding_config_is_an_object_as_in_the_reference(tmp_path: Path) -> None:
    """NxD's `HybridShardingConfig`: a dict or the object; the degrees are checked against tp_degree
    with the config (each phase's product), and moe_tp/ep_degree may only repeat the context pair."""
    cte_tkg = {"moe_cte_tp_degree": 2, "moe_cte_ep_degree": 1, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 2}
    m = MoENeuronConfig(tp_degree=2, hybrid_sharding_config=cte_tkg)
    assert isinstance(m.hybrid_sharding_config, HybridShardingConfig)
    assert m.hybrid_sharding_config.moe_tkg_ep_degree == 2 and m.hybrid_sharding_config.to_dict() == cte_tkg
    assert MoENeuronConfig(tp_degree=2, hybrid_sharding_config=HybridShardingConfig(**cte_tkg)) == m
    assert m.spec.moe is not None and m.spec.moe.hybrid
    assert m.spec.moe.ep_degree(token_generation=False) == 1 and m.spec.moe.ep_degree(token_generation=True) == 2
    hf = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    hf |= {"num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 64, "rope_theta": 1e4}
    hf |= {"rms_norm_eps": 1e-5, "hidden_act": "silu", "num_local_experts": 4, "num_experts_per_tok": 2}
    MixtralInferenceConfig(m, pad_token_id=0, intermediate_size=32, **hf).save(tmp_path)
    assert MixtralInferenceConfig.load(tmp_path).neuron_config == m
    for bad, field in (
        ({"tp_degree": 4, "hybrid_sharding_config": cte_tkg}, "hybrid_sharding_config.moe_cte_tp_degree=2: x"),
        ({"tp_degree": 2, "hybrid_sharding_config": cte_tkg, "moe_ep_degree": 2}, "moe_ep_degree=2: is replaced"),
        ({"hybrid_sharding_config": {"moe_cte_tp": 2}}, "hybrid_sharding_config.moe_cte_tp"),
        ({"hybrid_sharding_config": {"moe_tkg_ep_degree": 0}}, "hybrid_sharding_config.moe_tkg_ep_degree=0"),
    ):
        with pytest.raises(IncompatibleConfigError, match=re.escape(field)):
            MoENeuronConfig(**bad)
    # repeating the context-encoding pair is allowed
    assert MoENeuronConfig(tp_degree=2, hybrid_sharding_config=cte_tkg, moe_tp_degree=2).spec.moe is not None


def test_lora_serving_config_reads_paths_and_adapter_configs(tmp_path: Path) -> None:
    for name, rank, modules in (("a", 8, ["q_proj", "v_proj"]), ("b", 32, ["o_proj"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": modules}))
    lora = LoraServingConfig(max_loras=1, lora_ckpt_paths=[f"a : {tmp_path / 'a'}", f"b : {tmp_path / 'b'}"])
    assert lora.max_loras == 2 and lora.max_lora_rank == 32
    assert lora.target_modules == ["o_proj", "q_proj", "v_proj"]
    paths_file = tmp_path / "paths.json"
    paths_file.write_text(json.dumps({"lora-ckpt-dir": str(tmp_path), "lora-ckpt-paths": {"x": "a"}}))
    assert LoraServingConfig(lora_ckpt_json=str(paths_file)).lora_ckpt_paths == {"x": str(tmp_path / "a")}
    with pytest.raises(FileNotFoundError, match="missing"):
        LoraServingConfig(lora_ckpt_paths={"m": str(tmp_path / "missing")})
    with pytest.raises(IncompatibleConfigError, match="duplicate"):
        LoraServingConfig(lora_ckpt_paths=[f"a : {tmp_path / 'a'}", f"a : {tmp_path / 'b'}"])
    assert NeuronConfig(lora_config=lora).lora_config == lora


def test_load_pretrained_config_dtype_rules(llama_dir: Path) -> None:
    cfg = LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(llama_dir))
    assert cfg.neuron_config.torch_dtype == torch.float32 and not hasattr(cfg, "torch_dtype")
    pinned = LlamaInferenceConfig(
        NeuronConfig(torch_dtype=torch.bfloat16), load_config=load_pretrained_config(llama_dir)
    )
    assert pinned.neuron_config.torch_dtype == torch.bfloat16
    assert cfg.hidden_size == 64 and cfg.rope_theta == 10000.0 and cfg.model_spec().num_kv_heads == 2
    with pytest.raises(ValueError, match="only one of"):
        load_pretrained_config(llama_dir, hf_config=LlamaConfig())
    with pytest.raises(ValueError, match="only one of"):
        load_pretrained_config()


def test_checkpoint_path_is_recorded_absolute(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(llama_dir.parent)
    cfg = LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(llama_dir.name))
    assert cfg._name_or_path == str(llama_dir.resolve())


def test_kwargs_override_loaded_values(llama_dir: Path) -> None:
    cfg = LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(llama_dir), vocab_size=300)
    assert cfg.vocab_size == 300


def test_save_load_round_trip_is_identical(tmp_path: Path, llama_dir: Path) -> None:
    nc = NeuronConfig(
        batch_size=2,
        seq_len=64,
        max_context_length=32,
        enable_bucketing=True,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
    )
    cfg = LlamaInferenceConfig(nc, load_config=load_pretrained_config(llama_dir))
    cfg.save(tmp_path)
    text = (tmp_path / "neuron_config.json").read_text()
    assert text.endswith("}\n") and "Infinity" not in text
    loaded = LlamaInferenceConfig.load(tmp_path)
    assert loaded.to_json_string() + "\n" == text
    assert loaded.neuron_config == cfg.neuron_config
    assert cfg.to_json_string() == cfg.to_json_string()
    data = json.loads(text)
    assert "torch_dtype" not in data and data["neuron_config"]["torch_dtype"] == "float32"
    assert data["neuron_config"]["buckets"] == [64] and data["num_cores_per_group"] == 1
    assert LlamaInferenceConfig.load(tmp_path, batch_size=3).batch_size == 3  # kwargs override on load


def test_reads_a_reference_layout_file(tmp_path: Path) -> None:
    """A neuron_config.json as the reference writes it: Infinity, derived keys, HF keys at top level."""
    ref = {
        "_name_or_path": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        "architectures": ["LlamaForCausalLM"],
        "attribute_map": {},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "fused_spec_config": None,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "max_position_embeddings": 2048,
        "metadata": None,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_cores_per_group": 1,
        "num_hidden_layers": 22,
        "num_key_value_heads": 4,
        "pad_token_id": None,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.45.2",
        "vocab_size": 32000,
        "neuron_config": {
            "batch_size": 1,
            "buckets": [128],
            "enable_bucketing": False,
            "enable_long_context_mode": False,
            "is_prefill_stage": None,
            "kv_cache_tiling": False,
            "max_context_length": 128,
            "max_length": 128,
            "on_device_sampling_config": {
                "do_sample": False,
                "dynamic": False,
                "deterministic": False,
                "global_topk": 256,
                "on_device_sampling_config": True,
                "top_k": 1,
                "top_p": 1.0,
                "temperature": 1.0,
                "top_k_kernel_enabled": False,
            },
            "quantize_clamp_bound": float("inf"),
            "seq_len": 128,
            "tile_cc": False,
            "torch_dtype": "bfloat16",
            "tp_degree": 2,
            "world_size": 2,
            "lm_head_pad": False,
            "is_chunked_prefill": False,
        },
    }
    text = json.dumps(ref, indent=2)
    assert "Infinity" in text
    (tmp_path / "neuron_config.json").write_text(text)
    cfg = LlamaInferenceConfig.load(tmp_path)
    assert cfg.neuron_config.tp_degree == 2 and cfg.neuron_config.quantize_clamp_bound == float("inf")
    assert cfg.neuron_config.on_device_sampling_config.top_k == 1 and cfg.hidden_size == 2048
    assert '"quantize_clamp_bound": "inf"' in cfg.to_json_string()


def test_missing_required_attributes_listed() -> None:
    with pytest.raises(MissingAttributesError) as info:
        LlamaInferenceConfig(NeuronConfig(), hidden_size=64)
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)
    assert "num_attention_heads" in str(info.value) and "rms_norm_eps" in str(info.value)


def test_inconsistent_model_attributes_raise() -> None:
    attrs = dict(
        hidden_size=64,
        num_attention_heads=5,
        num_hidden_layers=2,
        num_key_value_heads=2,
        pad_token_id=None,
        vocab_size=256,
        max_position_embeddings=128,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        intermediate_size=128,
    )
    with pytest.raises(IncompatibleConfigError, match="num_key_value_heads"):
        LlamaInferenceConfig(NeuronConfig(), **attrs)


def test_attribute_map_aliases() -> None:
    class Aliased(InferenceConfig):
        attribute_map: ClassVar[dict[str, str]] = {"n_embd": "hidden_size"}

    cfg = Aliased(NeuronConfig(), hidden_size=8)
    assert cfg.n_embd == 8
    cfg.n_embd = 16
    assert cfg.hidden_size == 16


def test_fused_spec_config_round_trip(tmp_path: Path) -> None:
    draft = InferenceConfig(NeuronConfig(), hidden_size=4)
    cfg = InferenceConfig(
        NeuronConfig(),
        fused_spec_config=FusedSpecNeuronConfig(InferenceConfig, draft_config=draft, draft_model_path="/d"),
        hidden_size=8,
    )
    cfg.save(tmp_path)
    loaded = InferenceConfig.load(tmp_path)
    assert loaded.fused_spec_config.worker_cls is InferenceConfig
    assert loaded.fused_spec_config.draft_config.hidden_size == 4
    data = json.loads((tmp_path / "neuron_config.json").read_text())
    data["fused_spec_config"]["worker_cls"] = {"__module__": "no.such.module", "__name__": "Gone"}
    with pytest.raises(ModuleNotFoundError, match="Gone"):
        InferenceConfig.from_json_string(json.dumps(data))


def test_load_without_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        InferenceConfig.load(tmp_path)


def test_bad_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "neuron_config.json").write_text("{ not json")
    with pytest.raises(IncompatibleConfigError, match=r"neuron_config\.json"):
        InferenceConfig.load(tmp_path)


def test_documented_classes_importable_from_nxdi_and_shell() -> None:
    from nxdi.shell import config, inference_config, models

    assert nxdi.NeuronConfig is config.NeuronConfig and nxdi.InferenceConfig is inference_config.InferenceConfig
    assert nxdi.LlamaInferenceConfig is models.LlamaInferenceConfig
    for name in nxdi.__all__:
        assert getattr(nxdi, name) is not None


def test_family_classes_are_ordinary_classes_that_serialize_by_reference() -> None:
    import pickle

    from nxdi.shell import models
    from nxdi.shell.inference_config import FusedSpecNeuronConfig

    cls = nxdi.NeuronLlamaForCausalLM
    assert (cls.__module__, cls.__qualname__) == ("nxdi.shell.models", "NeuronLlamaForCausalLM")
    assert pickle.loads(pickle.dumps(cls)) is cls and models.NeuronLlamaForCausalLM is cls
    assert cls.__mro__[1] is nxdi.NeuronBaseForCausalLM  # one level below the documented base
    assert (
        issubclass(nxdi.MixtralNeuronConfig, nxdi.MoENeuronConfig) and nxdi.LlamaNeuronConfig.__mro__[1] is NeuronConfig
    )
    ref = FusedSpecNeuronConfig(cls, draft_model_cls=cls).to_dict()["draft_model_cls"]
    assert ref == {"__module__": "nxdi.shell.models", "__name__": "NeuronLlamaForCausalLM"}
    assert FusedSpecNeuronConfig.from_dict({"worker_cls": ref}, nxdi.InferenceConfig).worker_cls is cls


def test_settings_without_effect_on_the_cpu_are_found_from_their_declarations() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = NeuronConfig(fused_qkv=True, qkv_kernel_enabled=True, mlp_kernel_enabled=True, seq_len=64)
    assert config._without_effect_on_cpu() == ("qkv_kernel_enabled", "mlp_kernel_enabled")
    # derived defaults (n_active_tokens = seq_len, ...) are not "set", nor is anything of a reloaded config
    assert NeuronConfig(seq_len=64, batch_size=4)._without_effect_on_cpu() == ()
    assert NeuronConfig.from_spec(NeuronConfig(seq_len=64).spec)._without_effect_on_cpu() == ()
    ods = NeuronConfig(on_device_sampling_config={"top_k_kernel_enabled": True, "sampling_dp_degree": 2})
    assert ods._without_effect_on_cpu() == (
        "on_device_sampling_config.sampling_dp_degree",
        "on_device_sampling_config.top_k_kernel_enabled",
    )


def test_tensor_parallel_settings_have_effect_only_with_several_ranks() -> None:
    tp_only = {"vocab_parallel": True, "sequence_parallel_enabled": True, "rpl_reduce_dtype": "bfloat16"}
    at_one = NeuronConfig(seq_len=64, flash_decoding_enabled=True, **tp_only)._without_effect_on_cpu()
    assert set(at_one) == {*tp_only, "flash_decoding_enabled"}
    assert NeuronConfig(seq_len=64, tp_degree=4, flash_decoding_enabled=True, **tp_only)._without_effect_on_cpu() == ()

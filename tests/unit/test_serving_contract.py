"""What a serving client (vLLM's Neuron plugin) does with a model class before it runs it.

The class-level hooks (`get_neuron_config_cls`, `get_config_cls`, `_model_cls`), the client's
NeuronConfig dict with its `override_neuron_config` applied, assignments to a loaded config,
`get_text_config()` and the checkpoint's `transformers_version`.
"""

from __future__ import annotations

import copy
import json
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers

import nxdi
from nxdi import (
    FusedSpecNeuronConfig,
    IncompatibleConfigError,
    InferenceConfig,
    MoENeuronConfig,
    NeuronConfig,
    load_pretrained_config,
)
from nxdi.core import families
from nxdi.core.families.record import FamilyRecord
from nxdi.shell import models
from nxdi.shell.inner_model import NeuronBaseModel
from nxdi.testing import checkpoints
from tests.support.serving_client import apply_overrides, client_defaults

WITH_CLASSES = tuple(r for r in families.RECORDS if r.classes is not None)
RUNNABLE = families.runnable()
OLD_VERSION = "4.43.0.dev0"
"""A transformers version other than the installed one, as a checkpoint's config.json records it."""


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings without effect on the CPU warn; not the point here
        yield


def hf_folder(tmp_path: Path, variant: str = "llama", version: str | None = OLD_VERSION) -> Path:
    """A folder holding only the tiny config.json of `variant`, recording transformers `version`."""
    folder = tmp_path / variant
    checkpoints.tiny_config(variant).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    if version is None:
        data.pop("transformers_version", None)
    else:
        data["transformers_version"] = version
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _expected_neuron_config_cls(record: FamilyRecord) -> type[NeuronConfig]:
    names = record.classes
    assert names is not None
    if names.neuron_config is not None:
        return getattr(models, names.neuron_config)  # type: ignore[no-any-return]
    return MoENeuronConfig if record.moe else NeuronConfig


# --- class-level hooks --------------------------------------------------------------------------


@pytest.mark.parametrize("record", WITH_CLASSES, ids=[r.name for r in WITH_CLASSES])
def test_every_family_names_its_neuron_config_class(record: FamilyRecord) -> None:
    names = record.classes
    assert names is not None
    expected = _expected_neuron_config_cls(record)
    config_cls = getattr(models, names.inference_config)
    assert config_cls.get_neuron_config_cls() is expected
    assert issubclass(expected, MoENeuronConfig) == record.moe
    if names.causal_lm is not None:
        lm = getattr(models, names.causal_lm)
        assert lm.get_config_cls() is config_cls and lm.get_neuron_config_cls() is expected
        derived = f"Neuron{names.causal_lm[6:-11]}Model"  # NeuronLlamaModel; Gemma3's is NxDI's NeuronGemma3TextModel
        assert lm._model_cls is getattr(nxdi, names.inner_model or derived)
        assert issubclass(lm._model_cls, NeuronBaseModel) and lm._model_cls._family is record


def test_base_classes_hooks_and_a_custom_subclass() -> None:
    assert nxdi.NeuronBaseForCausalLM.get_neuron_config_cls() is NeuronConfig
    assert nxdi.NeuronBaseForCausalLM._model_cls is NeuronBaseModel

    class MyNeuronConfig(NeuronConfig):
        pass

    class MyConfig(InferenceConfig):
        @classmethod
        def get_neuron_config_cls(cls) -> type[NeuronConfig]:
            return MyNeuronConfig

    class MyModel(nxdi.NeuronBaseForCausalLM):
        @classmethod
        def get_config_cls(cls) -> type[InferenceConfig]:
            return MyConfig

    assert MyModel.get_neuron_config_cls() is MyNeuronConfig  # follows the config class, as NxDI's does


@pytest.mark.parametrize("record", RUNNABLE, ids=[r.name for r in RUNNABLE])
def test_client_builds_every_family_config_through_the_hooks(tmp_path: Path, record: FamilyRecord) -> None:
    assert record.classes is not None and record.classes.causal_lm is not None
    lm = getattr(nxdi, record.classes.causal_lm)
    folder = hf_folder(tmp_path, record.name)
    neuron_config = lm.get_neuron_config_cls()(**client_defaults())
    config = lm.get_config_cls()(neuron_config, load_config=load_pretrained_config(folder))
    assert type(neuron_config) is _expected_neuron_config_cls(record) and config.neuron_config is neuron_config
    assert config.get_text_config() is config
    assert config.get_text_config().vocab_size == checkpoints.tiny_config(record.name).vocab_size
    inner = lm._model_cls(config)
    assert inner.config is config and inner.program.record is record and inner.model_spec == config.model_spec()


def test_a_family_inner_model_refuses_another_family(tmp_path: Path) -> None:
    config = nxdi.MistralInferenceConfig(
        NeuronConfig(), load_config=load_pretrained_config(hf_folder(tmp_path, "mistral"))
    )
    assert NeuronBaseModel(config).program.record.name == "mistral"  # the base takes any family
    with pytest.raises(IncompatibleConfigError, match=r"model_type='mistral'.*not a llama model"):
        nxdi.NeuronLlamaModel(config)


def test_model_cls_as_fused_spec_worker_survives_save_and_load(tmp_path: Path) -> None:
    lm = nxdi.NeuronLlamaForCausalLM
    folder = hf_folder(tmp_path)
    config = lm.get_config_cls()(NeuronConfig(), load_config=load_pretrained_config(folder))
    draft = lm.get_config_cls()(copy.deepcopy(config.neuron_config), load_config=load_pretrained_config(folder))
    config.fused_spec_config = FusedSpecNeuronConfig(lm._model_cls, draft_config=draft, draft_model_path=str(folder))
    config.save(tmp_path / "saved")
    back = lm.get_config_cls().load(tmp_path / "saved").fused_spec_config
    assert back.worker_cls is nxdi.NeuronLlamaModel and back.draft_model_path == str(folder)
    assert back.draft_config.neuron_config == draft.neuron_config


def test_client_fused_speculation_draft_assignments_in_their_order() -> None:
    target = NeuronConfig(**{**client_defaults(), "enable_fused_speculation": True, "speculation_length": 4})
    draft = copy.deepcopy(target)
    draft.speculation_length = 0  # vLLM Neuron's `_init_fused_spec_config`, in its order: a rule
    draft.enable_fused_speculation = False  # is broken in between, and mended here
    assert not draft.enable_fused_speculation and draft.speculation_length == 0
    assert target.enable_fused_speculation and target.speculation_length == 4  # the copy is its own


def test_a_config_left_inconsistent_is_refused_at_use(tmp_path: Path) -> None:
    lm = nxdi.NeuronLlamaForCausalLM
    neuron = lm.get_neuron_config_cls()(**{**client_defaults(), "enable_fused_speculation": False})
    neuron.enable_fused_speculation = True  # without speculation_length > 0
    with pytest.raises(IncompatibleConfigError, match=r"(?s)enable_fused_speculation.*speculation_length=0"):
        lm.get_config_cls()(neuron, load_config=load_pretrained_config(hf_folder(tmp_path)))


# --- the client's NeuronConfig dict and override_neuron_config ---------------------------------------


def test_client_default_dict_constructs_and_is_not_modified() -> None:
    given = client_defaults()
    before = dict(given)
    config = nxdi.NeuronLlamaForCausalLM.get_neuron_config_cls()(**given)
    assert given == before and all(given[k] is before[k] for k in given)  # the client reuses its dict
    assert (config.batch_size, config.seq_len, config.pa_num_blocks, config.pa_block_size) == (4, 64, 16, 16)
    assert config.is_continuous_batching and config.lora_config is None and not config.is_block_kv_layout
    ods = config.on_device_sampling_config
    assert ods.dynamic and not ods.deterministic and ods == given["on_device_sampling_config"]


def test_override_neuron_config_keys_win_over_the_defaults() -> None:
    override = {
        "chunked_prefill_config": {"max_num_seqs": 4, "kernel_q_tile_size": 64},
        "is_block_kv_layout": True,
        "batch_size": 1,
        "is_continuous_batching": False,
        "on_device_sampling_config": {"global_topk": 64, "dynamic": True},
        "quantized": False,
    }
    merged = apply_overrides(client_defaults(), override)
    config = NeuronConfig(**merged)
    assert config.is_chunked_prefill and config.chunked_prefill_config.kernel_q_tile_size == 64
    assert config.chunked_prefill_config.max_num_seqs == 4 and config.is_block_kv_layout and config.batch_size == 1
    assert config.on_device_sampling_config.global_topk == 64 and config.quantization_dtype == "int8"


def test_override_neuron_config_errors_name_every_bad_key() -> None:
    merged = apply_overrides(client_defaults(), {"pa_block_sise": 32, "batch_size": 0})
    with pytest.raises(IncompatibleConfigError) as caught:
        NeuronConfig(**merged)
    assert "pa_block_sise" in str(caught.value) and "did you mean" in str(caught.value)
    assert "batch_size" in str(caught.value)


def test_assignments_to_a_loaded_config_before_load_are_validated(tmp_path: Path) -> None:
    lm = nxdi.NeuronLlamaForCausalLM
    config = lm.get_config_cls()(
        lm.get_neuron_config_cls()(**client_defaults()), load_config=load_pretrained_config(hf_folder(tmp_path))
    )
    config.save(tmp_path / "compiled")
    loaded = lm.get_config_cls().load(tmp_path / "compiled")
    assert loaded.neuron_config == config.neuron_config
    loaded.neuron_config.skip_warmup = True
    loaded.neuron_config.on_device_sampling_config.global_topk = 32  # a sub-config assignment reaches its owner
    assert loaded.neuron_config.skip_warmup and loaded.neuron_config.spec.on_device_sampling_config.global_topk == 32
    with pytest.raises(IncompatibleConfigError, match="pa_block_size"):
        loaded.neuron_config.pa_block_size = 0
    assert loaded.neuron_config.pa_block_size == 16  # unchanged
    loaded.neuron_config.max_context_length = 4096  # beyond seq_len: a cross-field rule, held until mended
    with pytest.raises(IncompatibleConfigError, match=r"max_context_length=4096"):
        _ = loaded.neuron_config.max_context_length
    loaded.neuron_config.max_context_length = 64
    assert loaded.neuron_config.max_context_length == 64


# --- get_text_config and transformers_version -----------------------------------------------------


def test_get_text_config_returns_the_text_config_when_there_is_one() -> None:
    text = types.SimpleNamespace(vocab_size=7)
    assert InferenceConfig(NeuronConfig(), text_config=text).get_text_config() is text
    plain = InferenceConfig(NeuronConfig(), text_config=None)
    assert plain.get_text_config() is plain


def test_transformers_version_is_the_checkpoint_s_through_save_and_load(tmp_path: Path) -> None:
    assert transformers.__version__ != OLD_VERSION
    config = nxdi.LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(hf_folder(tmp_path)))
    assert config.transformers_version == OLD_VERSION
    config.save(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "neuron_config.json").read_text())["transformers_version"] == OLD_VERSION
    assert nxdi.LlamaInferenceConfig.load(tmp_path / "saved").transformers_version == OLD_VERSION


def test_transformers_version_without_one_in_the_checkpoint(tmp_path: Path) -> None:
    # Nothing recorded (an in-memory config, or a config.json without the key): the installed version.
    folder = hf_folder(tmp_path, version=None)
    from_file = nxdi.LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(folder))
    hf = transformers.AutoConfig.from_pretrained(folder)
    in_memory = nxdi.LlamaInferenceConfig(NeuronConfig(), load_config=load_pretrained_config(hf_config=hf))
    assert from_file.transformers_version == in_memory.transformers_version == transformers.__version__

"""A bad config.json fails with the documented IncompatibleConfigError naming the file and every field,
not transformers' own exceptions; compile() refuses what load() would refuse (NaN, infinite or
non-positive float fields), before writing anything; the user's files stay byte-identical."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nxdi.core.config import codec
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import ArtifactIntegrityError, IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM
from tests.support.user_files import broken_copy, snapshot

Edit = Callable[[dict[str, Any]], None]


def _set(**values: Any) -> Edit:
    return lambda d: d.update(values)


def _drop(key: str) -> Edit:
    return lambda d: d.pop(key)


def _rope(**values: Any) -> Edit:
    return lambda d: d["rope_parameters"].update(values)


def _config(model: Path) -> LlamaInferenceConfig:
    return LlamaInferenceConfig(NeuronConfig(torch_dtype="float32"), load_config=load_pretrained_config(model))


@pytest.mark.parametrize(
    ("edit", "fields"),
    [
        (_set(hidden_size="64"), {"hidden_size"}),
        (_set(num_attention_heads=5), {"num_key_value_heads", "config.json"}),
        (_drop("model_type"), {"model_type"}),
        (_set(initializer_range="abc"), {"initializer_range"}),
    ],
    ids=["string-size", "heads-do-not-divide", "no-model-type", "transformers-only-field"],
)
def test_config_json_refused_by_transformers_is_an_incompatible_config_error(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, edit: Edit, fields: set[str]
) -> None:
    model = broken_copy(tiny_checkpoint("llama"), tmp_path / "m", edit)
    before = snapshot(model)
    with pytest.raises(IncompatibleConfigError) as info:
        _config(model)
    assert isinstance(info.value, ValueError) and info.value.error is not None
    assert f"Invalid {model / 'config.json'}" in str(info.value)
    assert fields <= info.value.error.fields(), str(info.value)
    assert snapshot(model) == before


def test_invalid_json_names_the_file_line_and_column(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = broken_copy(
        tiny_checkpoint("llama"), tmp_path / "m", text='{"model_type": "llama",\n  "hidden_size": 64,,}'
    )
    before = snapshot(model)
    with pytest.raises(IncompatibleConfigError, match=r"config\.json='line 2 column 21': is not valid JSON"):
        _config(model)
    assert snapshot(model) == before


def test_a_missing_config_json_is_file_not_found(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = broken_copy(tiny_checkpoint("llama"), tmp_path / "m")
    (model / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        _config(model)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set(rms_norm_eps=math.nan), "rms_norm_eps"),
        (_set(rms_norm_eps=math.inf), "rms_norm_eps"),
        (_set(rms_norm_eps=-math.inf), "rms_norm_eps"),
        (_set(rms_norm_eps=-1e-6), "rms_norm_eps"),
        (_set(rms_norm_eps=0.0), "rms_norm_eps"),
        (_rope(rope_theta=math.inf), "rope_parameters.rope_theta"),
        (_rope(rope_theta=math.nan), "rope_parameters.rope_theta"),
        (_rope(rope_type="linear", factor=math.nan), "rope_parameters.factor"),
        (_rope(rope_type="yarn", factor=2.0, attention_factor=-1.0), "rope_parameters.attention_factor"),
    ],
    ids=lambda v: repr(v) if isinstance(v, str) else None,
)
def test_compile_refuses_what_load_refuses_before_writing_anything(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, edit: Edit, field: str
) -> None:
    source = tiny_checkpoint("llama")
    model = broken_copy(source, tmp_path / "m", edit)
    before = snapshot(model)
    with pytest.raises(IncompatibleConfigError) as compiling:  # compile() needs the config first
        _config(model)
    assert compiling.value.error is not None and field in compiling.value.error.fields(), str(compiling.value)
    # The same values in a folder's neuron_config.json, as load() reads it: the same problems.
    saved = _config(source).to_dict()
    edit(saved)
    text = codec.dumps(saved)
    with pytest.raises(IncompatibleConfigError) as loading:
        LlamaInferenceConfig.from_json_string(text)
    assert loading.value.error == compiling.value.error
    assert snapshot(model) == before


def test_a_folder_compiled_before_the_check_is_refused_by_load_alike(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_checkpoint("llama")
    model = NeuronLlamaForCausalLM(source, _config(source))
    model.compile(tmp_path / "c")
    saved = tmp_path / "c" / "neuron_config.json"
    saved.write_text(saved.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": "nan"'))
    # The folder is refused as a whole (ArtifactIntegrityError), for the problem compile() now reports.
    with pytest.raises((IncompatibleConfigError, ArtifactIntegrityError), match="rms_norm_eps='nan': must be a finite"):
        NeuronLlamaForCausalLM(tmp_path / "c")

"""The `nxdi-compat` distribution: every path a serving client imports, and a module per family."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import re
from pathlib import Path

import pytest

import nxdi
from nxdi.core import families
from nxdi.core.families.record import FamilyRecord
from nxdi.shell import (
    accuracy,
    application,
    causal_lm,
    config,
    exceptions,
    generation,
    inference_config,
    inner_model,
    lora_serving,
    models,
    sampling_inputs,
    tensor_padding,
)
from tests.support.compat_fixtures import CLIENT_IMPORTS, PACKAGE, TNX_PACKAGE

WITH_CLASSES = tuple(r for r in families.RECORDS if r.classes is not None)

SHELL_MODULES = (
    accuracy,
    application,
    causal_lm,
    config,
    exceptions,
    generation,
    inference_config,
    inner_model,
    lora_serving,
    models,
    sampling_inputs,
    tensor_padding,
)


def _family_names(record: FamilyRecord) -> list[str]:
    names = record.classes
    assert names is not None
    return sorted(n for n in (names.inference_config, names.neuron_config, names.causal_lm, names.model) if n)


def _shell_object(name: str) -> object:
    """The nxdi object a compat name must be: nxdi's export, else the shell module defining it."""
    if name in nxdi.__all__:
        return getattr(nxdi, name)
    found = [getattr(m, name) for m in SHELL_MODULES if name in vars(m)]
    assert found, f"{name} is not defined in nxdi's shell"
    return found[0]


def test_compat_is_its_own_distribution_depending_on_nxdi(compat_package: Path) -> None:
    """Not installed by default: nxdi's distribution packages only `nxdi*`; compat's depends on nxdi."""
    tomllib = pytest.importorskip("tomllib")
    ours = tomllib.loads((compat_package.parent / "pyproject.toml").read_text())
    for package in (PACKAGE, TNX_PACKAGE):
        assert not any(fnmatch.fnmatch(package, p) for p in ours["tool"]["setuptools"]["packages"]["find"]["include"])
    theirs = tomllib.loads((compat_package / "pyproject.toml").read_text())
    assert theirs["project"]["dependencies"] == ["nxdi"]
    assert theirs["tool"]["setuptools"]["packages"]["find"]["include"] == [f"{PACKAGE}*", f"{TNX_PACKAGE}*"]


@pytest.mark.parametrize(("module", "names"), CLIENT_IMPORTS, ids=[m for m, _ in CLIENT_IMPORTS])
def test_every_client_import_resolves_to_nxdi(compat_package: Path, module: str, names: tuple[str, ...]) -> None:
    imported = importlib.import_module(module)
    assert Path(imported.__file__).is_relative_to(compat_package)  # ours, not another install
    for name in names:
        assert getattr(imported, name) is _shell_object(name), f"{module}.{name}"


def test_client_model_lookup_finds_every_causal_lm(compat_package: Path) -> None:
    """vLLM's `_get_neuron_model_cls`: the HF architecture `<Model>For<Task>` -> MODEL_TYPES[model.lower()][kebab(task)]."""
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    for record in families.runnable():
        assert record.classes is not None and record.classes.causal_lm is not None
        architecture = record.classes.causal_lm.removeprefix("Neuron")  # LlamaForCausalLM, the HF name
        model, task = architecture.split("For", 1)
        kebab = re.sub("([a-z0-9])([A-Z])", r"\1-\2", re.sub("(.)([A-Z][a-z]+)", r"\1-\2", task)).lower()
        model = {"qwen3moe": "qwen3_moe"}.get(model.lower(), model.lower())  # the client's one special case
        assert MODEL_TYPES[model][kebab] is getattr(nxdi, record.classes.causal_lm)


@pytest.mark.parametrize("record", WITH_CLASSES, ids=[r.name for r in WITH_CLASSES])
def test_every_family_with_classes_has_its_modeling_module(compat_package: Path, record: FamilyRecord) -> None:
    path = compat_package / PACKAGE / "models" / record.name / f"modeling_{record.name}.py"
    names = _family_names(record)
    expected = (
        f'"""NxDI\'s `models.{record.name}.modeling_{record.name}`: nxdi\'s {record.name} classes '
        f'(`nxdi.shell.models`)."""\n\nfrom nxdi.shell.models import {", ".join(names)}\n\n__all__ = {names!r}\n'
    ).replace("'", '"')
    assert path.is_file() and (path.parent / "__init__.py").is_file(), f"write {path} (and __init__.py):\n{expected}"
    module = importlib.import_module(f"{PACKAGE}.models.{record.name}.modeling_{record.name}")
    assert sorted(module.__all__) == names, f"{path} should read:\n{expected}"
    for name in names:
        assert getattr(module, name) is getattr(models, name)


def test_no_modeling_module_without_a_family(compat_package: Path) -> None:
    shipped = {
        p.name for p in (compat_package / PACKAGE / "models").iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    assert shipped == {r.name for r in WITH_CLASSES}


def test_bases_and_other_reference_paths(compat_package: Path) -> None:
    from neuronx_distributed_inference.models.application_base import NeuronApplicationBase
    from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig, to_torch_dtype
    from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel
    from neuronx_distributed_inference.modules.generation.sampling import (
        infer_sampling_params,
        validate_sampling_params,
    )
    from neuronx_distributed_inference.modules.padding import unpad_tensor
    from neuronx_distributed_inference.utils.accuracy import check_accuracy_logits
    from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter

    assert NeuronApplicationBase is nxdi.NeuronApplicationBase and NeuronBaseForCausalLM is nxdi.NeuronBaseForCausalLM
    assert NeuronBaseModel is inner_model.NeuronBaseModel and InferenceConfig is nxdi.InferenceConfig
    assert MoENeuronConfig is nxdi.MoENeuronConfig and to_torch_dtype is config.to_torch_dtype
    assert validate_sampling_params is sampling_inputs.validate_sampling_params
    assert infer_sampling_params is sampling_inputs.infer_sampling_params
    assert unpad_tensor is tensor_padding.unpad_tensor and check_accuracy_logits is nxdi.check_accuracy_logits
    assert HuggingFaceGenerationAdapter is nxdi.HuggingFaceGenerationAdapter


def test_compat_modules_only_re_export(compat_package: Path) -> None:
    """No logic in the compat package: docstrings, imports from nxdi and `__all__` only."""
    for path in sorted([*(compat_package / PACKAGE).rglob("*.py"), *(compat_package / TNX_PACKAGE).rglob("*.py")]):
        for node in ast.parse(path.read_text()).body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            nxdi_import = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nxdi.")
            all_list = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
            assert docstring or nxdi_import or all_list, f"{path}:{node.lineno}: {ast.unparse(node)[:80]}"


def test_transformers_neuronx_paths_resolve_to_nxdi_shell_tnx(compat_package: Path) -> None:
    """The guide's imports: `transformers_neuronx`, `.config`, `.stopping_criteria`, `.speculation`."""
    import transformers_neuronx
    from transformers_neuronx import config as tnx_config
    from transformers_neuronx.speculation import SpeculativeGenerator
    from transformers_neuronx.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    from nxdi.shell import tnx
    from nxdi.shell.tnx import speculation, stopping_criteria

    assert Path(transformers_neuronx.__file__).is_relative_to(compat_package)
    for name in transformers_neuronx.__all__:
        assert getattr(transformers_neuronx, name) is getattr(tnx, name), name
    for name in tnx_config.__all__:
        assert getattr(tnx_config, name) is getattr(tnx, name), name
    assert SpeculativeGenerator is speculation.SpeculativeGenerator
    assert (StoppingCriteria, StoppingCriteriaList) == (
        stopping_criteria.StoppingCriteria,
        stopping_criteria.StoppingCriteriaList,
    )
    declared = {n for r in families.RECORDS if r.classes is not None for n in r.classes.tnx}
    assert declared <= set(transformers_neuronx.__all__)  # a record's tnx class is importable by its guide path

"""The documented model classes and MODEL_TYPES, made from the family records on first use.

For every family record (`nxdi.core.families`) with shell class names, this module provides its
`<Family>InferenceConfig` (required and derived attributes from the record), its documented
NeuronConfig subclass if any (`LlamaNeuronConfig`, `MixtralNeuronConfig`, ...), and, for families
the engine runs, `Neuron<Family>ForCausalLM` and its inner model `Neuron<Family>Model` (its
`_model_cls`, `nxdi.shell.inner_model`). They are ordinary classes one level below the
documented bases, built on first attribute access (importing this module does no work), with this
module as their `__module__`, so they pickle and serialize by reference like hand-written ones.
Adding a family adds its classes here without touching this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nxdi.core import families
from nxdi.core.families.record import FamilyRecord
from nxdi.shell import hf_configs
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.config import MoENeuronConfig, NeuronConfig
from nxdi.shell.inference_config import InferenceConfig
from nxdi.shell.inner_model import NeuronBaseModel

_built: dict[str, Any] = {}


def _make(name: str, base: type, doc: str, **namespace: Any) -> type:
    cls = type(name, (base,), {"__module__": __name__, "__qualname__": name, "__doc__": doc, **namespace})
    _built[name] = cls
    return cls


def _build(record: FamilyRecord) -> None:
    """Make the classes of one family (they refer to each other, so they are made together)."""
    names = record.classes
    assert names is not None
    base: type[NeuronConfig] = MoENeuronConfig if record.moe else NeuronConfig
    if names.neuron_config is not None:
        base = _make(names.neuron_config, base, f"{base.__name__} for {record.name} models.")
    config = _make(
        names.inference_config,
        InferenceConfig,
        f"{record.name} model attributes plus a {base.__name__}.",
        _family=record,
        _neuron_config_cls=base,
    )
    if names.causal_lm is not None and names.model is not None:
        inner = _make(names.model, NeuronBaseModel, f"The {record.name} program bound to a config.", _family=record)
        # The family's checkpoint key prefix (DBRX: "transformer."), a class attribute as in NxDI.
        prefix = {} if record.weights is None else {"_STATE_DICT_MODEL_PREFIX": record.weights.model_prefix}
        _make(
            names.causal_lm,
            NeuronBaseForCausalLM,
            f"{record.name} causal LM.",
            _config_cls=config,
            _model_cls=inner,
            **prefix,
        )


def model_types() -> dict[str, dict[str, type]]:
    """`MODEL_TYPES[model_type]["causal-lm"]` -> the application class, for every family the engine runs;
    also under the name a serving client derives from the Hugging Face architecture where it differs
    from the model_type (`GPTNeoXForCausalLM` -> `gptneox`: the architecture's model part, lowercased)."""
    out: dict[str, dict[str, type]] = {}
    for r in families.runnable():
        if r.classes is not None and r.classes.causal_lm is not None:
            entry = {"causal-lm": __getattr__(r.classes.causal_lm)}
            out.update({t: entry for t in r.model_types})
            architecture = r.classes.causal_lm.removeprefix("Neuron").split("For", 1)[0].lower()
            out.setdefault(architecture, dict(entry))
    return out


def config_types() -> dict[str, type]:
    """model_type -> the family's InferenceConfig class."""
    return {t: __getattr__(r.classes.inference_config) for r in families.RECORDS if r.classes for t in r.model_types}


def model_type_of(model_path: str | Path) -> str:
    """The `model_type` in `model_path/config.json`.

    Raises:
        FileNotFoundError: there is no config.json.
        PermissionError: the folder or its config.json cannot be read.
        IncompatibleConfigError: config.json is not a JSON object (the file, line and column named).
        KeyError: no family the engine runs has that model_type (the message names those that do).
    """
    model_type = hf_configs.read_json(model_path).get("model_type")
    runs: Mapping[str, Any] = model_types()
    supported = ", ".join(sorted(runs))
    if model_type is None:
        raise KeyError(f"{hf_configs.config_file(model_path)} has no model_type (supported: {supported})")
    if model_type not in runs:
        raise KeyError(f"model_type {model_type!r} has no application class (supported: {supported})")
    return str(model_type)


def __getattr__(name: str) -> Any:
    if name in _built:
        return _built[name]
    if name in ("MODEL_TYPES", "CONFIG_TYPES"):
        # One dict for the life of the process: clients may register their own classes in it.
        _built[name] = model_types() if name == "MODEL_TYPES" else config_types()
        return _built[name]
    record = families.class_names().get(name)
    if record is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _build(record)
    return _built[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *families.class_names(), "MODEL_TYPES", "CONFIG_TYPES"})

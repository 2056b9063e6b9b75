"""The transformers-neuronx model classes (`LlamaForSampling`, ...), made from the family records.

A family declares its transformers-neuronx class names once, in its record (`ClassNames.tnx`,
`nxdi.core.families.llama`, `nxdi.core.families.gpt2`, ...). Classes are built on first attribute
access (importing does no work), with this module as their `__module__`.
"""

from __future__ import annotations

from typing import Any

from nxdi.core import families
from nxdi.shell.tnx.model import SamplingModel


def class_names() -> dict[str, tuple[str, ...]]:
    """transformers-neuronx class name -> the model_types it loads (its record's)."""
    out: dict[str, tuple[str, ...]] = {}
    for record in families.RECORDS:
        for name in record.classes.tnx if record.classes is not None else ():
            out[name] = record.model_types
    return out


def names_for(model_type: str) -> tuple[str, ...]:
    """The transformers-neuronx class names that load `model_type`, the family's main class first."""
    return tuple(name for name, types in class_names().items() if model_type in types)


_built: dict[str, type[SamplingModel]] = {}


def __getattr__(name: str) -> Any:
    if name in _built:
        return _built[name]
    model_types = class_names().get(name)
    if model_types is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    doc = f"transformers-neuronx's {name}: a {model_types[0]} model on the nxdi engine (see `SamplingModel`)."
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc, "_model_types": model_types}
    cls: type[SamplingModel] = type(name, (SamplingModel,), namespace)
    _built[name] = cls
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *class_names()})

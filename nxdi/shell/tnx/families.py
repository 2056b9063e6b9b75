"""The transformers-neuronx model classes (`LlamaForSampling`, ...), made from the family records.

A family declares its transformers-neuronx class names once, in its record
(`ClassNames.tnx`, `nxdi.core.families.llama`). `PENDING` names the classes of the families the
guide documents whose records do not declare them yet (GPT-2, OPT, BLOOM, GPT-J, GPT-NeoX): each
class is keyed by its family's `model_type`, so it starts working as soon as a runnable record
answers to that model_type; until then `from_pretrained` refuses naming the model_type. A name a
record declares wins over `PENDING`. Classes are built on first attribute access (importing does
no work), with this module as their `__module__`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxdi.core import families
from nxdi.shell.tnx.model import SamplingModel

PENDING: Mapping[str, tuple[str, ...]] = {
    "gpt2": ("GPT2ForSampling", "GPT2ForSamplingWithContextBroadcasting", "GPT2ForSamplingWithContextBeforeAfter"),
    "opt": ("OPTForSampling",),
    "bloom": ("BloomForSampling",),
    "gptj": ("GPTJForSampling",),
    "gpt_neox": ("GPTNeoXForSampling",),
}
"""model_type -> the guide's class names, for families whose records declare none (yet)."""


def class_names() -> dict[str, tuple[str, ...]]:
    """transformers-neuronx class name -> the model_types it loads (the record's, else `PENDING`'s)."""
    out: dict[str, tuple[str, ...]] = {name: (model_type,) for model_type, names in PENDING.items() for name in names}
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

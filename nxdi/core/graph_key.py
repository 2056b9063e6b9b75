"""graph_key: a stable hash of exactly the settings that change a compiled graph. Pure.

Two configurations with the same key compile to the same programs, so the compile cache can reuse
them; any field that changes a graph changes the key. Runtime-only NeuronSpec fields (marked
`graph=False`), the LoRA checkpoint paths and cache policy, and the tokenizer ids of the model
are left out. New fields are graph-affecting unless declared otherwise, which errs on the side of
recompiling.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs

from nxdi.core.config.codec import json_safe
from nxdi.core.config.neuron_spec import NeuronSpec, is_graph_field
from nxdi.core.model_spec import ModelSpec

_LORA_RUNTIME = frozenset(
    {"lora_ckpt_paths", "lora_ckpt_paths_cpu", "lora_ckpt_json", "max_cpu_loras", "eviction_policy", "lfu_decay_period"}
)
_MODEL_RUNTIME = frozenset({"pad_token_id", "bos_token_id", "eos_token_ids"})


def graph_fields(spec: NeuronSpec) -> dict[str, Any]:
    """The graph-affecting part of `spec`, as JSON-ready values."""
    out: dict[str, Any] = {}
    for f in attrs.fields(NeuronSpec):
        if not is_graph_field(f.name):
            continue
        value = json_safe(getattr(spec, f.name))
        if f.name == "lora_config" and value is not None:
            value = {k: v for k, v in value.items() if k not in _LORA_RUNTIME}
        out[f.name] = value
    return out


def model_graph_fields(model: ModelSpec) -> dict[str, Any]:
    """The graph-affecting part of `model` (everything but tokenizer ids)."""
    return {f.name: json_safe(getattr(model, f.name)) for f in attrs.fields(ModelSpec) if f.name not in _MODEL_RUNTIME}


def _enum_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _enum_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_enum_safe(v) for v in value]
    return getattr(value, "value", value)


def graph_key(spec: NeuronSpec, model: ModelSpec | None = None, *, extra: str = "") -> str:
    """Hex sha256 of the graph-affecting fields of `spec` (and `model`), plus a free-form `extra`
    (the caller adds a sub-model tag, bucket or backend version there)."""
    doc = {"neuron": graph_fields(spec), "model": model_graph_fields(model) if model else None, "extra": extra}
    text = json.dumps(_enum_safe(doc), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()

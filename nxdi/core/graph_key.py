"""graph_key: a stable hash of exactly the settings that change a compiled graph. Pure.

Two configurations with the same key compile to the same programs, so the compile cache can reuse
them; any field that changes a graph changes the key. Fields declared `graph=False` (runtime-only
NeuronConfig attributes, the LoRA checkpoint paths and cache policy, the model's tokenizer ids)
are left out; every other field counts, so a new field recompiles unless declared otherwise.
"""

from __future__ import annotations

import hashlib
import json

from nxdi.core.config.fields import to_json
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.model_spec import ModelSpec


def graph_key(spec: NeuronSpec, model: ModelSpec | None = None, *, extra: str = "") -> str:
    """Hex sha256 of the graph-affecting fields of `spec` (and `model`), plus a free-form `extra`
    (the caller adds a sub-model tag, bucket or backend version there)."""
    doc = {
        "neuron": to_json(spec, graph_only=True),
        "model": to_json(model, graph_only=True) if model is not None else None,
        "extra": extra,
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()

"""Qwen2: Llama with biases on the q, k and v projections, and an optional per-layer sliding window. Pure.

Every Qwen2 checkpoint has q/k/v biases and no o_proj bias (NxDI derives `qkv_bias=True,
o_bias=False`). With `use_sliding_window`, the layers from `max_window_layers` on (or those
`layer_types` marks `sliding_attention`) attend within `sliding_window`; the others see everything.
"""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families.llama import LLAMA_WEIGHTS, REQUIRED, read_llama_like
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind

_LAYER_TYPES = ("full_attention", "sliding_attention")
_MAX_WINDOW_LAYERS = 28
"""transformers' default `max_window_layers`."""


def read_windows(r: ConfigReader) -> dict[str, Any]:
    """`sliding_window` and `full_attention_layers` of a Qwen-style config (no window unless enabled)."""
    window = r.opt_int("sliding_window") if r.bool_("use_sliding_window", False) else None
    layers = r.raw.get("num_hidden_layers")
    if window is None or isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return {"sliding_window": None}  # a bad layer count is reported once, by the model reader
    types = r.raw.get("layer_types")
    if types is None:
        first = r.opt_int("max_window_layers")
        full = tuple(range(min(_MAX_WINDOW_LAYERS if first is None else first, layers)))
    elif not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        why = f"must list {layers} entries, each one of {', '.join(_LAYER_TYPES)}"
        r.problems.append(Problem.of(r.name("layer_types"), types, why))
        return {"sliding_window": None}
    else:
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    if len(full) == layers:
        return {"sliding_window": None}
    return {"sliding_window": window, "full_attention_layers": full}


RECORD = FamilyRecord(
    name="qwen2",
    model_types=("qwen2",),
    read=lambda r: read_llama_like(r, "qwen2", qkv_bias=True, o_bias=False, **read_windows(r)),
    required_attributes=REQUIRED,
    derived_attributes={"qkv_bias": True, "o_bias": False},
    classes=ClassNames(inference_config="Qwen2InferenceConfig", causal_lm="NeuronQwen2ForCausalLM"),
    weights=LLAMA_WEIGHTS,
    program=ProgramKind.DECODER,
    lora=True,
    tiny_config={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
)

"""Strategies for NeuronConfig kwargs and the NeuronSpecs they parse to.

- `neuron_kwargs()` draws NeuronConfig kwargs that are valid (dependent draws keep them so).
- `neuron_specs()` draws parsed `NeuronSpec` values.
- `invalid_neuron_kwargs()` draws `(kwargs, field)` where exactly one thing is wrong and the
  resulting `ConfigError` must name `field`.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from returns.result import Success

from nxdi.core.config.fields import MAX_BATCH, MAX_DEGREE, MAX_TOKENS
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import NeuronSpec

DTYPES = ("float32", "float16", "bfloat16")


@st.composite
def on_device_sampling(draw: st.DrawFn) -> dict[str, Any]:
    """Valid on_device_sampling_config dicts."""
    global_topk = draw(st.sampled_from([0, 64, 256]))
    top_k = draw(st.integers(min_value=-1, max_value=global_topk or 512))
    return {
        "do_sample": draw(st.booleans()),
        "top_k": top_k,
        "top_p": draw(st.floats(min_value=0.01, max_value=1.0)),
        "temperature": draw(st.floats(min_value=0.0, max_value=4.0)),
        "dynamic": draw(st.booleans()),
        "deterministic": draw(st.booleans()),
        "global_topk": global_topk,
    }


def _buckets(draw: st.DrawFn, limit: int) -> list[int]:
    return sorted(draw(st.sets(st.integers(min_value=1, max_value=limit), min_size=1, max_size=5)))


@st.composite
def neuron_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Valid NeuronConfig kwargs over the commonly used attributes."""
    seq_len = draw(st.integers(min_value=1, max_value=1 << 15))
    ctx = draw(st.integers(min_value=1, max_value=seq_len))
    batch = draw(st.integers(min_value=1, max_value=16))
    tp = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    out: dict[str, Any] = {"seq_len": seq_len, "batch_size": batch, "tp_degree": tp}
    if draw(st.booleans()):
        out["max_context_length"] = ctx
    if draw(st.booleans()):
        out["torch_dtype"] = draw(st.sampled_from(DTYPES))
    for flag in ("fused_qkv", "allow_input_truncation", "output_logits", "skip_warmup"):
        if draw(st.booleans()):
            out[flag] = draw(st.booleans())
    if draw(st.booleans()):
        out["padding_side"] = draw(st.sampled_from(["right", "left"]))
    if draw(st.booleans()):
        out["enable_bucketing"] = True
        if draw(st.booleans()):
            out["context_encoding_buckets"] = _buckets(draw, out.get("max_context_length", seq_len))
        if draw(st.booleans()):
            out["token_generation_buckets"] = _buckets(draw, seq_len)
    if draw(st.booleans()):
        out["on_device_sampling_config"] = draw(on_device_sampling())
        if draw(st.booleans()):
            out["async_mode"] = draw(st.booleans())  # needs on-device sampling
    if draw(st.booleans()):
        out["speculation_length"] = draw(st.integers(min_value=0, max_value=8))
    return out


@st.composite
def neuron_specs(draw: st.DrawFn) -> NeuronSpec:
    """Valid parsed NeuronSpecs."""
    result = parse_neuron_spec(draw(neuron_kwargs()))
    assert isinstance(result, Success), result
    return result.unwrap().spec


def _break(kwargs: dict[str, Any], kind: str) -> tuple[dict[str, Any], str]:
    k = dict(kwargs)
    seq_len = k["seq_len"]
    match kind:
        case "batch_size":
            k["batch_size"] = 0
        case "typo":
            k["tp_degre"] = 2
            return k, "tp_degre"
        case "max_context_length":
            k["max_context_length"] = seq_len + 1
        case "context_encoding_buckets":
            k["context_encoding_buckets"] = [k.get("max_context_length", seq_len) + 1]
        case "torch_dtype":
            k["torch_dtype"] = "float64"
        case "padding_side":
            k["padding_side"] = "middle"
        case "cp_degree":
            k["cp_degree"] = 3 * k["tp_degree"] + 1
        case "qkv_kernel_enabled":
            k["qkv_kernel_enabled"] = True
            k["fused_qkv"] = False
        case "on_device_sampling_config.top_p":
            k["on_device_sampling_config"] = {"top_p": 1.5}
        case "quantized_checkpoints_path":
            k["quantized"] = True
            k.pop("quantized_checkpoints_path", None)
        case "kv_cache_batch_size":  # above nxdi's upper bound
            k["kv_cache_batch_size"] = MAX_BATCH + 1 + k["batch_size"]
        case "seq_len":
            k["seq_len"] = MAX_TOKENS + seq_len
            k.pop("max_context_length", None)
            k.pop("token_generation_buckets", None)
        case "tp_degree":
            k["tp_degree"] = 2 * MAX_DEGREE
    return k, kind


INVALID_KINDS = (
    "batch_size",
    "typo",
    "max_context_length",
    "context_encoding_buckets",
    "torch_dtype",
    "padding_side",
    "cp_degree",
    "qkv_kernel_enabled",
    "on_device_sampling_config.top_p",
    "quantized_checkpoints_path",
    "kv_cache_batch_size",
    "seq_len",
    "tp_degree",
)


@st.composite
def invalid_neuron_kwargs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """`(kwargs, field)`: NeuronConfig kwargs with one problem, and the field it must be reported under."""
    base = draw(neuron_kwargs())
    base.pop("context_encoding_buckets", None)
    return _break(base, draw(st.sampled_from(INVALID_KINDS)))

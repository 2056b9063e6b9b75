"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, explicit head_dim) with a mixture of experts. Pure.

Every layer's MLP is a mixture of `num_experts` SwiGLU experts of width `moe_intermediate_size`,
`num_experts_per_tok` chosen per token by a softmax router and renormalised when `norm_topk_prob`.
Checkpoints whose `mlp_only_layers` or `decoder_sparse_step` make some layers dense are refused
(one MLP kind per model). With `use_sliding_window`, every layer attends within `sliding_window`:
transformers' Qwen3-MoE reads no `max_window_layers` (unlike Qwen2 and Qwen3).
"""

from __future__ import annotations

from typing import Any

from nxdi.core.errors import Problem
from nxdi.core.families import reader
from nxdi.core.families.llama import REQUIRED, moe_weights, read_llama_like
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind

_EXPERT = "mlp.experts.{x}."


def _read(r: ConfigReader) -> dict[str, Any]:
    dense = r.raw.get("mlp_only_layers") or []
    if dense:
        why = "makes some layers dense MLPs; nxdi runs models whose every layer is a mixture of experts"
        r.problems.append(Problem.of(r.name("mlp_only_layers"), dense, why, "use a checkpoint without dense layers"))
    step = r.int_("decoder_sparse_step", 1)
    if step is not None and step != 1:
        why = "makes every other layer dense; nxdi runs models whose every layer is a mixture of experts"
        r.problems.append(Problem.of(r.name("decoder_sparse_step"), step, why, "use decoder_sparse_step=1"))
    # The hub's configs say num_experts; transformers 5 writes num_local_experts (its attribute_map).
    experts_key = "num_experts" if r.raw.get("num_experts") is not None else "num_local_experts"
    return read_llama_like(
        r,
        "qwen3_moe",
        qk_norm=True,
        intermediate_size=r.int_("moe_intermediate_size"),
        moe_normalize=r.bool_("norm_topk_prob", False),
        sliding_window=r.opt_int("sliding_window") if r.bool_("use_sliding_window", False) else None,
        **reader.experts(r, experts=(experts_key, 128), top_k=("num_experts_per_tok", 8)),
    )


RECORD = FamilyRecord(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    read=_read,
    required_attributes=(*REQUIRED, "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    classes=ClassNames(inference_config="Qwen3MoeInferenceConfig", causal_lm="NeuronQwen3MoeForCausalLM"),
    moe=True,
    weights=moe_weights(
        router="mlp.gate.weight",
        gate=_EXPERT + "gate_proj.weight",
        up=_EXPERT + "up_proj.weight",
        down=_EXPERT + "down_proj.weight",
    ),
    program=ProgramKind.DECODER,
    lora=True,
    tiny_config={
        "head_dim": 32,
        "use_sliding_window": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
    },
)

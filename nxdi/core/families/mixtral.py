"""Mixtral: Llama attention with a mixture of experts in every layer. Pure.

The router (`block_sparse_moe.gate`) picks `num_experts_per_tok` of `num_local_experts` experts per
token with a softmax, renormalised over the chosen ones; each expert is a SwiGLU MLP stored as
`w1` (gate), `w3` (up) and `w2` (down).
"""

from __future__ import annotations

from nxdi.core.families import reader
from nxdi.core.families.llama import REQUIRED, moe_weights, read_llama_like
from nxdi.core.families.record import ClassNames, FamilyRecord, ProgramKind

_EXPERT = "block_sparse_moe.experts.{x}."

RECORD = FamilyRecord(
    name="mixtral",
    model_types=("mixtral",),
    read=lambda r: read_llama_like(
        r,
        "mixtral",
        sliding_window=r.opt_int("sliding_window"),
        **reader.experts(r, experts=("num_local_experts", 8), top_k=("num_experts_per_tok", 2)),
    ),
    required_attributes=(*REQUIRED, "num_local_experts", "num_experts_per_tok"),
    classes=ClassNames(
        inference_config="MixtralInferenceConfig",
        causal_lm="NeuronMixtralForCausalLM",
        neuron_config="MixtralNeuronConfig",
        tnx=("MixtralForSampling",),
    ),
    moe=True,
    weights=moe_weights(
        router="block_sparse_moe.gate.weight",
        gate=_EXPERT + "w1.weight",
        up=_EXPERT + "w3.weight",
        down=_EXPERT + "w2.weight",
    ),
    program=ProgramKind.DECODER,
    lora=True,
    tiny_config={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
)

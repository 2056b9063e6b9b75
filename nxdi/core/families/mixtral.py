"""Mixtral: Llama attention with a mixture of experts in every layer (planned; no program yet). Pure."""

from __future__ import annotations

from nxdi.core.families import reader
from nxdi.core.families.llama import REQUIRED, read_llama_like
from nxdi.core.families.record import ClassNames, FamilyRecord

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
    classes=ClassNames(inference_config="MixtralInferenceConfig", neuron_config="MixtralNeuronConfig"),
    moe=True,
)

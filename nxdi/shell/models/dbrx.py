"""DBRX: DbrxInferenceConfig with a DbrxNeuronConfig (MoE)."""

from __future__ import annotations

from nxdi.shell.config import MoENeuronConfig, NeuronConfig
from nxdi.shell.inference_config import InferenceConfig


class DbrxNeuronConfig(MoENeuronConfig):
    """MoENeuronConfig for DBRX models."""


class DbrxInferenceConfig(InferenceConfig):
    """DBRX model attributes plus a DbrxNeuronConfig."""

    _model_type = "dbrx"

    def get_required_attributes(self) -> list[str]:
        return ["d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size", "attn_config", "ffn_config"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return DbrxNeuronConfig

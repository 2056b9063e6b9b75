"""What vLLM's Neuron plugin builds before it constructs a model, rewritten for the tests.

`client_defaults` is its `_get_default_neuron_config` (the NeuronConfig kwargs it derives from its
scheduler and cache settings) and `apply_overrides` its `_get_neuron_config_after_override` (the
user's `override_neuron_config` applied by a dict update). Read from
`vllm_neuron/worker/neuronx_distributed_model_loader.py`; written here, not copied.
"""

from __future__ import annotations

from typing import Any


def client_defaults(
    *, max_num_seqs: int = 4, max_model_len: int = 64, block_size: int = 16, prefix_caching: bool = False
) -> dict[str, Any]:
    """The client's NeuronConfig kwargs without chunked prefill (fp32, one rank)."""
    from nxdi.shell.config import OnDeviceSamplingConfig

    return {
        "tp_degree": 1,
        "ctx_batch_size": 1,
        "batch_size": max_num_seqs,
        "max_context_length": max_model_len,
        "seq_len": max_model_len,
        "enable_bucketing": True,
        "is_continuous_batching": max_num_seqs > 1,
        "quantized": False,
        "torch_dtype": "float32",
        "padding_side": "right",
        "on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, deterministic=False),
        "lora_config": None,
        "pa_num_blocks": max_model_len // block_size * max_num_seqs,
        "pa_block_size": block_size,
        "is_block_kv_layout": prefix_caching,
        "is_prefix_caching": prefix_caching,
    }


def apply_overrides(default: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """`default` updated with `override` as the client does: a chunked_prefill_config dict becomes a
    ChunkedPrefillConfig, and `quantized` brings its companion keys. Updates and returns `default`."""
    from nxdi.shell.config import ChunkedPrefillConfig

    override = dict(override or {})
    chunked = override.pop("chunked_prefill_config", None)
    if chunked:
        override["chunked_prefill_config"] = ChunkedPrefillConfig(**chunked)
    default.update(override)
    if "quantized" in override:
        default.update(
            quantized=override.pop("quantized", False),
            quantized_checkpoints_path=override.pop("quantized_checkpoints_path", None),
            quantization_type=override.pop("quantization_type", "per_tensor_symmetric"),
            quantization_dtype=override.pop("quantization_dtype", "int8"),
        )
    return default

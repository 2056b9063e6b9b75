"""`nxdi demo`: the README's main job, end to end on a small random Llama built locally.

Builds a random Llama checkpoint with transformers (no download), configures it through the
documented API (`NeuronConfig`, `LlamaInferenceConfig`, `load_pretrained_config`), writes and
re-reads `neuron_config.json`, checks the round trip is exact, and prints the resolved
configuration and its graph key.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="build a small random Llama locally and run nxdi's main flow on it")
    p.add_argument("--output-dir", default=".nxdi-demo", help="where the checkpoint and artifacts go")
    p.set_defaults(run=run)


def _step(message: str) -> float:
    print(f"[nxdi demo] {message} ...", flush=True)
    return time.perf_counter()


def build_tiny_llama(path: Path) -> Path:
    """Save a small random LlamaForCausalLM (hidden 256, 4 layers, GQA 8/4 heads) to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=512,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def run(args: argparse.Namespace) -> int:
    from nxdi.core import graph_key
    from nxdi.shell.config import NeuronConfig, OnDeviceSamplingConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models.llama import LlamaInferenceConfig

    out = Path(args.output_dir)
    model_path = out / "tiny-llama"
    t = _step(f"building a random Llama checkpoint in {model_path}")
    build_tiny_llama(model_path)
    print(f"  done in {time.perf_counter() - t:.1f}s")
    neuron_config = NeuronConfig(
        batch_size=2,
        max_context_length=32,
        seq_len=64,
        enable_bucketing=True,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))
    compiled = out / "compiled"
    _step(f"writing {compiled / 'neuron_config.json'}")
    config.save(compiled)
    reloaded = LlamaInferenceConfig.load(compiled)
    same = reloaded.to_json_string() == config.to_json_string()
    spec, model = config.neuron_config.spec, config.model_spec()
    print(f"  model: {model.model_type}, {model.num_params() / 1e6:.2f}M parameters, {model.num_layers} layers")
    print(f"  heads {model.num_attention_heads} q / {model.num_kv_heads} kv, head_dim {model.head_dim}")
    print(f"  batch {spec.batch_size}, max_context_length {spec.max_context_length}, seq_len {spec.seq_len}")
    print(f"  torch_dtype {spec.torch_dtype} (from the checkpoint), graph key {graph_key.graph_key(spec, model)[:16]}")
    print(f"  neuron_config.json round trip identical: {same}")
    return 0 if same else 1

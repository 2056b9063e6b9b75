"""`nxdi demo`: the README's main job, end to end on a random Llama built locally.

With no `--model-path`, builds a small random Llama checkpoint with transformers (no download),
then runs the documented flow: configure (`NeuronConfig`, `LlamaInferenceConfig`,
`load_pretrained_config`), `compile()`, load in a new instance without recompiling, generate with
`HuggingFaceGenerationAdapter`, check accuracy against transformers (token matching, then logit
matching), and time a short decode. Progress is printed before every long step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="build a random Llama locally and compile, load, generate, check it")
    p.add_argument("--output-dir", default=".nxdi-demo", help="where the checkpoint and artifacts go")
    p.add_argument("--model-path", default=None, help="use this Llama-family checkpoint instead of a random one")
    p.add_argument("--new-tokens", type=int, default=32)
    p.set_defaults(run=run)


class _Step:
    """Prints what is about to happen, then how long it took."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __enter__(self) -> _Step:
        print(f"[nxdi demo] {self.message} ...", flush=True)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            print(f"[nxdi demo]   done in {time.perf_counter() - self.start:.1f}s", flush=True)


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


def _prompts(vocab: int) -> tuple[Any, Any]:
    """Two prompts of different lengths, left padded as a tokenizer would."""
    import torch

    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(3, vocab, (12,), generator=g), torch.randint(3, vocab, (5,), generator=g)
    ids = torch.stack([long, torch.cat([torch.zeros(7, dtype=torch.int64), short])])
    mask = torch.stack([torch.ones(12, dtype=torch.int64), (torch.arange(12) >= 7).to(torch.int64)])
    return ids, mask


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import GenerationConfig

    from nxdi.shell.accuracy import check_accuracy, check_accuracy_logits
    from nxdi.shell.config import NeuronConfig, OnDeviceSamplingConfig
    from nxdi.shell.generation import HuggingFaceGenerationAdapter
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM

    out = Path(args.output_dir)
    model_path = Path(args.model_path) if args.model_path else out / "tiny-llama"
    if args.model_path is None and not (model_path / "config.json").is_file():
        with _Step(f"building a random Llama checkpoint in {model_path}"):
            build_tiny_llama(model_path)
    neuron_config = NeuronConfig(
        batch_size=2,
        max_context_length=32,
        seq_len=64,
        enable_bucketing=True,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
        output_logits=True,
    )
    config = LlamaInferenceConfig(neuron_config, load_config=load_pretrained_config(model_path))
    spec, arch = config.neuron_config.spec, config.model_spec()
    print(
        f"  model: {arch.num_params() / 1e6:.2f}M parameters, {arch.num_layers} layers, "
        f"{arch.num_attention_heads} q / {arch.num_kv_heads} kv heads, torch_dtype {spec.torch_dtype}"
    )
    compiled = out / "compiled"
    with _Step(f"compiling into {compiled} (unchanged programs are reused)"):
        NeuronLlamaForCausalLM(model_path, config).compile(compiled)
    with _Step("loading the compiled model in a new instance (no tracing)"):
        model = NeuronLlamaForCausalLM(compiled)
        model.load(compiled)
    ids, mask = _prompts(arch.vocab_size)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    with _Step(f"generating {args.new_tokens} tokens for 2 prompts (12 and 5 tokens)"):
        tokens = HuggingFaceGenerationAdapter(model).generate(ids, attention_mask=mask, generation_config=gen)
    for row in tokens:
        print(f"  {row[row != 0].tolist()}")
    inputs = {"input_ids": ids, "attention_mask": mask}
    with _Step("token matching against transformers on the same checkpoint"):
        check_accuracy(model, inputs=inputs, num_tokens_to_check=args.new_tokens)
    with _Step("logit matching against transformers (REFERENCE tolerances)"):
        report = check_accuracy_logits(model, inputs=inputs, num_tokens_to_check=args.new_tokens)
    worst = ", ".join(f"top-{k} {v:.2e}" for k, v in report.worst().items())
    print(f"  accuracy: tokens equal; logits within tolerance at {len(report.positions)} positions ({worst})")
    with torch.inference_mode():
        model.reset()
        start = time.perf_counter()
        first = model(ids, attention_mask=mask)
        ttft = time.perf_counter() - start
        positions = mask.sum(-1, keepdim=True)
        start = time.perf_counter()
        step_tokens = first.tokens
        for k in range(16):
            step_tokens = model(step_tokens[:, None], position_ids=positions + k).tokens
        tpot = (time.perf_counter() - start) / 16
    print(
        f"  speed: TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms (batch 2; `nxdi bench generate` measures properly)"
    )
    print("[nxdi demo] all steps passed")
    return 0

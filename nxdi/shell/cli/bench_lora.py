"""`nxdi bench generate --lora N [N ...]`: the cost of multi-LoRA serving against the base model alone.

    nxdi bench generate --lora 0 1 8 [--shape small|tiny|toy | --model-path DIR] [--lora-rank 16]
                        [--batch-size 8] [--prompt-len 128] [--new-tokens 128] [--repeat 3]
                        [--threads 2] [--dtype bfloat16] [--json]

On the chosen checkpoint the command writes max(N) distinct random adapters in the PEFT format
(`adapter_config.json` + `adapter_model.safetensors`, rank `--lora-rank`, on q/k/v/o and
gate/up/down; a mixture of experts: q/k/v/o only, as its experts have no gate_proj) once into
`--work-dir`, and compiles two models (each reused by later runs): the base model without
`lora_config`, and the same model with `lora_config` holding every adapter (max_loras = max(N),
enable_base_model_only). In one process, alternating runs so machine noise hits every side, it
times greedy decoding of exactly `--new-tokens` tokens from a random `--prompt-len`-token prompt
(`forward()` as `nxdi bench generate` does: TTFT = the context-encoding call, TPOT = each
token-generation call) of:

  - the base model;
  - the LoRA model, once per N, a batch whose rows are spread over N distinct adapters (row i uses
    adapter i mod N): N = 0 puts every row on the base model's slot (adapter id 0), N = 1 every row
    on one adapter, N = batch size every row on a different one.

Reported per side: TTFT (median), TPOT p50/p90/p99, and for the LoRA sides the overhead (TPOT p50
and TTFT over the base model's), and whether its greedy tokens equal the base model's (N = 0
must: its rows add exact zeros; the bench fails when they do not).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

DEFAULT_BATCH = 8
DEFAULT_RANK = 16
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = DENSE_TARGETS[:4]
_MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})


def add_args(p: argparse.ArgumentParser) -> None:
    """`--lora N [N ...]` and `--lora-rank R` on `nxdi bench generate`."""
    p.add_argument(
        "--lora",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="measure multi-LoRA serving: a batch spread over N distinct adapters, each N against the base model "
        "(e.g. --lora 0 1 8; see nxdi.shell.cli.bench_lora)",
    )
    p.add_argument(
        "--lora-rank", type=int, default=None, help=f"with --lora: the adapters' rank (default {DEFAULT_RANK})"
    )


def check_args(args: argparse.Namespace) -> None:
    """Fill the --lora defaults (batch 8, rank 16, prompt and new tokens 128) and refuse what it
    does not measure.

    Raises:
        UsageError: listing every refused flag.
    """
    from nxdi.shell.cli.errors import UsageError

    args.batch_size = [DEFAULT_BATCH] if args.batch_size is None else args.batch_size
    args.lora_rank = DEFAULT_RANK if args.lora_rank is None else args.lora_rank
    args.prompt_len = 128 if args.prompt_len is None else args.prompt_len
    args.new_tokens = 128 if args.new_tokens is None else args.new_tokens
    problems = []
    if args.lora is None:
        problems.append(f"--lora-rank {args.lora_rank}: only used with --lora; give --lora N or drop --lora-rank")
        args.lora = []
    if args.speculation is not None or args.speculation_length is not None:
        problems.append("--speculation: measured on its own; drop --speculation or --lora")
    if args.tp_degree != [1]:
        problems.append(f"--tp-degree {' '.join(map(str, args.tp_degree))}: multi-LoRA serving runs at tp 1 only")
    if args.backend != ["cpu"]:
        problems.append(f"--backend {' '.join(args.backend)}: --lora measures the cpu backend only; drop --backend")
    if args.async_mode or args.compare_hf:
        problems.append("--async and --compare-hf: not measured with --lora; drop them")
    if any(n < 0 for n in args.lora):
        problems.append(f"--lora {' '.join(map(str, args.lora))}: adapter counts must be >= 0")
    wide = [n for n in args.lora if n > min(args.batch_size)]
    if wide:
        why = f"more distinct adapters than rows in a batch of {min(args.batch_size)}"
        problems.append(f"--lora {' '.join(map(str, wide))}: {why}; give N <= --batch-size")
    if args.lora_rank < 1:
        problems.append(f"--lora-rank {args.lora_rank}: must be >= 1")
    if min(args.batch_size) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.repeat < 1:
        problems.append("--batch-size, --prompt-len and --repeat must be >= 1 and --new-tokens >= 2")
    if problems:
        raise UsageError("; ".join(problems))


def targets_of(model_spec: Any) -> tuple[str, ...]:
    """The adapters' target modules: every projection, or only attention's for a mixture of experts."""
    return ATTENTION_TARGETS if model_spec.is_moe else DENSE_TARGETS


def write_adapters(model_spec: Any, folder: Path, count: int, rank: int, *, dtype: str) -> dict[str, str]:
    """`count` distinct random PEFT adapters (rank `rank`, `targets_of(model_spec)`, seeds 1..count)
    under `folder/adapter-<i>`, written once and reused: adapter id -> folder (ids sort by i).

    A and B are N(0, 0.02) (PEFT initialises B to zero, which would make every adapter the base
    model), lora_alpha = 2 * rank."""
    import torch
    from safetensors.torch import save_file

    from nxdi.core.planning.lora import LoraLayout

    targets = targets_of(model_spec)
    layout = LoraLayout(model=model_spec, slots=1, rank=rank, modules=targets, base_slot=False)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "target_modules": list(targets),
    }
    paths = {}
    for i in range(1, count + 1):
        path = folder / f"adapter-{i:03d}"
        paths[path.name] = str(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(model_spec.num_layers):
            for module in targets:
                fan_in, fan_out = layout.dims(module)
                block = "mlp" if module in _MLP_MODULES else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                for name, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                    t = torch.randn(shape, generator=gen) * 0.02
                    tensors[f"{key}.{name}.weight"] = t.to(getattr(torch, dtype)).contiguous()
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return paths


def row_adapters(n: int, batch: int) -> list[int]:
    """Each row's adapter index for a batch spread over `n` adapters: 0 (the base slot) when n is 0,
    else 1 + (row mod n)."""
    return [0 if n == 0 else 1 + row % n for row in range(batch)]


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    from nxdi.shell.cli.bench_generate import _percentile

    tpots = [s for r in runs for s in r["tpot"]]
    return {
        "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in runs),
        "tpot_ms": {q: 1e3 * _percentile(tpots, float(q[1:])) for q in ("p50", "p90", "p99")},
    }


def bench_batch(path: Path, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """Base model and LoRA model side by side at one batch size (see the module docstring)."""
    import torch

    from nxdi.shell.cli import bench_generate as bg
    from nxdi.shell.config import LoraServingConfig

    model_type, compiled, _ = bg.compile_for(path, args, batch, 1, "cpu")
    base = bg.load_compiled(model_type, compiled, "cpu")
    count = max(1, *args.lora)
    folder = Path(args.work_dir) / f"lora-{path.name}-r{args.lora_rank}"
    adapters = write_adapters(base.model_spec, folder, count, args.lora_rank, dtype=args.dtype)
    lora = LoraServingConfig(
        max_loras=count,
        max_lora_rank=args.lora_rank,
        target_modules=list(targets_of(base.model_spec)),
        lora_ckpt_paths=adapters,
        enable_base_model_only=True,
    )
    tag = f"-lora{count}-r{args.lora_rank}"
    _, lora_compiled, _ = bg.compile_for(path, args, batch, 1, "cpu", extra={"lora_config": lora}, tag=tag)
    served = bg.load_compiled(model_type, lora_compiled, "cpu")
    ids = bg.prompt(base, batch, args.prompt_len)
    sides: dict[str, tuple[Any, dict[str, Any]]] = {"base": (base, {})}
    for n in args.lora:
        sides[f"lora {n}"] = (served, {"adapter_ids": torch.tensor(row_adapters(n, batch))})
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in sides}
    with base, served, torch.inference_mode():
        for model, inputs in sides.values():
            bg._nxdi_once(model, ids, min(4, args.new_tokens), **inputs)
        for _ in range(args.repeat):  # alternate sides so drifting machine load hits all of them
            for label, (model, inputs) in sides.items():
                runs[label].append(bg._nxdi_once(model, ids, args.new_tokens, **inputs))
    base_summary = _summary(runs["base"])
    base_tokens = runs["base"][-1]["tokens"]
    result: dict[str, Any] = {
        "batch_size": batch,
        "lora_rank": args.lora_rank,
        "target_modules": list(targets_of(base.model_spec)),
        "max_loras": count,
        "base": base_summary,
        "lora": [],
    }
    for n in args.lora:
        s = _summary(runs[f"lora {n}"])
        s |= {
            "adapters": n,
            "adapter_ids": row_adapters(n, batch),
            "overhead_tpot_p50": s["tpot_ms"]["p50"] / base_summary["tpot_ms"]["p50"],
            "overhead_ttft": s["ttft_ms"] / base_summary["ttft_ms"],
            "tokens_equal_base": bool(torch.equal(runs[f"lora {n}"][-1]["tokens"], base_tokens)),
        }
        result["lora"].append(s)
    return result


def render(results: list[dict[str, Any]]) -> str:
    """A table per batch size: the base model, then each N with its overhead."""
    lines = []
    for r in results:
        targets = "/".join(m.removesuffix("_proj") for m in r["target_modules"])
        lines.append(
            f"batch {r['batch_size']}, LoRA rank {r['lora_rank']} on {targets}, max_loras {r['max_loras']}"
            " (+ the base slot):"
        )
        rows = [
            ("base model", r["base"], None),
            *((f"lora, {s['adapters']} adapter{'' if s['adapters'] == 1 else 's'}", s, s) for s in r["lora"]),
        ]
        for label, s, over in rows:
            t = s["tpot_ms"]
            line = f"  {label:<18} TTFT {s['ttft_ms']:8.1f} ms   TPOT p50/p90/p99 {t['p50']:7.2f}/{t['p90']:7.2f}/{t['p99']:7.2f} ms"
            if over is not None:
                same = "same tokens as base" if over["tokens_equal_base"] else "other tokens than base"
                line += f"   overhead TPOT {over['overhead_tpot_p50']:.2f}x  TTFT {over['overhead_ttft']:.2f}x   {same}"
            lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`nxdi bench generate --lora ...`: measure, print the table (or JSON); exit 1 when the N = 0
    rows' tokens differ from the base model's."""
    import torch

    from nxdi.shell.cli import bench_models

    check_args(args)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        path = bench_models.checkpoint_for(args)
        results = [bench_batch(path, args, b) for b in args.batch_size]
    finally:
        torch.set_num_threads(before)
    print(json.dumps(results, indent=2) if args.json else render(results))
    wrong = [r["batch_size"] for r in results for s in r["lora"] if s["adapters"] == 0 and not s["tokens_equal_base"]]
    if wrong:
        print(
            f"nxdi bench generate: the base-slot rows (--lora 0) gave other tokens than the base model (batch {wrong})"
        )
        return 1
    return 0

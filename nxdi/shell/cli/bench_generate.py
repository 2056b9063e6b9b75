"""`nxdi bench generate`: time to first token, time per output token and throughput, vs transformers.

    nxdi bench generate [--model-type llama] [--shape small|tiny|toy | --model-path DIR] [--dtype bfloat16]
                        [--batch-size 1 4] [--tp-degree 1 2] [--backend cpu xla] [--prompt-len 128]
                        [--new-tokens 128] [--repeat 3] [--threads 2] [--compare-hf] [--async [--host-ms 0]]
    nxdi bench generate --speculation draft|fused|medusa|eagle ...   (see below)
    nxdi bench generate --lora 0 1 8 ...                             (see below)

Method (the same for both sides, measured in one process, alternating runs, so machine noise
hits both): greedy decoding of exactly `--new-tokens` tokens (EOS never stops it) from a random
`--prompt-len`-token prompt, with `torch.inference_mode()` and `--threads` intra-op threads.
- nxdi: the compiled model (compiled into `--work-dir`, reused across runs) with on-device greedy
  sampling. TTFT = the context-encoding call; TPOT = each token-generation call (p50/p90/p99).
  `generate()` end to end through HuggingFaceGenerationAdapter gives the throughput.
- transformers: `model.generate()` with its default (dynamic) cache; a logits processor stamps the
  time of every step, so prefill = call start -> first logits and TPOT = the gaps between steps.
Ratios are transformers / nxdi (above 1: nxdi is faster). Prefill is compute bound, so each TTFT
is also shown as the TFLOP/s it achieves: the prompt's matmul work (`roofline.prefill_flops`) / TTFT.

`--tp-degree 1 2` measures each degree in turn in the same run (rank processes for tp > 1; the
`--threads` are split between the ranks, so every degree uses the same cores). For tp > 1 it also
reports the collectives of one token-generation step, per rank: calls, and time inside them (which
includes waiting for the slowest rank, as the step does).

`--backend cpu xla` measures each backend in turn in the same run (xla needs torch-xla: run it in
the XLA tier's environment, `.venv-xla`). Each reports compile() and load() seconds per program
(one program per bucket): the xla backend lowers to HLO in compile() and XLA compiles each module
at load (warm-up); a folder compiled earlier is reused, and so are programs in the persistent compile
cache, so delete `--work-dir` and set NXDI_COMPILE_CACHE=off for cold numbers.

`--async` also measures `async_mode` against synchronous mode on the same compiled folder, each
mode's model in a child process of its own, run alternately (`nxdi.shell.cli.bench_async`): a
decode loop that feeds each step's tokens back (reading them with `.tolist()`, as a serving loop
does, then `--host-ms` of host time that holds neither the interpreter nor a core, such as
streaming tokens out), and generate(). It reports each mode's time per loop step, split into the
forward() call and the host's part, and the share of the host's part that async mode hid behind
the step launched ahead ((sync step - async step) / sync host part). Both modes must give the same
tokens, or the bench fails.

`--speculation METHOD` measures speculative decoding instead, on a target and draft the command
trains in a temporary folder: nxdi greedy, nxdi speculation, transformers' counterpart (assisted
generation, for `draft` and `fused`) and transformers greedy side by side, with acceptance, tokens
per target step, TPOT and end-to-end time (`nxdi.shell.cli.bench_speculation`; there `--shape
small|toy` names the trained pair). METHOD: `draft` (a separate draft model), `fused` (the same
draft fused into the target's programs), `medusa` (Medusa heads trained on the target), `eagle`
(an EAGLE draft trained on the target, fused).

`--lora N [N ...]` measures multi-LoRA serving instead: the base model against the same model with
`lora_config`, serving a batch (default 8) spread over N distinct random rank-16 PEFT adapters
(0: every row on the base-model slot), TTFT and TPOT side by side with the overhead of each N
(`nxdi.shell.cli.bench_lora`).

`--model-type` (any family the engine runs: llama, mixtral, qwen3_moe, ...; default llama) and
`--shape small|tiny|toy` pick a random checkpoint, built once into `--work-dir` (no download):
`small` is hidden 768, 12 layers, 12 heads, 4 kv heads, vocab 32000 (~125M parameters; a mixture of
experts has 8 experts of 1024, top 2: ~125M active of 295M), `tiny` the TinyLlama-1.1B shape, `toy`
the family's test config (`nxdi.shell.cli.bench_models` has the table).

(Over 400 lines: one parser for the command's three modes, which every mode's checks read, and the
plain mode's measurement; the speculation and LoRA modes live in their own modules.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nxdi.core.planning import roofline


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model a bench command measures: `--model-type` and `--shape`, or `--model-path`; `--dtype`,
    `--batch-size`."""
    from nxdi.shell.cli import bench_models

    bench_models.add_checkpoint_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from nxdi.shell.cli import bench_lora, bench_spec_methods

    p = sub.add_parser(
        "generate",
        help="TTFT / TPOT / throughput of a compiled model, optionally vs transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_model_args(p)
    p.add_argument("--tp-degree", type=int, nargs="+", default=[1], help="tensor-parallel degrees to compare")
    p.add_argument("--backend", nargs="+", default=["cpu"], choices=["cpu", "xla", "neuron"])
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --speculation)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (64 with --speculation)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per side (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare-hf", action="store_true", help="measure transformers' generate() in the same run")
    p.add_argument(
        "--async", dest="async_mode", action="store_true", help="measure async_mode against synchronous mode"
    )
    p.add_argument("--host-ms", type=float, default=0.0, help="with --async: host time per decode step, in ms")
    p.add_argument("--work-dir", default=".nxdi-bench", help="random checkpoints and compiled models")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--speculation",
        choices=tuple(bench_spec_methods.METHODS),
        default=None,
        help="measure speculative decoding on a target/draft pair the command trains (see nxdi.shell.cli.bench_speculation)",
    )
    p.add_argument(
        "--speculation-length",
        type=int,
        default=None,
        help="with --speculation: tokens a target step scores (default 5; not with medusa, whose tree sets them)",
    )
    bench_lora.add_args(p)
    # --batch-size: 1, 8 with --lora (see run)
    p.set_defaults(run=run, dtype=None, batch_size=None)  # --dtype: bfloat16, float32 with --speculation (see run)


def compile_for(
    path: Path,
    args: argparse.Namespace,
    batch: int,
    tp: int,
    backend: str,
    *,
    extra: dict[str, Any] | None = None,
    tag: str = "",
) -> tuple[str, Path, float]:
    """Compile (or reuse) the benchmarked model: its model type, compiled folder and compile() seconds.

    `extra` NeuronConfig kwargs (their `tag` ends the compiled folder's name); with `quantized=True`
    the quantized checkpoint is written first to `quantized_checkpoints_path`, unless it exists."""
    from nxdi.shell.config import OnDeviceSamplingConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, model_type_of

    model_type = model_type_of(str(path))
    cls = MODEL_TYPES[model_type]["causal-lm"]
    neuron = cls.get_neuron_config_cls()(  # MoENeuronConfig for a mixture of experts
        batch_size=batch,
        max_context_length=args.prompt_len,
        seq_len=args.prompt_len + args.new_tokens,
        torch_dtype=args.dtype,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
        save_sharded_checkpoint=True,
        tp_degree=tp,
        **(extra or {}),
    )
    config = cls.get_config_cls()(neuron, load_config=load_pretrained_config(path))
    if neuron.quantized and not Path(neuron.quantized_checkpoints_path).exists():
        print(f"[bench] writing the quantized checkpoint {neuron.quantized_checkpoints_path} ...", flush=True)
        cls.save_quantized_state_dict(path, config)
    name = f"compiled-{path.name}-{backend}-tp{tp}-b{batch}-{args.prompt_len}-{args.new_tokens}{tag}"
    compiled = Path(args.work_dir) / name
    t = time.perf_counter()
    cls(path, config, backend=backend).compile(compiled)
    compile_s = time.perf_counter() - t
    print(f"[bench] compiled (or reused) {compiled} in {compile_s:.1f}s", flush=True)
    return model_type, compiled, compile_s


def load_compiled(model_type: str, compiled: Path, backend: str, *, async_mode: bool = False) -> Any:
    """The compiled model loaded (`async_mode` set before load: the compiled folder is the same)."""
    from nxdi.shell.models import MODEL_TYPES

    model = MODEL_TYPES[model_type]["causal-lm"](compiled, backend=backend)
    model.neuron_config.async_mode = async_mode
    model.load(compiled)
    return model


def _nxdi_model(
    path: Path, args: argparse.Namespace, batch: int, tp: int, backend: str
) -> tuple[Any, dict[str, float]]:
    """The loaded model, and its compile() and load() seconds per program."""
    model_type, compiled, compile_s = compile_for(path, args, batch, tp, backend)
    t = time.perf_counter()
    model = load_compiled(model_type, compiled, backend)
    load_s = time.perf_counter() - t
    programs = len(json.loads((compiled / "manifest.json").read_text())["programs"])
    return model, {"compile_s_per_program": compile_s / programs, "load_s_per_program": load_s / programs}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def _probe(model: Any, *, reset: bool) -> list[Any]:
    """The rank processes' counters (none with one rank, which runs no collective)."""
    runtime = model._require_runtime()
    return runtime.probe(reset=reset) if hasattr(runtime, "probe") else []


def _nxdi_once(model: Any, ids: Any, new_tokens: int, **inputs: Any) -> dict[str, Any]:
    """One greedy generation through forward() (`inputs`, such as `adapter_ids`, given to every
    call): TTFT and every TPOT, in seconds, the generated tokens [B, new_tokens] and the ranks'
    collectives over the token-generation steps."""
    import torch

    model.reset()
    start = time.perf_counter()
    out = model(ids, **inputs)
    ttft = time.perf_counter() - start
    _probe(model, reset=True)
    tokens = out.tokens
    generated = [tokens]
    positions = torch.full((ids.shape[0], 1), ids.shape[1], dtype=torch.int64)
    steps = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        out = model(tokens[:, None], position_ids=positions, **inputs)
        steps.append(time.perf_counter() - t)
        tokens, positions = out.tokens, positions + 1
        generated.append(tokens)
    return {"ttft": ttft, "tpot": steps, "tokens": torch.stack(generated, 1), "ranks": _probe(model, reset=True)}


def nxdi_generate_s(model: Any, ids: Any, new_tokens: int) -> float:
    import torch
    from transformers import GenerationConfig

    from nxdi.shell.generation import HuggingFaceGenerationAdapter

    # No EOS, so exactly new_tokens are generated (min_new_tokens would add a host logits processor,
    # which greedy on-device sampling refuses).
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    adapter = HuggingFaceGenerationAdapter(model)
    adapter.generation_config.eos_token_id = None
    t = time.perf_counter()
    out = adapter.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new_tokens, "generation stopped early"
    return elapsed


def prompt(model: Any, batch: int, length: int) -> Any:
    import torch

    return torch.randint(3, model.model_spec.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


def _hf_once(model: Any, ids: Any, new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    stamps: list[float] = []

    def stamp(input_ids: Any, scores: Any) -> Any:
        stamps.append(time.perf_counter())
        return scores

    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=0
    )
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        logits_processor=LogitsProcessorList([stamp]),
    )
    total = time.perf_counter() - start
    return {
        "ttft": stamps[0] - start,
        "tpot": [b - a for a, b in itertools.pairwise(stamps)],
        "total": total,
    }


def _collectives(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Collective calls and milliseconds per token-generation step, averaged over steps and ranks."""
    probes = [(len(r["tpot"]), p) for r in runs for p in r.get("ranks", [])]
    if not probes:
        return None
    steps = sum(n for n, _ in probes)
    names = sorted({name for _, p in probes for name in p.collectives})
    calls = {name: sum(p.collectives.get(name, (0, 0.0))[0] for _, p in probes) / steps for name in names}
    ms = {name: 1e3 * sum(p.collectives.get(name, (0, 0.0))[1] for _, p in probes) / steps for name in names}
    return {"calls_per_step": calls, "ms_per_step": ms, "total_ms_per_step": sum(ms.values())}


def _summary(runs: list[dict[str, Any]], batch: int, new_tokens: int, prefill_flops: int) -> dict[str, Any]:
    tpots = [s for r in runs for s in r["tpot"]]
    totals = [r["total"] for r in runs]
    ttft = statistics.median(r["ttft"] for r in runs)
    out = {
        "ttft_ms": 1e3 * ttft,
        "prefill_tflop_s": prefill_flops / ttft / 1e12,
        "tpot_ms": {q: 1e3 * _percentile(tpots, float(q[1:])) for q in ("p50", "p90", "p99")},
        "decode_tok_s_per_seq": 1.0 / statistics.median(tpots),
        "e2e_s": statistics.median(totals),
        "throughput_tok_s": batch * new_tokens / statistics.median(totals),
    }
    collectives = _collectives(runs)
    if collectives is not None:
        out["collectives"] = collectives
    return out


def _bench_batch(
    path: Path, args: argparse.Namespace, batch: int, hf: Any, tp: int = 1, backend: str = "cpu"
) -> dict[str, Any]:
    model, times = _nxdi_model(path, args, batch, tp, backend)
    with model:
        result = {"backend": backend, **times, **bench_side_by_side(model, args, batch, hf, tp)}
    if args.async_mode:
        from nxdi.shell.cli import bench_async

        result["async_mode"] = bench_async.measure(path, args, batch, tp, backend)
    return result


def bench_side_by_side(
    model: Any, args: argparse.Namespace, batch: int, hf: Any, tp: int, *, others: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """nxdi's (and, with `hf`, transformers') TTFT, TPOT and throughput, alternating runs in this process
    (`args.prompt_len`, `args.new_tokens`, `args.repeat`; also used by `nxdi bench roofline`).
    `others`: more nxdi models by label (`nxdi bench roofline --weights` adds the unquantized one), run
    in the same alternation and summarized under their labels."""
    import torch

    ids = prompt(model, batch, args.prompt_len)
    nxdi_models = {"nxdi": model, **(others or {})}
    ours: dict[str, list[dict[str, Any]]] = {label: [] for label in nxdi_models}
    theirs: list[dict[str, Any]] = []
    with torch.inference_mode():
        warm_up = min(4, args.new_tokens)  # tokens past --new-tokens would not fit seq_len
        for m in nxdi_models.values():
            _nxdi_once(m, ids, warm_up)
        if hf is not None:
            _hf_once(hf, ids, warm_up)
        for _ in range(args.repeat):  # alternate sides so drifting machine load hits every one
            for label, m in nxdi_models.items():
                run = _nxdi_once(m, ids, args.new_tokens)
                run["total"] = nxdi_generate_s(m, ids, args.new_tokens)
                ours[label].append(run)
            if hf is not None:
                theirs.append(_hf_once(hf, ids, args.new_tokens))
    flops = roofline.prefill_flops(model.model_spec, batch=batch, prompt_len=args.prompt_len)
    result: dict[str, Any] = {
        "batch_size": batch,
        "tp_degree": tp,
        "prefill_gflop": flops / 1e9,
        **{label: _summary(runs, batch, args.new_tokens, flops) for label, runs in ours.items()},
    }
    if hf is not None:
        result["transformers"] = _summary(theirs, batch, args.new_tokens, flops)
        n, h = result["nxdi"], result["transformers"]
        result["ratio_hf_over_nxdi"] = {
            "tpot_p50": h["tpot_ms"]["p50"] / n["tpot_ms"]["p50"],
            "ttft": h["ttft_ms"] / n["ttft_ms"],
            "throughput": n["throughput_tok_s"] / h["throughput_tok_s"],
        }
    return result


def render(results: list[dict[str, Any]]) -> str:
    """A table of the results (one block per batch size)."""
    lines = []
    for r in results:
        lines.append(f"batch {r['batch_size']}, tp_degree {r.get('tp_degree', 1)}, backend {r.get('backend', 'cpu')}:")
        if "compile_s_per_program" in r:
            lines.append(
                f"  per program: compile() {r['compile_s_per_program']:.2f} s, load() {r['load_s_per_program']:.2f} s"
            )
        for side in ("nxdi", "transformers"):
            if side in r:
                s = r[side]
                t = s["tpot_ms"]
                lines.append(
                    f"  {side:<12} TTFT {s['ttft_ms']:8.1f} ms ({s['prefill_tflop_s']:5.2f} TFLOP/s)   TPOT p50/p90/p99 {t['p50']:7.2f}/{t['p90']:7.2f}/{t['p99']:7.2f} ms"
                    f"   decode {s['decode_tok_s_per_seq']:6.1f} tok/s/seq   generate() {s['throughput_tok_s']:7.1f} tok/s"
                )
        c = r["nxdi"].get("collectives")
        if c is not None:
            calls = ", ".join(f"{n} {v:g}" for n, v in c["calls_per_step"].items())
            lines.append(
                f"  collectives per decode step and rank: {calls} calls, {c['total_ms_per_step']:.2f} ms"
                f" ({100 * c['total_ms_per_step'] / r['nxdi']['tpot_ms']['p50']:.0f}% of the p50 TPOT)"
            )
        if "ratio_hf_over_nxdi" in r:
            q = r["ratio_hf_over_nxdi"]
            lines.append(
                f"  ratio (transformers / nxdi): TPOT {q['tpot_p50']:.2f}x   TTFT {q['ttft']:.2f}x   throughput {q['throughput']:.2f}x"
            )
        if "async_mode" in r:
            from nxdi.shell.cli import bench_async

            lines.extend(bench_async.render(r["async_mode"]))
    return "\n".join(lines)


def benchmark_model(model: Any, *, prompt_len: int, new_tokens: int, repeat: int = 3) -> list[dict[str, Any]]:
    """TTFT / TPOT / throughput of an already loaded model (used by `nxdi run --benchmark`)."""
    import torch

    ids = prompt(model, model.spec.batch_size, prompt_len)
    runs = []
    with torch.inference_mode():
        for _ in range(repeat):
            run = _nxdi_once(model, ids, new_tokens)
            run["total"] = nxdi_generate_s(model, ids, new_tokens)
            runs.append(run)
    batch = model.spec.batch_size
    flops = roofline.prefill_flops(model.model_spec, batch=batch, prompt_len=prompt_len)
    return [{"batch_size": batch, "nxdi": _summary(runs, batch, new_tokens, flops)}]


def run(args: argparse.Namespace) -> int:
    import torch

    from nxdi.shell.cli import bench_models

    if args.lora is not None or args.lora_rank is not None:
        from nxdi.shell.cli import bench_lora

        args.dtype = args.dtype or "bfloat16"
        return bench_lora.run(args)
    args.batch_size = [1] if args.batch_size is None else args.batch_size
    if args.speculation is not None:
        from nxdi.shell.cli import bench_speculation

        args.dtype = args.dtype or "float32"  # the trained pair's own dtype: greedy tokens are compared
        return bench_speculation.run(args)
    args.dtype = args.dtype or "bfloat16"
    args.prompt_len = 128 if args.prompt_len is None else args.prompt_len
    args.new_tokens = 128 if args.new_tokens is None else args.new_tokens
    torch.set_num_threads(args.threads)
    path = bench_models.checkpoint_for(args)
    hf = None
    if args.compare_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    results = [
        _bench_batch(path, args, b, hf, tp, backend)
        for backend in args.backend
        for tp in args.tp_degree
        for b in args.batch_size
    ]
    print(json.dumps(results, indent=2) if args.json else render(results))
    return 0

"""`nxdi bench roofline`: the decode roofline of a model on this machine, next to nxdi's and transformers' TPOT.

    nxdi bench roofline [--model-type llama] [--shape small|tiny|toy | --model-path DIR] [--dtype bfloat16]
                        [--batch-size 1 4] [--weights dtype|int8-per-channel|...]
                        [--modules-to-not-convert NAME ...] [--paired-steps 100] [--prompt-len 128]
                        [--new-tokens 128] [--repeat 3] [--threads 2] [--bandwidth-mib 1024] [--skip-hf] [--json]

A decode step is memory bound: it reads every weight once and each sequence's KV cache. Its
roofline is `bytes per step / memory bandwidth`, the fastest any implementation can decode here.
- Bandwidth: measured in this process with `--threads` intra-op threads (the benchmark's): float32
  `sum()` and `amax()` over a `--bandwidth-mib` buffer, alternating, 5 rounds
  (`nxdi.effects.bandwidth`), before the models are loaded and again after each batch size's runs.
  Other jobs on the machine only ever lower a sample, so the roofline uses the best sample of them
  all; the median is shown beside it.
- Bytes per step: `nxdi.core.planning.roofline.decode_step_bytes` (every weight but the gathered
  embedding rows, a tied lm_head once; the KV cache read at the median decode step's context,
  `--prompt-len + --new-tokens // 2` positions per sequence, and one position written).
- TPOT: `nxdi bench generate --compare-hf`'s measurement (`bench_generate.bench_side_by_side`):
  greedy decoding of `--new-tokens` tokens from a random `--prompt-len` prompt, nxdi and
  transformers alternating `--repeat` times in this process; the p50 of every decode step.
Each TPOT is shown as a share of the roofline (roofline time / measured time: 100% would be
decoding at the measured bandwidth) and as the bandwidth it implies (bytes per step / TPOT).

`--weights int8-per-channel` (or `int8-per-tensor`, `fp8-per-channel`) computes the roofline of
quantized linears (1 byte per value plus float32 scales) and measures nxdi with `quantized=True` on
a quantized checkpoint written once into `--work-dir` by `save_quantized_state_dict`. As with
`quantized=True` itself, every linear is quantized, lm_head included, unless
`--modules-to-not-convert` names it (NeuronConfig's `modules_to_not_convert`: a linear whose module
path contains an entry stays in `--dtype`, in the model and in the roofline alike). In the same alternation it
measures nxdi on the unquantized checkpoint (`nxdi_unquantized`) and transformers (unless
`--skip-hf`), both reading `--dtype` weights: the quantized model's speed-up over each is a ratio
of one run. Each side's share of the roofline is against the roofline of the weights it reads.
Beside that ratio of two runs, the two nxdi models then decode with their steps interleaved one by
one, `--paired-steps` pairs (100 by default), and the median and quartiles of the per-pair ratio are
printed: on a shared machine, whose speed drifts within seconds, it moves far less.

Likewise each nxdi model's share of the roofline is also taken at the same moments as the read it
is measured against: its decode steps interleaved with `sum()`/`amax()` over a float32 buffer of its
step's bytes (`bench_pairs`), `--paired-steps` pairs, the share being the read's time over the
step's. The roofline above uses the best bandwidth sample of the run, a quiet moment the decode runs
may never see; this share compares each step with a read of the same bytes one step away.

Where the CPU engine refuses `quantized=True`, the rooflines alone are printed, with the reason.

(Over 400 lines: the flags, the measurements and the JSON and text reports read one set of keys.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

# --weights -> (NeuronConfig quantization_dtype, per-channel scales); "dtype" is --dtype, unquantized.
WEIGHTS: dict[str, tuple[str, bool] | None] = {
    "dtype": None,
    "int8-per-channel": ("int8", True),
    "int8-per-tensor": ("int8", False),
    "fp8-per-channel": ("f8e4m3", True),
}
_BANDWIDTH_REPEAT = 5
_PAIRED_STEPS = 100


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from nxdi.shell.cli.bench_generate import add_model_args

    p = sub.add_parser(
        "roofline",
        help="decode roofline (bytes per step / measured bandwidth) vs nxdi's and transformers' TPOT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_model_args(p)
    p.add_argument("--weights", choices=list(WEIGHTS), default="dtype", help="weight storage (dtype: --dtype)")
    p.add_argument(
        "--modules-to-not-convert",
        nargs="+",
        default=[],
        metavar="NAME",
        help="with quantized --weights: linears kept in --dtype (module path contains NAME, e.g. lm_head)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per side (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer streamed to measure the bandwidth")
    p.add_argument(
        "--paired-steps",
        type=int,
        default=None,
        help="pairs of interleaved steps: each nxdi model's decode step with a read of its bytes, and with"
        " quantized --weights the two nxdi models' steps (default 100, 0: none)",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not measure transformers")
    p.add_argument("--work-dir", default=".nxdi-bench", help="random checkpoints and compiled models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def _check_flags(args: argparse.Namespace) -> None:
    """Raises UsageError listing every flag out of range, before anything is built or measured."""
    from nxdi.shell.cli.errors import UsageError

    low = [
        f"{flag} must be >= {least}, got {value}"
        for flag, value, least in (
            ("--batch-size", min(args.batch_size), 1),
            ("--prompt-len", args.prompt_len, 1),
            ("--new-tokens", args.new_tokens, 2),  # one decode step at least (the first token is the prefill's)
            ("--repeat", args.repeat, 1),
            ("--threads", args.threads, 1),
            ("--bandwidth-mib", args.bandwidth_mib, 1),
        )
        if value < least
    ]
    if WEIGHTS[args.weights] is None and args.modules_to_not_convert:
        low.append("--modules-to-not-convert needs quantized --weights (int8-per-channel, ...); nothing is quantized")
    if args.paired_steps is not None and args.paired_steps < 0:
        low.append(f"--paired-steps must be >= 0, got {args.paired_steps}")
    if low:
        raise UsageError("; ".join(low))


def model_spec_of(path: Path, dtype: str) -> Any:
    """The ModelSpec of the checkpoint at `path` (UsageError for a model_type the engine does not run)."""
    from nxdi.shell.cli.errors import UsageError
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, model_type_of

    try:
        cls = MODEL_TYPES[model_type_of(path)]["causal-lm"]
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    return cls.get_config_cls()(
        cls.get_neuron_config_cls()(torch_dtype=dtype), load_config=load_pretrained_config(path)
    ).model_spec()


def quantized_skip_reason() -> str | None:
    """Why nxdi cannot be measured with quantized weights here, or None when it can."""
    from nxdi.core.config.fields import OnCpu, info_of
    from nxdi.core.config.neuron_spec import NeuronSpec

    if info_of(NeuronSpec, "quantized").cpu is OnCpu.REFUSED:
        return "the CPU engine refuses quantized=True yet"
    return None


def quantization_kwargs(path: Path, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """NeuronConfig kwargs for `--weights` (None for unquantized weights) and the compiled folder's tag.
    `--modules-to-not-convert` stay in `--dtype`, as the roofline counts them; the quantized checkpoint
    (one per set of kept modules) goes in `--work-dir`."""
    quant = WEIGHTS[args.weights]
    if quant is None:
        return None, ""
    dtype, per_channel = quant
    kind = "per_channel_symmetric" if per_channel else "per_tensor_symmetric"
    kept = tuple(args.modules_to_not_convert)
    # what is kept is in the name, always: a file of another set (or an older bench's) is not reused
    tag = f"-{args.weights}-keep-" + ("-".join(_safe(m) for m in kept) or "none")
    return {
        "quantized": True,
        "quantized_checkpoints_path": str(Path(args.work_dir) / f"quantized-{path.name}-{args.dtype}{tag}.pt"),
        "quantization_type": kind,
        "quantization_dtype": dtype,
        "modules_to_not_convert": list(kept) or None,
    }, tag


def _safe(module: str) -> str:
    """A module name as part of a file name."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in module)


def _context(args: argparse.Namespace) -> int:
    """Positions each sequence's KV cache holds at the median decode step."""
    return args.prompt_len + args.new_tokens // 2


def _step_bytes(model_spec: Any, args: argparse.Namespace, batch: int, weights: str) -> Any:
    """The bytes of one decode step at `batch` with `weights` (a `--weights` choice): a StepBytes."""
    from nxdi.core.planning import roofline
    from nxdi.shell.exceptions import unwrap

    quant = WEIGHTS[weights]
    return unwrap(
        roofline.decode_step_bytes(
            model_spec,
            dtype=args.dtype,
            batch=batch,
            context=_context(args),
            weight_quant_dtype=quant[0] if quant else None,
            per_channel_scales=quant[1] if quant else True,
            modules_to_not_convert=tuple(args.modules_to_not_convert) if quant else (),
        ),
        "Cannot compute the decode roofline",
    )


def _step(model_spec: Any, args: argparse.Namespace, batch: int, bandwidth: float, weights: str) -> dict[str, Any]:
    """The roofline of one batch size with `weights` (a `--weights` choice), as a JSON-ready dict."""
    from nxdi.core.planning import roofline

    step = _step_bytes(model_spec, args, batch, weights)
    line = roofline.Roofline(step_bytes=step, bandwidth_bytes_per_s=bandwidth, batch=batch)
    return {
        "batch_size": batch,
        "context": _context(args),
        "step_bytes": {k: getattr(step, k) for k in ("weight_bytes", "kv_read_bytes", "kv_write_bytes")},
        "total_bytes": step.total_bytes,
        "roofline": {
            "ms_per_step": 1e3 * line.step_s,
            "tok_s_per_seq": 1.0 / line.step_s,
            "tok_s": line.tokens_per_s,
        },
    }


def _against(roof: dict[str, Any], tpot_ms: float) -> dict[str, float]:
    """A measured TPOT against the roofline: share of it reached, and the bandwidth it implies."""
    return {
        "tpot_ms_p50": tpot_ms,
        "pct_of_roofline": 100 * roof["roofline"]["ms_per_step"] / tpot_ms,
        "effective_gb_s": roof["total_bytes"] / (tpot_ms / 1e3) / 1e9,
    }


SIDES = ("nxdi", "nxdi_unquantized", "transformers")
"""The measured sides, in the report's order (`nxdi_unquantized` only with `--weights`)."""


class Measured(NamedTuple):
    """One batch size's measurements: each side's TPOT p50 in ms; with quantized weights, the
    per-pair ratios of the two nxdi models' interleaved steps (unquantized over quantized); and each
    nxdi side's per-pair share of the roofline (a read of its step's bytes over its step)."""

    tpots: dict[str, float]
    paired: list[float]
    shares: dict[str, list[float]]


def _measure(path: Path, args: argparse.Namespace, batch: int, hf: Any, step_bytes: dict[str, int]) -> Measured:
    """Each side measured side by side in this process, then the interleaved pairs (`bench_pairs`);
    `step_bytes`: each nxdi side's bytes per decode step."""
    from nxdi.effects import bandwidth
    from nxdi.shell.cli import bench_generate, bench_pairs

    def load(extra: dict[str, Any] | None, tag: str) -> Any:
        model_type, compiled, _ = bench_generate.compile_for(path, args, batch, 1, "cpu", extra=extra, tag=tag)
        return bench_generate.load_compiled(model_type, compiled, "cpu")

    def steps(model: Any) -> bench_pairs.Timer:
        return bench_pairs.DecodeSteps(model, batch, args.prompt_len, args.new_tokens)

    extra, tag = quantization_kwargs(path, args)
    pairs = _PAIRED_STEPS if args.paired_steps is None else args.paired_steps
    with contextlib.ExitStack() as stack:
        models = {"nxdi": stack.enter_context(load(extra, tag))}
        if extra is not None:
            models["nxdi_unquantized"] = stack.enter_context(load(None, ""))
        others = {side: m for side, m in models.items() if side != "nxdi"}
        measured = bench_generate.bench_side_by_side(models["nxdi"], args, batch, hf, 1, others=others)
        tpots = {side: measured[side]["tpot_ms"]["p50"] for side in SIDES if side in measured}
        if not pairs:
            return Measured(tpots, [], {})
        print(f"[bench] batch {batch}: {pairs} pairs of interleaved steps ...", flush=True)
        paired = []
        if others:
            paired = bench_pairs.paired(steps(models["nxdi"]), steps(others["nxdi_unquantized"]), pairs)
        shares = {
            side: bench_pairs.paired(steps(m), bandwidth.read_timer(step_bytes[side]), pairs)
            for side, m in models.items()
        }
    return Measured(tpots, paired, shares)


def _quartiles(ratios: list[float], scale: float = 1.0) -> dict[str, Any]:
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"steps": len(ratios), "median": scale * median, "q1": scale * q1, "q3": scale * q3}


def _with_tpots(roof: dict[str, Any], float_roof: dict[str, Any] | None, measured: Measured) -> dict[str, Any]:
    """The roofline with each side's TPOT against the roofline of the weights it reads (`float_roof`:
    that of `--dtype` weights when nxdi's are quantized, else None), nxdi's speed-ups over the other
    sides, and the summaries of the interleaved pairs (when any)."""
    others, tpots = float_roof or roof, measured.tpots
    out = {**roof, **{side: _against(roof if side == "nxdi" else others, ms) for side, ms in tpots.items()}}
    for side, shares in measured.shares.items():
        out[side]["paired_pct_of_roofline"] = _quartiles(shares, 100.0)
    if float_roof is not None:
        out["float_roofline"] = float_roof["roofline"]
    if "nxdi" in tpots:
        for side, key in (("transformers", "ratio_hf_over_nxdi"), ("nxdi_unquantized", "ratio_unquantized_over_nxdi")):
            if side in tpots:
                out[key] = tpots[side] / tpots["nxdi"]
    if measured.paired:
        out["paired_unquantized_over_nxdi"] = _quartiles(measured.paired)
    return out


def _bandwidth(args: argparse.Namespace) -> Any:
    from nxdi.effects import bandwidth

    print(f"[bench] measuring the read bandwidth ({args.bandwidth_mib} MiB, threads {args.threads}) ...", flush=True)
    return bandwidth.measure_read_bandwidth(buffer_bytes=args.bandwidth_mib << 20, repeat=_BANDWIDTH_REPEAT)


def _bench_run(args: argparse.Namespace) -> dict[str, Any]:
    """Bandwidth before the models and after each batch size (other jobs on the machine only ever
    lower a sample, so the best of them all is the machine's), the TPOTs, then the rooflines."""
    import torch

    from nxdi.shell.cli import bench_models

    path = bench_models.checkpoint_for(args)
    model_spec = model_spec_of(path, args.dtype)
    quantized = WEIGHTS[args.weights] is not None
    skipped = quantized_skip_reason() if quantized else None
    bw = _bandwidth(args)
    measured = {b: Measured({}, [], {}) for b in args.batch_size}
    if skipped is None:
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        for b in args.batch_size:
            step_bytes = {"nxdi": _step_bytes(model_spec, args, b, args.weights).total_bytes}
            if quantized:
                step_bytes["nxdi_unquantized"] = _step_bytes(model_spec, args, b, "dtype").total_bytes
            measured[b] = _measure(path, args, b, hf, step_bytes)
            bw = bw.merged(_bandwidth(args))
    results = [
        _with_tpots(
            _step(model_spec, args, b, bw.best, args.weights),
            _step(model_spec, args, b, bw.best, "dtype") if quantized else None,
            measured[b],
        )
        for b in args.batch_size
    ]
    doc = {
        "model": str(path),
        "dtype": args.dtype,
        "weights": args.weights,
        "modules_to_not_convert": list(args.modules_to_not_convert),
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "bandwidth": bw.to_dict(),
        "results": results,
    }
    return doc if skipped is None else {**doc, "not_measured": skipped}


def render(doc: dict[str, Any]) -> str:
    """The report as text."""
    b = doc["bandwidth"]
    kept = doc["modules_to_not_convert"]
    elsewhere = f"{doc['dtype']} for norms{', ' + ', '.join(kept) if kept else ''}"
    weights = doc["dtype"] if doc["weights"] == "dtype" else f"{doc['weights']} ({elsewhere})"
    lines = [
        f"{doc['model']}: {weights} weights, {doc['prompt_len']}-token prompt + {doc['new_tokens']} new tokens, "
        f"threads {doc['threads']}",
        f"  read bandwidth (float32 sum/amax over {b['buffer_mib']:g} MiB, threads {b['threads']},"
        f" {b['samples']} samples): "
        f"best {b['best_gb_s']:.1f} GB/s, median {b['median_gb_s']:.1f} GB/s",
    ]
    for r in doc["results"]:
        s, roof = r["step_bytes"], r["roofline"]
        lines += [
            f"batch {r['batch_size']}, context {r['context']} (the median decode step):",
            f"  bytes per decode step {r['total_bytes'] / 1e6:.1f} MB = weights {s['weight_bytes'] / 1e6:.1f}"
            f" + KV read {s['kv_read_bytes'] / 1e6:.2f} + KV write {s['kv_write_bytes'] / 1e6:.3f} MB",
            f"  roofline at {b['best_gb_s']:.1f} GB/s: {roof['ms_per_step']:.3g} ms/step,"
            f" {roof['tok_s_per_seq']:.1f} tok/s/seq, {roof['tok_s']:.1f} tok/s",
        ]
        if "float_roofline" in r:
            lines.append(
                f"  roofline of {doc['dtype']} weights: {r['float_roofline']['ms_per_step']:.3g} ms/step"
                " (the share the unquantized sides reach is of this one)"
            )
        labels = {"nxdi_unquantized": f"nxdi, {doc['dtype']}"}
        for side in SIDES:
            if side in r:
                m = r[side]
                lines.append(
                    f"  {labels.get(side, side):<15} TPOT p50 {m['tpot_ms_p50']:7.2f} ms"
                    f"   {m['pct_of_roofline']:5.1f}% of roofline   (reads at {m['effective_gb_s']:.1f} GB/s)"
                )
                if "paired_pct_of_roofline" in m:
                    p = m["paired_pct_of_roofline"]
                    lines.append(
                        f"  {'':<15} at the moments of a read of its step's bytes ({p['steps']} pairs):"
                        f" {p['median']:.1f}% (quartiles {p['q1']:.1f}-{p['q3']:.1f}%)"
                    )
        if "ratio_hf_over_nxdi" in r:
            lines.append(f"  ratio (transformers / nxdi): TPOT {r['ratio_hf_over_nxdi']:.2f}x")
        if "ratio_unquantized_over_nxdi" in r:
            lines.append(
                f"  ratio (nxdi {doc['dtype']} weights / nxdi {doc['weights']}): TPOT {r['ratio_unquantized_over_nxdi']:.2f}x"
            )
        if "paired_unquantized_over_nxdi" in r:
            p = r["paired_unquantized_over_nxdi"]
            lines.append(
                f"  the same, decode steps interleaved ({p['steps']} pairs): median {p['median']:.2f}x"
                f" (quartiles {p['q1']:.2f}-{p['q3']:.2f}x)"
            )
    if "not_measured" in doc:
        lines.append(f"nothing measured: {doc['not_measured']} (rooflines only)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Check the flags, measure, print the report (exit 2 with one message on bad flags)."""
    import torch

    _check_flags(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        doc = _bench_run(args)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0

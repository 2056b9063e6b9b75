"""`nxdi bench serve`: a synthetic request stream served with continuous batching, vs transformers.

    nxdi bench serve [--model-type llama] [--shape small|tiny|toy | --model-path DIR] [--dtype bfloat16]
                     [--num-requests 32] [--rate 4] [--prompt-len 16 128] [--output-len 16 64]
                     [--batch-size 8] [--seed 0] [--threads 2] [--skip-hf] [--json]

Workload: `--num-requests` requests arrive as a Poisson process of `--rate` requests per second
(exponential gaps from a seeded RNG; `--rate inf` sends them all at once); prompt and output
lengths are drawn uniformly from the `--prompt-len` and `--output-len` ranges, prompt ids uniformly
from the vocabulary. Every request generates exactly its output length (EOS never stops it).

Clock: virtual. Busy time is real wall-clock time; when a server has nothing to do (no running
request, the next one not yet arrived) the clock jumps to the next arrival instead of sleeping, so a
low rate costs no waiting. A token's time is when it was computed (streaming), on every side.

Servers, in turn, on the same checkpoint and requests, in one process:
- nxdi, continuous batching, exactly as a serving client drives forward(): `batch_size` cache slots,
  `is_continuous_batching=True`, `ctx_batch_size=1`, bucketing on, greedy by on-device sampling with
  top_k=1. Each arrived request, while a slot is free, is admitted by one prefill call
  (`input_ids [1, L]`, `position_ids arange(L)[None]`, `seq_ids [slot]`); then one decode call runs
  every running slot (`input_ids [R, 1]`, `position_ids [R, 1]`, `seq_ids [R]`); a finished request
  frees its slot for the next one.
- transformers, request by request: `generate()` (greedy, dynamic cache) for each request in
  arrival order, each starting when the previous is done and the request has arrived.
- transformers, static batches: requests grouped by arrival into batches of `--batch-size`,
  left-padded; a batch starts when the previous is done and its last request has arrived, and
  generates the longest output of the batch.
Metrics: throughput = generated tokens / (last token time - first arrival); TTFT = arrival -> first
token; TPOT = (last token - first token) / (output length - 1), per request; p50 and p99 over
requests (nearest rank). Ratios are nxdi's advantage: throughput nxdi / transformers, latencies
transformers / nxdi (above 1: nxdi is better). The report also says how many requests got the same
greedy tokens from nxdi as from transformers request by request (all of them in float32; bfloat16
rounding may flip a near tie).

(Over 400 lines: the workload, the three servers and the report share one request record and one
virtual clock.)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from nxdi.shell.cli import bench_models


@attrs.frozen(kw_only=True)
class Request:
    """One synthetic request: when it arrives (virtual seconds), its prompt ids and output length."""

    index: int
    arrival: float
    prompt: tuple[int, ...]
    output_len: int


@attrs.define
class Served:
    """What a server produced for one request: its tokens and when each was computed (virtual s)."""

    request: Request
    tokens: list[int] = attrs.Factory(list)
    times: list[float] = attrs.Factory(list)


class VirtualClock:
    """Wall-clock seconds since the start, plus the idle time skipped (see the module docstring)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._start + self._skipped

    def wait_until(self, t: float) -> None:
        """Skip (not sleep) to virtual time `t` if it is still ahead."""
        self._skipped += max(0.0, t - self.now())


def make_requests(
    *, n: int, rate: float, prompt_len: Sequence[int], output_len: Sequence[int], vocab: int, seed: int
) -> list[Request]:
    """`n` requests with Poisson arrivals at `rate`/s (all at 0 for an infinite rate), uniform lengths and ids.

    Raises:
        ValueError: n < 1, rate <= 0, or a length range that is empty or starts below 1.
    """
    (p_lo, p_hi), (o_lo, o_hi) = prompt_len, output_len
    if n < 1 or not rate > 0 or not 1 <= p_lo <= p_hi or not 1 <= o_lo <= o_hi:
        raise ValueError(f"need n >= 1, rate > 0 and ranges 1 <= lo <= hi; got {n}, {rate}, {prompt_len}, {output_len}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        length = rng.randint(p_lo, p_hi)
        prompt = tuple(rng.randrange(3, vocab) for _ in range(length))  # ids 0-2: pad, bos, eos
        out.append(Request(index=i, arrival=t, prompt=prompt, output_len=rng.randint(o_lo, o_hi)))
    return out


def serve_nxdi(model: Any, requests: Sequence[Request], clock: VirtualClock) -> list[Served]:
    """Continuous batching through `model.forward` (see the module docstring); one `Served` per request."""
    import torch

    slots = model.spec.batch_size
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival))
    free = list(range(slots))
    running: dict[int, Served] = {}
    done: list[Served] = []

    def finish_if_done(slot: int) -> None:
        served = running[slot]
        if len(served.tokens) == served.request.output_len:
            done.append(running.pop(slot))
            free.append(slot)

    model.reset()
    while pending or running:
        if not running:
            clock.wait_until(pending[0].arrival)
        while pending and free and pending[0].arrival <= clock.now():
            request, slot = pending.popleft(), min(free)
            free.remove(slot)
            n = len(request.prompt)
            out = model.forward(
                input_ids=torch.tensor([request.prompt]),
                position_ids=torch.arange(n)[None],
                seq_ids=torch.tensor([slot]),
            )
            running[slot] = Served(request=request, tokens=[int(out.tokens[0])], times=[clock.now()])
            finish_if_done(slot)
        if not running:
            continue
        order = sorted(running)
        last = [running[s].tokens[-1] for s in order]
        positions = [len(running[s].request.prompt) + len(running[s].tokens) - 1 for s in order]
        out = model.forward(
            input_ids=torch.tensor(last)[:, None],
            position_ids=torch.tensor(positions)[:, None],
            seq_ids=torch.tensor(order),
        )
        now = clock.now()
        for row, slot in enumerate(order):
            running[slot].tokens.append(int(out.tokens[row]))
            running[slot].times.append(now)
            finish_if_done(slot)
    return sorted(done, key=lambda s: s.request.index)


def _hf_generate(
    hf: Any, prompts: Sequence[Sequence[int]], new_tokens: int, clock: VirtualClock
) -> tuple[Any, list[float]]:
    """Greedy `generate()` of exactly `new_tokens` tokens for left-padded `prompts`; the new ids and step times."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stamps: list[float] = []

    def stamp(input_ids: Any, scores: Any) -> Any:
        stamps.append(clock.now())
        return scores

    # No EOS: exactly new_tokens tokens, with no min-length processor to change the greedy choice.
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None, bos_token_id=None
    )
    out = hf.generate(ids, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([stamp]))
    return out[:, width:], stamps


def serve_hf_sequential(hf: Any, requests: Sequence[Request], clock: VirtualClock) -> list[Served]:
    """transformers, one request at a time in arrival order."""
    served = []
    for r in sorted(requests, key=lambda r: r.arrival):
        clock.wait_until(r.arrival)
        new, stamps = _hf_generate(hf, [r.prompt], r.output_len, clock)
        served.append(Served(request=r, tokens=new[0].tolist(), times=stamps))
    return sorted(served, key=lambda s: s.request.index)


def serve_hf_static(hf: Any, requests: Sequence[Request], clock: VirtualClock, batch: int) -> list[Served]:
    """transformers, static batches of `batch` requests in arrival order, padded to the longest prompt and output."""
    ordered = sorted(requests, key=lambda r: r.arrival)
    served = []
    for start in range(0, len(ordered), batch):
        group = ordered[start : start + batch]
        clock.wait_until(group[-1].arrival)
        new, stamps = _hf_generate(hf, [r.prompt for r in group], max(r.output_len for r in group), clock)
        for row, r in enumerate(group):
            served.append(Served(request=r, tokens=new[row, : r.output_len].tolist(), times=stamps[: r.output_len]))
    return sorted(served, key=lambda s: s.request.index)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value >= q% of the values (NaN when there are none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(served: Sequence[Served]) -> dict[str, Any]:
    """Throughput, TTFT and TPOT of one server (see the module docstring), in tok/s and ms."""
    tokens = sum(len(s.tokens) for s in served)
    first_arrival = min(s.request.arrival for s in served)
    duration = max(s.times[-1] for s in served) - first_arrival
    ttft = [s.times[0] - s.request.arrival for s in served]
    tpot = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in served if len(s.times) > 1]
    return {
        "requests": len(served),
        "generated_tokens": tokens,
        "duration_s": duration,
        "throughput_tok_s": tokens / duration if duration > 0 else math.inf,
        "ttft_ms": {q: 1e3 * _percentile(ttft, float(q[1:])) for q in ("p50", "p99")},
        "tpot_ms": {q: 1e3 * _percentile(tpot, float(q[1:])) for q in ("p50", "p99")},
    }


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """nxdi's advantage: throughput nxdi / transformers, latencies transformers / nxdi."""
    return {
        "throughput": ours["throughput_tok_s"] / theirs["throughput_tok_s"],
        **{f"ttft_{q}": theirs["ttft_ms"][q] / ours["ttft_ms"][q] for q in ("p50", "p99")},
        **{f"tpot_{q}": theirs["tpot_ms"][q] / ours["tpot_ms"][q] for q in ("p50", "p99")},
    }


SIDES = ("nxdi_continuous", "hf_sequential", "hf_static")
"""Report keys of the three servers."""


def serving_model(path: Path, args: argparse.Namespace) -> Any:
    """The nxdi model a continuous-batching client serves: compiled into `--work-dir` (reused), loaded."""
    from nxdi.shell.config import OnDeviceSamplingConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, model_type_of

    cls = MODEL_TYPES[model_type_of(str(path))]["causal-lm"]
    max_prompt, max_output = args.prompt_len[1], args.output_len[1]
    neuron = cls.get_neuron_config_cls()(  # MoENeuronConfig for a mixture of experts
        batch_size=args.batch_size,
        ctx_batch_size=1,
        is_continuous_batching=True,
        max_context_length=max_prompt,
        seq_len=max_prompt + max_output,
        enable_bucketing=True,
        torch_dtype=args.dtype,
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
    )
    config = cls.get_config_cls()(neuron, load_config=load_pretrained_config(path))
    compiled = Path(args.work_dir) / f"serve-{path.name}-{args.dtype}-b{args.batch_size}-{max_prompt}-{max_output}"
    cls(path, config).compile(compiled)
    model = cls(compiled)
    model.load(compiled)
    return model


def _timed(name: str, serve: Callable[[VirtualClock], list[Served]]) -> list[Served]:
    print(f"[bench] serving with {name} ...", flush=True)
    return serve(VirtualClock())


def bench(model: Any, hf: Any | None, requests: Sequence[Request], batch: int) -> dict[str, Any]:
    """Serve `requests` on every side (after a warm-up of each) and compare; see the module docstring."""
    import torch

    warm = [attrs.evolve(r, arrival=0.0, output_len=min(r.output_len, 4)) for r in requests[:batch]]
    results: dict[str, list[Served]] = {}
    with torch.inference_mode():
        serve_nxdi(model, warm, VirtualClock())
        results["nxdi_continuous"] = _timed("nxdi (continuous batching)", lambda c: serve_nxdi(model, requests, c))
        if hf is not None:
            serve_hf_static(hf, warm, VirtualClock(), batch)
            results["hf_sequential"] = _timed(
                "transformers (request by request)", lambda c: serve_hf_sequential(hf, requests, c)
            )
            results["hf_static"] = _timed(
                "transformers (static batches)", lambda c: serve_hf_static(hf, requests, c, batch)
            )
    report: dict[str, Any] = {name: summarize(served) for name, served in results.items()}
    if hf is not None:
        ours = results["nxdi_continuous"]
        report["ratios_nxdi_advantage"] = {
            side: _ratios(report["nxdi_continuous"], report[side]) for side in ("hf_sequential", "hf_static")
        }
        same = sum(a.tokens == b.tokens for a, b in zip(ours, results["hf_sequential"], strict=True))
        report["tokens_equal_to_hf_sequential"] = {"requests": same, "of": len(requests)}
    return report


def render(doc: dict[str, Any]) -> str:
    """The report as text: the workload, one line per server, the ratios."""
    w = doc["workload"]
    lines = [
        f"{w['requests']} requests, Poisson {w['rate']}/s, prompt {w['prompt_len'][0]}-{w['prompt_len'][1]}, "
        f"output {w['output_len'][0]}-{w['output_len'][1]} tokens, {w['batch_size']} slots, seed {w['seed']}, "
        f"{doc['dtype']}, {doc['model']} (clock: {doc['clock']})",
    ]
    names = {"nxdi_continuous": "nxdi continuous", "hf_sequential": "hf one by one", "hf_static": "hf static batch"}
    for side in SIDES:
        if side in doc:
            s, a, b = doc[side], doc[side]["ttft_ms"], doc[side]["tpot_ms"]
            lines.append(
                f"  {names[side]:<16} {s['throughput_tok_s']:8.1f} tok/s  TTFT p50/p99 {a['p50']:8.1f}/{a['p99']:8.1f} ms"
                f"  TPOT p50/p99 {b['p50']:7.2f}/{b['p99']:7.2f} ms  ({s['generated_tokens']} tokens, {s['duration_s']:.2f} s)"
            )
    for side, q in doc.get("ratios_nxdi_advantage", {}).items():
        lines.append(
            f"  nxdi vs {names[side]:<16} throughput {q['throughput']:.2f}x  TTFT p50 {q['ttft_p50']:.2f}x"
            f" p99 {q['ttft_p99']:.2f}x  TPOT p50 {q['tpot_p50']:.2f}x p99 {q['tpot_p99']:.2f}x"
        )
    same = doc.get("tokens_equal_to_hf_sequential")
    if same is not None:
        lines.append(f"  greedy tokens equal to transformers': {same['requests']} of {same['of']} requests")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="continuous-batching serving of a Poisson request stream, vs transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    bench_models.add_checkpoint_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (inf: all at once)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=8, help="cache slots (nxdi) and static batch size (transformers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true", help="serve with nxdi only")
    p.add_argument("--work-dir", default=".nxdi-bench", help="random checkpoints and compiled models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Build (or take) the checkpoint, serve the stream on every side, print the report; 2 on bad flags."""
    import torch

    try:  # the flags' own problems, before minutes of building and compiling
        make_requests(
            n=args.num_requests, rate=args.rate, prompt_len=args.prompt_len, output_len=args.output_len, vocab=4, seed=0
        )
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    except ValueError as e:
        print(f"nxdi bench serve: {e}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        doc = _bench_run(args)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def _bench_run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    path = bench_models.checkpoint_for(args)
    model = serving_model(path, args)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    requests = make_requests(
        n=args.num_requests,
        rate=args.rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        vocab=model.model_spec.vocab_size,
        seed=args.seed,
    )
    with model:
        report = bench(model, hf, requests, args.batch_size)
    workload = {
        "requests": args.num_requests,
        "rate": args.rate if math.isfinite(args.rate) else "inf",
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "batch_size": args.batch_size,
        "seed": args.seed,
    }
    clock = "virtual (idle time skipped, busy time is wall-clock)"
    return {"model": str(path), "dtype": args.dtype, "clock": clock, "workload": workload, **report}

"""`nxdi bench generate --async`: async_mode against synchronous mode on one compiled folder.

Each mode's model lives in a child process of its own, as a server's would, and the parent asks
them in turn (alternating runs, so machine noise hits both): a process running parallel torch work
on two threads pays for it on the cpu backend (see `nxdi.shell.async_forward`), so the two models
must not share one. Each run is a serving-style decode loop (`_decode_loop`) and a generate().
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from nxdi.shell.cli.bench_generate import compile_for, load_compiled, nxdi_generate_s, prompt

MODES = ("sync", "async")


def _decode_loop(model: Any, ids: Any, new_tokens: int, host_ms: float) -> dict[str, Any]:
    """A serving-style greedy decode loop: every step's seconds, its forward() call's, and the tokens.
    The host's part of a step reads the tokens, then spends `host_ms` in a sleep."""
    import torch

    model.reset()
    tokens = model(ids).tokens
    positions = torch.full((ids.shape[0], 1), ids.shape[1], dtype=torch.int64)
    steps, calls, seen = [], [], [tokens.tolist()]
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        out = model(tokens[:, None], position_ids=positions)
        called = time.perf_counter()
        tokens, positions = out.tokens, positions + 1
        seen.append(tokens.tolist())
        if host_ms:
            time.sleep(host_ms / 1e3)
        steps.append(time.perf_counter() - t)
        calls.append(called - t)
    return {"step": steps, "call": calls, "tokens": seen}


def _serve_mode(conn: Connection, model_type: str, compiled: str, backend: str, async_mode: bool, threads: int) -> None:
    """The child process of one mode: load the model, then run what the parent sends until None."""
    import torch

    torch.set_num_threads(threads)
    try:
        model = load_compiled(model_type, Path(compiled), backend, async_mode=async_mode)
        conn.send(("ok", None))
    except Exception as e:  # reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    with model, torch.inference_mode():
        while (request := conn.recv()) is not None:
            batch, prompt_len, new_tokens, host_ms = request
            try:
                ids = prompt(model, batch, prompt_len)
                run = _decode_loop(model, ids, new_tokens, host_ms)
                run["total"] = nxdi_generate_s(model, ids, new_tokens)
                stats = model.async_stats
                run["stats"] = None if stats is None else (stats.launched, stats.used)
                conn.send(("ok", run))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))


def _ask(conn: Connection, mode: str, request: Any) -> Any:
    conn.send(request)
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(f"bench generate --async: the {mode} model failed: {payload}")
    return payload


def measure(path: Path, args: argparse.Namespace, batch: int, tp: int, backend: str) -> dict[str, Any]:
    """Both modes' loop steps (forward() and host parts), generate() throughput and the overlap.

    Raises:
        RuntimeError: a child failed, or the two modes gave different tokens.
    """
    model_type, compiled, _ = compile_for(path, args, batch, tp, backend)
    context = multiprocessing.get_context("spawn")
    conns, children = {}, []
    try:
        for mode in MODES:
            parent, child = context.Pipe()
            process = context.Process(
                target=_serve_mode,
                args=(child, model_type, str(compiled), backend, mode == "async", args.threads),
                daemon=True,
            )
            process.start()
            children.append(process)
            conns[mode] = parent
            if parent.recv()[0] != "ok":
                raise RuntimeError(f"bench generate --async: the {mode} model failed to load")
        warm = {mode: _ask(conns[mode], mode, (batch, args.prompt_len, 4, args.host_ms)) for mode in MODES}
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeat):
            for mode in MODES:
                runs[mode].append(_ask(conns[mode], mode, (batch, args.prompt_len, args.new_tokens, args.host_ms)))
        for conn in conns.values():
            conn.send(None)
    finally:
        for process in children:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if any(a["tokens"] != s["tokens"] for s, a in zip(runs["sync"], runs["async"], strict=True)):
        raise RuntimeError("async_mode gave other tokens than synchronous mode: a bug, please report it")
    return _summary(runs, warm["async"]["stats"], batch, args.new_tokens, args.host_ms)


def _summary(
    runs: dict[str, list[dict[str, Any]]], warm: tuple[int, int], batch: int, new_tokens: int, host_ms: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"host_ms": host_ms}
    for mode, mode_runs in runs.items():
        out[mode] = {
            "step_ms": 1e3 * statistics.median(s for r in mode_runs for s in r["step"]),
            "forward_ms": 1e3 * statistics.median(c for r in mode_runs for c in r["call"]),
            "host_ms": 1e3
            * statistics.median(s - c for r in mode_runs for s, c in zip(r["step"], r["call"], strict=True)),
            "generate_tok_s": batch * new_tokens / statistics.median(r["total"] for r in mode_runs),
        }
    launched, used = runs["async"][-1]["stats"]
    out["async"].update(launched=launched - warm[0], used=used - warm[1])  # the timed runs
    s, a = out["sync"], out["async"]
    # Below 0.1 ms of host time per step (reading the tokens only) the share is noise over noise.
    out["overlap"] = (s["step_ms"] - a["step_ms"]) / s["host_ms"] if s["host_ms"] >= 0.1 else None
    out["step_speedup"] = s["step_ms"] / a["step_ms"]
    out["generate_speedup"] = a["generate_tok_s"] / s["generate_tok_s"]
    return out


def render(a: dict[str, Any]) -> list[str]:
    """Lines for the `nxdi bench generate` table."""
    lines = [f"  async_mode vs synchronous, decode loop with {a['host_ms']:g} ms of host time per step (p50):"]
    for mode in MODES:
        m = a[mode]
        used = f"   {m['used']}/{m['launched']} steps launched ahead were used" if mode == "async" else ""
        lines.append(
            f"    {mode:<6} step {m['step_ms']:7.2f} ms = forward() {m['forward_ms']:7.2f} + host {m['host_ms']:6.2f}"
            f"   generate() {m['generate_tok_s']:7.1f} tok/s{used}"
        )
    overlap = "n/a (under 0.1 ms of host time)" if a["overlap"] is None else f"{100 * a['overlap']:.0f}%"
    lines.append(
        f"    host time hidden: {overlap}   async_mode speed-up: loop step {a['step_speedup']:.2f}x, "
        f"generate() {a['generate_speedup']:.2f}x"
    )
    return lines

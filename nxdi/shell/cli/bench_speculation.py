"""`nxdi bench generate --speculation METHOD`: speculative decoding against plain greedy decoding.

    nxdi bench generate --speculation draft|fused|medusa|eagle|eagle-tree [--shape small|toy]
                        [--speculation-length 5] [--prompt-len 16] [--new-tokens 64]
                        [--batch-size 1] [--repeat 3] [--threads 2] [--dtype float32] [--json]

The command trains its own target and draft in a temporary folder, on arithmetic progressions:
for `draft` and `fused` a target/draft pair (`nxdi.testing.training.train_pair`, recipe `--shape`:
`small` is a 6-layer target of hidden 384 and a 1-layer draft of hidden 32, about 1-2 minutes of
training on one thread; `toy` the test pair, seconds); for `medusa` and `eagle` the same target
(`train_target`), then 4 Medusa heads or a one-layer EAGLE draft trained on it (18-36 s at `small`;
`nxdi.shell.cli.bench_spec_trainers`). It decodes progression prompts (what they were trained
on: trained models agree there, as a real model and its distilled draft do on real text). In one
process, alternating runs so machine noise hits every side, it measures greedy decoding of
exactly `--new-tokens` tokens (no EOS) by:

  (a) nxdi, the target alone (token-generation programs, `HuggingFaceGenerationAdapter.generate`);
  (b) nxdi with speculation METHOD:
      `draft`: `generate(assistant_model=draft)` on a target with speculation_length k and
      trace_tokengen_model=False; the draft has speculation_length 2, so its per-round catch-up
      read of two tokens is one step;
      `fused`: the same draft in the target's fused programs (enable_fused_speculation,
      FusedSpecNeuronConfig, on-device greedy sampling), `generate()` without an assistant;
      `medusa`: the target with the heads (is_medusa, `nxdi.testing.medusa.DEFAULT_TREE`: 10
      paths, 11 nodes, 4 deep), `generate(assistant_model=model)`; compiled with seq_len longer
      by the 11 nodes a tree step needs free (k does not apply: `--speculation-length` is refused);
      `eagle`: the EAGLE draft fused (enable_eagle_speculation, is_eagle_draft, flat draft);
      `eagle-tree`: the same draft proposing a 9-node, 4-deep token tree (token_tree_config,
      `bench_spec_methods.EAGLE_TREE`; `--speculation-length` is refused, the tree sets k = 9);
  (c) transformers' own counterpart of METHOD, when it has one (`draft` and `fused`: assisted
      generation, `hf_target.generate(assistant_model=hf_draft)` with the same pair, k-1
      proposals per round, a constant schedule and no confidence cut-off; batch 1 only, as
      transformers requires; transformers has no Medusa or EAGLE decoding: not measured);
  (d) transformers' plain `generate()` of the target.

Reported per side: acceptance (accepted / proposed draft tokens: k-1 proposed per row and step;
for Medusa the tree's depth per row and tree step, the most one can accept), tokens per target step (new
tokens per target forward call, the prefill included), TPOT (end-to-end ms per output token, the
prefill included), end-to-end seconds (median of `--repeat` runs after a warm-up); the speed-ups
(b vs a) and (b vs c) (end-to-end time ratios, above 1: (b) is faster); and whether (b)'s greedy
tokens equal (a)'s (the bench fails when they do not) and (c)'s and (d)'s equal (a)'s (reported).
Also each nxdi model's compiled programs and compile seconds.

Adding a method: a builder and one entry in `nxdi.shell.cli.bench_spec_methods.METHODS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nxdi.shell.cli.bench_spec_methods import METHODS, Method, Run, Side, Workspace

DEFAULT_PROMPT_LEN = 16
DEFAULT_NEW_TOKENS = 64
DEFAULT_SPECULATION_LENGTH = 5
RECIPES = ("small", "toy")
"""`--shape` choices with --speculation: the names of `nxdi.testing.training.PAIRS`."""


def check_args(args: argparse.Namespace) -> None:
    """Fill the speculation defaults (`--prompt-len`, `--new-tokens`) and refuse what the
    speculation bench does not measure.

    Raises:
        UsageError: listing every refused flag.
    """
    from nxdi.shell.cli.errors import UsageError

    args.prompt_len = DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len
    args.new_tokens = DEFAULT_NEW_TOKENS if args.new_tokens is None else args.new_tokens
    problems = []
    if not METHODS[args.speculation].uses_k and args.speculation_length is not None:
        why = "its token tree sets the tokens a step scores; drop --speculation-length"
        problems.append(f"--speculation-length {args.speculation_length}: not used by {args.speculation} ({why})")
    if args.speculation_length is None:
        args.speculation_length = DEFAULT_SPECULATION_LENGTH
    if args.model_path:
        problems.append("--model-path: --speculation trains its own target/draft pair; drop --model-path")
    if args.shape not in RECIPES:
        problems.append(f"--shape {args.shape}: with --speculation give one of {', '.join(RECIPES)}")
    if args.model_type != "llama":
        problems.append(f"--model-type {args.model_type}: the trained pair is a llama; drop --model-type")
    if args.tp_degree != [1] or args.backend != ["cpu"] or args.async_mode:
        problems.append("--tp-degree, --backend and --async: not measured with --speculation; drop them")
    if args.speculation_length < 2:
        problems.append(f"--speculation-length {args.speculation_length}: must be >= 2")
    if args.prompt_len < 2 or args.new_tokens < 2:
        problems.append("--prompt-len and --new-tokens: must be >= 2 with --speculation")
    if args.repeat < 1:
        problems.append(f"--repeat {args.repeat}: must be >= 1")
    if problems:
        raise UsageError("; ".join(problems))


def _measure(sides: list[Side], ids: Any, args: argparse.Namespace) -> dict[str, list[tuple[float, Run]]]:
    """Every side's (seconds, run), `args.repeat` each, alternating sides, after one warm-up each."""
    import torch

    runs: dict[str, list[tuple[float, Run]]] = {s.label: [] for s in sides}
    with torch.inference_mode():
        for side in sides:
            side.generate(ids, min(4, args.new_tokens))
        for _ in range(args.repeat):
            for side in sides:
                start = time.perf_counter()
                run = side.generate(ids, args.new_tokens)
                runs[side.label].append((time.perf_counter() - start, run))
    return runs


def _summary(measured: list[tuple[float, Run]], new_tokens: int) -> dict[str, Any]:
    e2e = statistics.median(s for s, _ in measured)
    last = measured[-1][1]
    return {
        "acceptance": last.accepted / last.proposed if last.proposed else None,
        "tokens_per_target_step": new_tokens / last.target_calls,
        "tpot_ms": 1e3 * e2e / new_tokens,
        "e2e_s": e2e,
        "proposed": last.proposed,
        "accepted": last.accepted,
    }


def bench_batch(ws: Workspace, method: Method) -> dict[str, Any]:
    """Side by side at one batch size: (a) nxdi greedy, (b) nxdi speculation, (c) transformers'
    counterpart (if any), (d) transformers greedy."""
    import torch

    from nxdi.shell.cli import bench_spec_methods as methods
    from nxdi.testing import training

    args = ws.args
    plain, plain_report = methods.load_nxdi(ws.target.path, ws.folder / "target", args, batch_size=ws.batch)
    sides = method.build(ws)
    try:
        rows = training.progression_prompts(ws.target.model.config.vocab_size, lengths=[args.prompt_len] * ws.batch)
        ids = torch.tensor(rows)
        order = [methods.nxdi_plain(plain), sides.nxdi, *([sides.transformers] if sides.transformers else [])]
        order.append(methods.hf_plain(methods.hf_model(ws.target.path, args.dtype)))
        runs = _measure(order, ids, args)
    finally:
        sides.close()
        plain.close()
    names = ["nxdi_greedy", "nxdi_speculation", *(["transformers_assisted"] if sides.transformers else [])]
    names.append("transformers_greedy")
    out = {name: _summary(runs[side.label], args.new_tokens) for name, side in zip(names, order, strict=True)}
    labels = {name: side.label for name, side in zip(names, order, strict=True)}
    greedy = runs[order[0].label][-1][1].tokens
    matches = {name: bool(torch.equal(runs[labels[name]][-1][1].tokens, greedy)) for name in names[1:]}
    speedups = {"speculation_vs_nxdi_greedy": out["nxdi_greedy"]["e2e_s"] / out["nxdi_speculation"]["e2e_s"]}
    if "transformers_assisted" in out:
        speedups["speculation_vs_transformers_assisted"] = (
            out["transformers_assisted"]["e2e_s"] / out["nxdi_speculation"]["e2e_s"]
        )
    result: dict[str, Any] = {
        "batch_size": ws.batch,
        "labels": labels,
        "sides": out,
        "speedup": speedups,
        "tokens_match_nxdi_greedy": matches,
        "compiled": {"target": plain_report, **sides.compiled},
    }
    if sides.transformers is None:
        result["not_measured"] = {"transformers_assisted": sides.no_counterpart}
    return result


_TAGS = {"nxdi_greedy": "a", "nxdi_speculation": "b", "transformers_assisted": "c", "transformers_greedy": "d"}


def render(doc: Mapping[str, Any]) -> str:
    """The report as a table per batch size."""
    p = doc["pair"]
    lines = [
        f"speculation {doc['method']}: target {p['target_parameters'] / 1e6:.2f}M parameters (trained "
        f"{p['target_train_s']:.1f} s), {p['draft']} {p['draft_parameters'] / 1e6:.3f}M (trained "
        f"{p['draft_train_s']:.1f} s); prompt {doc['prompt_len']}, {doc['new_tokens']} new tokens, "
        f"{doc['dtype']}, {doc['threads']} threads",
    ]
    for r in doc["results"]:
        lines.append(f"batch {r['batch_size']}:")
        width = max(30, *(len(label) for label in r["labels"].values()))
        lines.append(f"  {'':<{width + 4}}{'acceptance':>11}{'tok/step':>10}{'TPOT ms':>10}{'e2e s':>9}  tokens = (a)")
        for name, s in r["sides"].items():
            tag = _TAGS[name]
            rate = "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"
            same = r["tokens_match_nxdi_greedy"].get(name, "")
            lines.append(
                f"  ({tag}) {r['labels'][name]:<{width}}{rate:>11}{s['tokens_per_target_step']:>10.2f}"
                f"{s['tpot_ms']:>10.2f}{s['e2e_s']:>9.3f}  {same}"
            )
        lines.append("  speed-up: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items()))
        compiled = ", ".join(f"{k} {v['programs']} ({v['compile_s']:.1f} s)" for k, v in r["compiled"].items())
        lines.append(f"  compiled programs: {compiled}")
        for what, why in r.get("not_measured", {}).items():
            lines.append(f"  ({_TAGS[what]}) {what}: not measured ({why})")
    return "\n".join(lines)


def _train(method: Method, folder: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    """The trained target and draft (`TrainedModel`s): the recipe's pair, or its target and what
    the method's trainer trains from it."""
    from nxdi.testing import training

    length = args.prompt_len + args.new_tokens
    if method.trainer is None:
        return training.train_pair(
            folder / "target-checkpoint", folder / "draft-checkpoint", recipe=args.shape, length=length
        )
    target = training.train_target(folder / "target-checkpoint", recipe=args.shape, length=length)
    return target, method.trainer(target, folder / "draft-checkpoint", args)


def run(args: argparse.Namespace) -> int:
    """Train the pair, measure every batch size, print the report; 1 when (b)'s tokens differ from (a)'s."""
    import torch

    check_args(args)
    method = METHODS[args.speculation]
    before = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="nxdi-bench-speculation-") as tmp:
            folder = Path(tmp)
            print(f"[bench] training the {args.shape} target and {method.draft_name} in {folder} ...", flush=True)
            # One thread: on a shared 2-core machine two threads trained 4x slower than one
            # whenever another process was busy (OpenMP threads wait on each other).
            torch.set_num_threads(1)
            target, draft = _train(method, folder, args)
            print(f"[bench] trained in {target.seconds:.1f} + {draft.seconds:.1f} s", flush=True)
            torch.set_num_threads(args.threads)
            results = []
            for batch in args.batch_size:
                ws = Workspace(args=args, batch=batch, target=target, draft=draft, folder=folder / f"b{batch}")
                results.append(bench_batch(ws, method))
    finally:
        torch.set_num_threads(before)
    count = lambda m: sum(p.numel() for p in m.model.parameters())  # noqa: E731
    doc = {
        "method": args.speculation,
        "speculation_length": args.speculation_length if method.uses_k else None,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "pair": {
            "recipe": args.shape,
            "draft": method.draft_name,
            "target_parameters": count(target),
            "draft_parameters": count(draft),
            "target_train_s": target.seconds,
            "draft_train_s": draft.seconds,
            "train_s": target.seconds + draft.seconds,
            "losses": [target.loss, draft.loss],
        },
        "results": results,
    }
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0 if all(r["tokens_match_nxdi_greedy"]["nxdi_speculation"] for r in results) else 1

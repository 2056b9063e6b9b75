"""`nxdi bench`: benchmarks as commands, one sub-command per benchmark, each in its own shell module.

Adding a benchmark: write a module with `add_parser(subparsers)` that adds its sub-parser and sets
`run` (as the `nxdi` commands do; timing helpers are in `nxdi.shell.cli.bench_timing`), then add one
line to `BENCHES`. The module is imported whenever the `nxdi` parser is built (for `nxdi plan`
too), so it must import heavy libraries (torch, transformers) inside its `run`, not at the top.
`nxdi bench` with no name runs the benchmarks in `DEFAULT_BENCHES` with their default options
(what `make bench` does).
"""

from __future__ import annotations

import argparse
import importlib

# benchmark name -> module with `add_parser(subparsers)`; imported lazily, like nxdi.shell.cli.main.COMMANDS.
BENCHES: dict[str, str] = {
    "plan": "nxdi.shell.cli.bench_plan",
    "generate": "nxdi.shell.cli.bench_generate",
    "load": "nxdi.shell.cli.bench_load",
    "serve": "nxdi.shell.cli.bench_serve",
    "roofline": "nxdi.shell.cli.bench_roofline",
}

DEFAULT_BENCHES: tuple[str, ...] = ("plan",)
"""What `nxdi bench` runs when given no benchmark name; each must run with its default options."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="run benchmarks (no name: the default set)",
        description="Benchmarks. Each prints its timings; see `nxdi bench NAME --help`.",
        allow_abbrev=False,
    )
    benches = p.add_subparsers(dest="bench", metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(benches)
    p.set_defaults(run=run)


def _default_args(name: str) -> argparse.Namespace:
    """The parsed default options of benchmark `name`."""
    parser = argparse.ArgumentParser(prog="nxdi bench", allow_abbrev=False)
    importlib.import_module(BENCHES[name]).add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args([name])


def run(args: argparse.Namespace) -> int:
    """Run the default benchmarks (a named benchmark's parser sets its own `run`); the worst status wins."""
    status = 0
    for name in DEFAULT_BENCHES:
        bench_args = _default_args(name)
        status = max(status, int(bench_args.run(bench_args)))
    return status

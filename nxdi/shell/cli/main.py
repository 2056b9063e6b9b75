"""The `nxdi` command line: one sub-command per job, each in its own shell module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> module with `add_parser(subparsers)`; imported lazily so `nxdi plan` stays light.
COMMANDS: dict[str, str] = {
    "config": "nxdi.shell.cli.cmd_config",
    "demo": "nxdi.shell.cli.cmd_demo",
    "run": "nxdi.shell.cli.cmd_run",
    "compile": "nxdi.shell.cli.cmd_compile",
    "plan": "nxdi.shell.cli.cmd_plan",
    "bench": "nxdi.shell.cli.cmd_bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxdi", description="LLM inference for AWS Trainium/Inferentia and CPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `nxdi` with `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())

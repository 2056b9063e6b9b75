"""The `nxdi` command line: one sub-command per job, each in its own shell module.

Exit statuses and error reporting are in `nxdi.shell.cli.errors`: 0 success, 2 a user error (one
message, no traceback), 1 a failed rank, a locked folder or an unexpected error (with its
traceback); `nxdi --debug` shows the traceback of every error. `nxdi plan` also exits 1 for a plan
that lists problems.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence

from nxdi.shell.cli import errors

# sub-command -> module with `add_parser(subparsers)`; imported lazily so `nxdi plan` stays light.
COMMANDS: dict[str, str] = {
    "config": "nxdi.shell.cli.cmd_config",
    "demo": "nxdi.shell.cli.cmd_demo",
    "run": "nxdi.shell.cli.cmd_run",
    "compile": "nxdi.shell.cli.cmd_compile",
    "plan": "nxdi.shell.cli.cmd_plan",
    "bench": "nxdi.shell.cli.cmd_bench",
    "kernels": "nxdi.shell.cli.cmd_kernels",
}

_DEBUG_HELP = "on an error, show its traceback instead of one message"


def _sub_parsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction[argparse.ArgumentParser]]:
    # argparse offers no public view of a parser's sub-commands.
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """`--debug` on every sub-command too (`nxdi run ... --debug`), not overriding the global flag."""
    for action in _sub_parsers(parser):
        for child in action.choices.values():
            child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
            _add_debug(child)


def build_parser() -> argparse.ArgumentParser:
    parser = errors.Parser(prog="nxdi", description="LLM inference for AWS Trainium/Inferentia and CPU.")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    _add_debug(parser)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)sub-command parser `args` were parsed by."""
    for action in _sub_parsers(parser):
        name = getattr(args, action.dest, None)
        if name in action.choices:
            return _chosen(action.choices[name], args)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for arguments no parser took, with the closest flags of `parser`."""
    flags = [s for a in parser._actions for s in a.option_strings]
    hints = []
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=2, cutoff=0.7)
        if extra.startswith("-") and close:
            hints.append(f"{extra}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + "".join(f"\n{h}" for h in hints)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `nxdi` with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _chosen(parser, args).error(_unrecognized(_chosen(parser, args), extras))
    try:
        status: int = args.run(args)
    except Exception as exc:
        code = errors.status_of(exc)
        if code is None or args.debug:
            raise
        return errors.report(args.command, exc, code)
    return status


if __name__ == "__main__":
    sys.exit(main())

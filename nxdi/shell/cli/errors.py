"""How `nxdi` reports failures: exit statuses, one message and no traceback for user errors.

Rules:
- A user error (an invalid flag value, configuration, checkpoint or compiled folder; a missing or
  unreadable file) exits 2 with one message: `nxdi COMMAND: what, why and the fix`. A single
  problem fits on one line; an error listing several problems gives one line for each.
- A rank process that died or hung (RankError), or a compiled-model folder another process held
  past the lock timeout (FolderLockedError), exits 1 with its message.
- Anything else is a bug or an unexpected failure: it keeps its traceback (exit 1).
- `nxdi --debug ...` re-raises every error, so its traceback is printed.
- An argparse error prints the command's short usage (its required flags), the error, and where
  the full help is, instead of argparse's usage block of every flag (over a hundred lines).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2
"""A user error: bad flags, configuration, checkpoint or compiled folder, missing or unreadable files."""
EXIT_FAILED = 1
"""A failure that is not the user's input: a rank process died, a folder stayed locked, or an
unexpected error (with its traceback)."""

_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


class UsageError(ValueError):
    """A command-line argument is invalid (`nxdi` exits 2 with its message)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions `nxdi` reports as user errors: the documented ones of `nxdi.shell.exceptions`,
    UsageError, missing or unreadable files, and a backend whose toolchain is not installed."""
    from nxdi.effects.backends.neuron import NeuronUnavailableError
    from nxdi.effects.backends.xla import XlaUnavailableError
    from nxdi.shell.exceptions import ArtifactIntegrityError, CheckpointValidationError, IncompatibleConfigError

    documented = (IncompatibleConfigError, CheckpointValidationError, ArtifactIntegrityError, UsageError)
    return (*documented, *_FILE_ERRORS, NeuronUnavailableError, XlaUnavailableError)


def status_of(exc: BaseException) -> int | None:
    """The exit status `nxdi` reports `exc` with (no traceback), or None when it is unexpected."""
    from nxdi.shell.exceptions import FolderLockedError, RankError

    if isinstance(exc, user_error_types()):
        return EXIT_USAGE
    if isinstance(exc, (RankError, FolderLockedError)):
        return EXIT_FAILED
    return None


def message(command: str, exc: BaseException) -> str:
    """`nxdi COMMAND: ...` for `exc`; a one-problem error on one line."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"  # like coreutils: "path: Permission denied"
    else:
        text = str(exc)
    lines = text.strip().splitlines()
    if len(lines) == 2 and lines[0].endswith(": 1 problem:"):
        text = f"{lines[0].removesuffix(' 1 problem:')} {lines[1].strip().removeprefix('- ')}"
    return f"nxdi {command}: {text.strip()}"


def short_usage(parser: argparse.ArgumentParser) -> str:
    """`usage: PROG --required VALUE ... [options]`: the full usage when it is short, else only the
    required arguments."""
    full = parser.format_usage().strip()
    if full.count("\n") < 3:
        return full
    parts = [parser.prog]
    for action in parser._actions:  # argparse keeps its arguments here; there is no public view
        if action.option_strings and action.required:
            parts.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
        elif not action.option_strings and action.help != argparse.SUPPRESS:
            parts.append(str(action.metavar or action.dest))
    return f"usage: {' '.join(parts)} [options]"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors print the short usage (see the module rules); sub-parsers made
    with `add_subparsers` are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{short_usage(self)}\n{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def report(command: str, exc: BaseException, status: int) -> int:
    """Print `exc`'s message to stderr; return `status`."""
    print(message(command, exc), file=sys.stderr)
    return status

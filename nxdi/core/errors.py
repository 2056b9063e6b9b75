"""Problems and error values: what went wrong, for which field, and how to fix it. Pure.

Rules:
- A failure that depends on caller data is a `Failure(ConfigError | CheckpointError)` whose
  `problems` lists *every* problem found, never only the first.
- A `Problem` names the field (or file, key, tensor), the offending value, why it is wrong and the fix.
- `collect` merges any number of `Result`s so callers can check everything and report once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import attrs
from returns.result import Failure, Result, Success

T = TypeVar("T")

_MISSING = "<missing>"


@attrs.frozen(kw_only=True)
class Problem:
    """One thing wrong with caller data."""

    field: str
    """Dotted name of the field, file, key or tensor at fault (e.g. `neuron_config.tp_degree`)."""
    value: str
    """`repr` of the offending value, or `<missing>` when the field is absent."""
    reason: str
    """Why the value is wrong, as a short sentence fragment."""
    fix: str = ""
    """What to do about it; empty when the reason already says it."""

    @classmethod
    def of(cls, field: str, value: object, reason: str, fix: str = "") -> Problem:
        """Build a problem, taking the `repr` of any value."""
        shown = value if isinstance(value, str) and value == _MISSING else repr(value)
        return cls(field=field, value=shown, reason=reason, fix=fix)

    @classmethod
    def missing(cls, field: str, fix: str = "") -> Problem:
        """A required field that is absent."""
        return cls(field=field, value=_MISSING, reason="is required but missing", fix=fix)

    def render(self) -> str:
        """One line: `field=value: reason. Fix: fix`."""
        head = f"{self.field}: {self.reason}" if self.value == _MISSING else f"{self.field}={self.value}: {self.reason}"
        return f"{head}. Fix: {self.fix}" if self.fix else head

    def prefixed(self, prefix: str) -> Problem:
        """The same problem with `prefix.` in front of the field name."""
        return attrs.evolve(self, field=f"{prefix}.{self.field}")


def _problem_tuple(problems: Iterable[Problem]) -> tuple[Problem, ...]:
    # A typed converter: mypy's attrs plugin cannot infer the element type through a bare `tuple`.
    return tuple(problems)


def _render_all(title: str, problems: tuple[Problem, ...]) -> str:
    noun = "problem" if len(problems) == 1 else "problems"
    lines = [f"{title}: {len(problems)} {noun}:"]
    lines.extend(f"  - {p.render()}" for p in problems)
    return "\n".join(lines)


@attrs.frozen(kw_only=True)
class ConfigError:
    """Every problem found in a configuration (NeuronConfig kwargs, HF config dict, plan request)."""

    problems: tuple[Problem, ...] = attrs.field(converter=_problem_tuple)

    @classmethod
    def of(cls, field: str, value: object, reason: str, fix: str = "") -> ConfigError:
        """An error holding a single problem."""
        return cls(problems=(Problem.of(field, value, reason, fix),))

    def render(self, title: str = "Invalid configuration") -> str:
        """A multi-line message listing every problem."""
        return _render_all(title, self.problems)

    def fields(self) -> frozenset[str]:
        """The names of every field at fault."""
        return frozenset(p.field for p in self.problems)

    def prefixed(self, prefix: str) -> ConfigError:
        """The same error with every field name put under `prefix`."""
        return ConfigError(problems=tuple(p.prefixed(prefix) for p in self.problems))


@attrs.frozen(kw_only=True)
class CheckpointError:
    """Every problem found in a checkpoint: missing or unexpected keys, bad shapes, bad files."""

    problems: tuple[Problem, ...] = attrs.field(converter=_problem_tuple)

    @classmethod
    def of(cls, field: str, value: object, reason: str, fix: str = "") -> CheckpointError:
        """An error holding a single problem."""
        return cls(problems=(Problem.of(field, value, reason, fix),))

    def render(self, title: str = "Invalid checkpoint") -> str:
        """A multi-line message listing every problem."""
        return _render_all(title, self.problems)

    def fields(self) -> frozenset[str]:
        """The names of every key or file at fault."""
        return frozenset(p.field for p in self.problems)


@attrs.frozen(kw_only=True)
class ArtifactError:
    """Every problem found in a compiled-model folder: missing, altered or stale files."""

    problems: tuple[Problem, ...] = attrs.field(converter=_problem_tuple)
    not_found: bool = False
    """True when nothing is compiled there, or the weights it needs are gone (the shell raises
    FileNotFoundError; otherwise the folder is damaged or stale: ArtifactIntegrityError)."""

    def render(self, title: str = "Invalid compiled model") -> str:
        """A multi-line message listing every problem."""
        return _render_all(title, self.problems)


def problems_result(value: T, problems: Iterable[Problem]) -> Result[T, ConfigError]:
    """`Success(value)` when `problems` is empty, else a `Failure` listing them all."""
    found = tuple(problems)
    return Failure(ConfigError(problems=found)) if found else Success(value)


def problems_of(*results: Result[object, ConfigError]) -> tuple[Problem, ...]:
    """Every problem of every `Failure` among `results`, in order."""
    found: list[Problem] = []
    for r in results:
        match r:
            case Failure(err):
                found.extend(err.problems)
    return tuple(found)


def collect(*results: Result[object, ConfigError]) -> Result[tuple[object, ...], ConfigError]:
    """Combine results: `Success` of all values, or one `Failure` with every problem of every failure."""
    values: list[object] = []
    problems: list[Problem] = []
    for r in results:
        match r:
            case Success(v):
                values.append(v)
            case Failure(err):
                problems.extend(err.problems)
    return Failure(ConfigError(problems=tuple(problems))) if problems else Success(tuple(values))

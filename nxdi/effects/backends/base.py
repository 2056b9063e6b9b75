"""The backend protocol: trace a pure tensor program, save it, load it, bind weights, run it.
Effects: none here (the protocol and the values a backend hands to the shell).

Calling convention (every backend, every program). A program is a pure function of flat tensors:

    fn(*weights, *cache, *inputs) -> (*outputs, *new_cache)

- `weights` (W tensors, named by `Signature.weights`): bound at load with `Backend.bind`, never
  baked into a saved program, so one weights file serves every program. A loaded model wraps its
  tensors in one `WeightSet` and binds every program with it, so whatever a backend derives from
  the weights (CPU: oneDNN-packed copies) is made once and shared by all buckets.
- `cache` (C tensors, named by `Signature.cache`): the KV cache view the step reads and writes.
  `new_cache[i]` has the shape and dtype of `cache[i]`. The traced program is pure (out-of-place
  writes); a backend may run it in place instead (writing `cache[i]` and returning that very
  tensor), which is why `run` treats the cache it is given as consumed: callers use the returned
  cache, never the tensors they passed in.
- `inputs` (I tensors, named by `Signature.inputs`): token ids, positions, sampling parameters...
- `outputs` (O tensors, named by `Signature.outputs`): logits, tokens, a mixture of experts'
  router_logits and expert_index when its config asks (`nxdi.core.programs.step.StepSpec.outputs`)...

A backend may keep the cache on its own `device` and defer work (XLA builds one lazy graph per
step): the runtime allocates the cache there, and after a step has written its cache back it calls
`finish`, which runs what was deferred and hands the outputs back on the host.

Shapes are static: one program per sub-model and bucket. The names make the manifest readable and
let `bind` check weights by name and shape, and report every mismatch at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import attrs
import torch
from returns.result import Result
from torch import Tensor

from nxdi.core.errors import CheckpointError
from nxdi.core.programs.collectives import Collectives

FlatProgram = Callable[..., tuple[Tensor, ...]]
"""`fn(*weights, *cache, *inputs) -> (*outputs, *new_cache)`, a pure function of tensors."""


def _names(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class Signature:
    """The names of a program's flat arguments and results, in order."""

    weights: tuple[str, ...] = attrs.field(converter=_names)
    """Weight names (checkpoint keys), W of them; bound by `Backend.bind`."""
    cache: tuple[str, ...] = attrs.field(converter=_names)
    """KV cache tensor names, C of them; passed in and returned (updated) by every run."""
    inputs: tuple[str, ...] = attrs.field(converter=_names)
    """Per-step input names, I of them."""
    outputs: tuple[str, ...] = attrs.field(converter=_names)
    """Result names, O of them; the program returns O outputs followed by C cache tensors."""

    @property
    def arity(self) -> int:
        """W + C + I, the number of positional arguments of the program."""
        return len(self.weights) + len(self.cache) + len(self.inputs)

    def to_json(self) -> dict[str, list[str]]:
        """A JSON-ready dict (the manifest stores it)."""
        return {f.name: list(getattr(self, f.name)) for f in attrs.fields(Signature)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Signature:
        """The inverse of `to_json`. Raises KeyError/TypeError on a malformed dict."""
        return cls(**{f.name: tuple(str(n) for n in raw[f.name]) for f in attrs.fields(Signature)})


def _tensors(values: Sequence[Tensor]) -> tuple[Tensor, ...]:
    return tuple(values)


@attrs.frozen(eq=False, kw_only=True)
class WeightSet:
    """A model's weights (W tensors, signature order), shared by every program bound to them."""

    tensors: tuple[Tensor, ...] = attrs.field(converter=_tensors)
    derived: dict[str, Tensor] = attrs.field(factory=dict)
    """Copies a backend derives from the weights (CPU: oneDNN-packed linears), by weight name.
    Filled by the first `bind` that needs them and reused by later ones; a cache, not state."""

    def derive(self, key: str, make: Callable[[], Tensor]) -> Tensor:
        """The copy stored under `key`, made by `make()` the first time it is asked for."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


@attrs.frozen(eq=False, kw_only=True)
class CompiledProgram:
    """One traced, static-shape program (a sub-model at one bucket), not yet bound to weights."""

    name: str
    """Which program: e.g. `token_generation_256`. Also its file name stem in the artifact folder."""
    signature: Signature
    backend: str
    """`Backend.name` of the backend that made it."""
    payload: Any
    """The backend's own form (CPU: a `torch.export.ExportedProgram`; XLA and Neuron: an `HloProgram`)."""


@attrs.frozen(eq=False, kw_only=True)
class LoadedProgram:
    """A compiled program bound to weights: ready to run."""

    program: CompiledProgram
    call: Callable[..., tuple[Tensor, ...]]
    """`call(*cache, *inputs) -> (*outputs, *new_cache)`, weights already bound."""
    in_place: tuple[bool, ...]
    """Per cache tensor: True when a run writes the caller's tensor and returns it as the new cache."""


class Backend(Protocol):
    """What every backend (CPU, Neuron) provides. See the module docstring for the calling convention."""

    name: str
    """Short backend name stored in manifests (`cpu`, `neuron`)."""
    suffix: str
    """File suffix of a saved program (`.pt2`, `.pt`)."""

    def version(self) -> str:
        """Everything about the toolchain that changes a saved program (part of the compile-cache key)."""
        ...

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Trace `fn` at the shapes of `example` (weights, cache and inputs, flat) and compile it."""
        ...

    def save(self, program: CompiledProgram, path: Path) -> None:
        """Write `program` to `path` (a temporary name; the caller renames it into place)."""
        ...

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        """Read a program written by `save`, without tracing anything again."""
        ...

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """Bind weights. Fails, naming every weight, on a count/shape/dtype mismatch."""
        ...

    def run(
        self, loaded: LoadedProgram, cache: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """One call: `(outputs, new_cache)`. The given `cache` is consumed (see the module docstring)."""
        ...

    def collectives(self, world: int) -> Collectives | None:
        """The collectives a tensor-parallel program is lowered with, when this backend lowers its
        own (XLA: HLO collectives); None: the torch.distributed ops of `nxdi.effects.distributed`."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives between steps (the host, or the XLA device)."""
        ...

    def finish(self, tensors: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
        """End a step: run whatever the backend deferred (an XLA execution) and return `tensors`,
        the step's outputs, on the host."""
        ...


def import_optional(name: str, error: type[ImportError], hint: str) -> ModuleType:
    """Import `name`, a backend's optional dependency, imported only when the backend is used.

    Raises:
        error: it cannot be imported; the message is `hint` (how to install it) and the import's failure.
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise error(f"{hint} (import {name!r} failed: {e})") from e

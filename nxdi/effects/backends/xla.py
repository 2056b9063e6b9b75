"""The XLA backend: programs lowered to HLO with torch-xla, run by XLA (its CPU backend without a
Neuron device). Effects: imports torch-xla lazily, lowers and compiles programs, moves tensors to
and from the XLA device, reads and writes `.xla` program files.

This is the Neuron compile path short of its last step: torch-neuronx too traces a program into an
HLO module, which neuronx-cc turns into a NEFF. Here the same module is compiled by XLA itself, so
a machine without Neuron hardware verifies that nxdi's programs lower whole (no host fallbacks, no
shape that depends on data) and compute what the CPU engine computes.

- `compile` runs the pure flat program once on *placeholder* XLA tensors (shapes and dtypes, no
  data), so any step that needed a tensor's value on the host fails right there, and lowers the
  lazy graph to an `HloModuleProto`. Which HLO parameter is which weight, cache tensor or input is
  recorded; scalars the program creates itself (norm epsilons, scales) become parameters too, and
  their values are saved with the module.
- A saved program (`.xla`) is a zip: `module.hlo.pb` (the HloModuleProto, what neuronx-cc
  consumes), `module.hlo.txt` (the same, readable), `parameters.json` (the parameter map, with
  every parameter's shape and dtype, and which result aliases which cache parameter) and
  `constants.safetensors` (and, compiled by the neuron backend, `model.neff`).
- `bind` moves the weights to the XLA device once per weight set and checks them against the
  parameter map (every mismatch listed). `run` calls the module on the device and returns lazy
  results; the runtime writes the cache back into its device tensors and then `finish`es the step:
  one XLA execution per step in which the KV cache buffers are donated and updated in place, so
  the cache never leaves the device. XLA compiles each (program, cache layout) once and reuses it.
"""

from __future__ import annotations

import functools
import itertools
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from nxdi.core.errors import CheckpointError, Problem
from nxdi.core.programs.collectives import Collectives
from nxdi.effects.backends import base
from nxdi.effects.backends.base import CompiledProgram, FlatProgram, LoadedProgram, Signature, WeightSet

FORMAT = 1
"""Bumped whenever what `compile` saves changes meaning (part of `version()`)."""

INSTALL_HINT = (
    "the XLA backend needs torch-xla, which is not installed in this environment. torch-xla 2.9 "
    "needs torch 2.9, so it lives in its own virtual environment: `make test-xla` creates .venv-xla "
    "(torch==2.9.0, torch-xla==2.9.0 and nxdi) and runs the XLA tests there. Without it, use the CPU "
    "backend (the default)."
)

MODULE = "module.hlo.pb"
TEXT = "module.hlo.txt"
PARAMETERS = "parameters.json"
CONSTANTS = "constants.safetensors"
NEFF = "model.neff"


class XlaUnavailableError(ImportError):
    """torch-xla cannot be imported."""


def _import(name: str) -> ModuleType:
    return base.import_optional(name, XlaUnavailableError, INSTALL_HINT)


@functools.cache
def _xla() -> tuple[ModuleType, ModuleType, ModuleType]:
    """torch_xla, its builder and its C bindings."""
    torch_xla = _import("torch_xla")
    builder = _import("torch_xla.core.xla_builder")
    return torch_xla, builder, _import("_XLAC")


@attrs.frozen(kw_only=True)
class Parameter:
    """One parameter of the HLO module: which flat argument it takes (or which saved constant)."""

    kind: str
    """`weight`, `cache`, `input` (a flat argument) or `constant` (a scalar the program made)."""
    name: str
    """The argument's signature name, or `constant{k}`."""
    index: int
    """Position among the flat arguments (W + C + I), or among the constants."""
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen(eq=False, kw_only=True)
class HloProgram:
    """A lowered program: the HLO module and how to call it."""

    module: bytes
    """The serialized HloModuleProto."""
    text: str
    """The module as HLO text, for people."""
    parameters: tuple[Parameter, ...]
    """In HLO parameter order."""
    constants: tuple[Tensor, ...]
    neff: bytes | None = None
    """What neuronx-cc made of the module (the neuron backend), saved beside it."""

    def aliases(self, signature: Signature) -> list[dict[str, Any]]:
        """Which result may reuse which parameter's buffer: the updated cache, its cache tensor (what
        a runtime donates, and what a Neuron compile is told as its input-output aliases)."""
        first = len(signature.outputs)
        return [
            {"output": first + p.index - len(signature.weights), "parameter": pid, "name": p.name}
            for pid, p in enumerate(self.parameters)
            if p.kind == "cache"
        ]

    def to_json(self, signature: Signature) -> dict[str, Any]:
        return {"parameters": [attrs.asdict(p) for p in self.parameters], "aliases": self.aliases(signature)}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in an XLA program's parameter map")
    return dtype


def _parameter(raw: Any) -> Parameter:
    """One entry of a saved parameter map. Raises ValueError/TypeError/KeyError on a malformed one."""
    kind, name, index, shape, dtype = (raw[k] for k in ("kind", "name", "index", "shape", "dtype"))
    ints = isinstance(index, int) and isinstance(shape, list) and all(isinstance(d, int) for d in shape)
    names = isinstance(name, str) and isinstance(dtype, str)
    if kind not in ("weight", "cache", "input", "constant") or not names or not ints:
        raise ValueError(f"malformed parameter entry {raw!r}")
    _dtype(dtype)
    return Parameter(kind=kind, name=name, index=index, shape=tuple(shape), dtype=dtype)


def _kind(signature: Signature, index: int) -> tuple[str, str]:
    w, c = len(signature.weights), len(signature.cache)
    if index < w:
        return "weight", signature.weights[index]
    if index < w + c:
        return "cache", signature.cache[index - w]
    return "input", signature.inputs[index - w - c]


def lower(fn: FlatProgram, signature: Signature, example: Sequence[Tensor]) -> HloProgram:
    """Lower `fn` at the shapes and dtypes of `example` to an HLO module (no tensor data is used).

    Raises:
        XlaUnavailableError: torch-xla is not installed.
        RuntimeError: the program needs a tensor's value on the host (it cannot be lowered whole).
    """
    torch_xla, builder, xlac = _xla()
    placeholders = [_placeholder(builder, xlac, t) for t in example]
    # Collectives chain through the device's token; restore it after lowering, so that no later
    # graph depends on this program's placeholders (executing those would crash).
    device = str(torch_xla.device())
    token = xlac._get_all_reduce_token(device)
    try:
        outputs = fn(*placeholders)
        context = xlac.lowering.LoweringContext("nxdi")
        context.build(list(outputs))
    finally:
        xlac._set_all_reduce_token(device, token)
    by_id = {context.tensor_parameter_id(p): i for i, p in enumerate(placeholders)}
    everything = context.device_parameter_id_tensor_mapping()
    parameters, constants = [], []
    for pid in range(len(everything)):
        if pid in by_id:
            i = by_id[pid]
            kind, name = _kind(signature, i)
            t = example[i]
        else:
            t = everything[pid].cpu()
            kind, name, i = "constant", f"constant{len(constants)}", len(constants)
            constants.append(t)
        parameters.append(Parameter(kind=kind, name=name, index=i, shape=tuple(t.shape), dtype=str(t.dtype)))
    module = context.hlo()
    text = builder.get_computation_hlo(builder.computation_from_module_proto("xla::nxdi_text", module))
    return HloProgram(module=module, text=text, parameters=tuple(parameters), constants=tuple(constants))


_FLOAT8_TYPES = {torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2"}
"""HLO element types of the float8 dtypes (a quantized KV cache), which torch-xla's placeholder
helper does not map (its table stops at the integer and 16/32/64-bit float types)."""


def _placeholder(builder: ModuleType, xlac: ModuleType, t: Tensor) -> Tensor:
    """A data-less XLA tensor of `t`'s shape and dtype (an HLO parameter once lowered)."""
    if t.dtype in _FLOAT8_TYPES:
        return xlac._xla_create_placeholder_tensor(builder.mkshape(_FLOAT8_TYPES[t.dtype], tuple(t.shape)).shape)
    return builder.create_placeholder_tensor(tuple(t.shape), t.dtype)


def collectives(world: int) -> Collectives:
    """The collectives of a rank's program lowered to HLO: cross-partition all-gathers and
    reduce-scatters over every partition (global device ids, one channel per collective, as SPMD
    execution needs; `xla_spmd` runs them). An all-reduce is an all-gather and a sum in rank order,
    so every rank computes the same bits. The rank and `scatter` come from the program's rank
    input (`collectives.with_rank`).
    """
    xm = _import("torch_xla.core.xla_model")
    groups = [list(range(world))]
    channels = itertools.count(1)

    def all_gather(x: Tensor, dim: int) -> Tensor:
        dim = dim % x.dim()
        kw = {"groups": groups, "pin_layout": False, "channel_id": next(channels), "use_global_device_ids": True}
        gathered: Tensor = xm.all_gather(x, dim=dim, **kw)
        return gathered

    def reduce_scatter(x: Tensor, dim: int) -> Tensor:
        kw = {"groups": groups, "pin_layout": False, "channel_id": next(channels), "use_global_device_ids": True}
        out: Tensor = xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, dim % x.dim(), world, **kw)
        return out

    def needs_rank(*_: object) -> Tensor:
        raise RuntimeError("a tensor-parallel program takes its rank as an input: bind it with collectives.with_rank")

    return Collectives(
        world=world,
        all_reduce=lambda x: all_gather(x[None], 0).sum(0),
        all_gather=all_gather,
        reduce_scatter=reduce_scatter,
        scatter=needs_rank,
        rank=needs_rank,
    )


def _weight_problems(program: HloProgram, signature: Signature, weights: Sequence[Tensor]) -> list[Problem]:
    if len(weights) != len(signature.weights):
        return [Problem.of("weights", len(weights), f"the program takes {len(signature.weights)} weights")]
    problems = []
    for p in program.parameters:
        if p.kind != "weight":
            continue
        w = weights[p.index]
        if tuple(w.shape) != p.shape or str(w.dtype) != p.dtype:
            problems.append(
                Problem.of(p.name, f"{tuple(w.shape)} {w.dtype}", f"the program was lowered with {p.shape} {p.dtype}")
            )
    return problems


@attrs.frozen(kw_only=True)
class XlaBackend:
    """HLO modules lowered with torch-xla, run on the XLA device (XLA:CPU without Neuron hardware)."""

    name: str = "xla"
    suffix: str = ".xla"

    def version(self) -> str:
        """torch and torch-xla versions (they change the lowering).

        Raises:
            XlaUnavailableError: torch-xla is not installed.
        """
        torch_xla, _, _ = _xla()
        return f"xla-hlo-{FORMAT}/torch-{torch.__version__}/torch-xla-{torch_xla.__version__}"

    @property
    def device(self) -> torch.device:
        """The XLA device the KV cache and the weights live on."""
        torch_xla, _, _ = _xla()
        device: torch.device = torch_xla.device()
        return device

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Lower `fn` to HLO at the example's shapes (see `lower`)."""
        if len(example) != signature.arity:
            raise ValueError(f"{name}: {len(example)} example tensors for a signature of arity {signature.arity}")
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=lower(fn, signature, example))

    def save(self, program: CompiledProgram, path: Path) -> None:
        """A zip of the HLO module, its text, the parameter map and the constants."""
        hlo: HloProgram = program.payload
        constants = {f"constant{i}": t.contiguous() for i, t in enumerate(hlo.constants)}
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(MODULE, hlo.module)
            z.writestr(TEXT, hlo.text)
            z.writestr(PARAMETERS, json.dumps(hlo.to_json(program.signature), indent=1))
            z.writestr(CONSTANTS, save_safetensors(constants))
            if hlo.neff is not None:
                z.writestr(NEFF, hlo.neff)

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        """Read a program written by `save` (no lowering again).

        Raises:
            ValueError: the file is not a saved XLA program.
        """
        try:
            with zipfile.ZipFile(path) as z:
                module, text = z.read(MODULE), z.read(TEXT).decode()
                raw = json.loads(z.read(PARAMETERS))
                stored = load_safetensors(z.read(CONSTANTS))
                neff = z.read(NEFF) if NEFF in z.namelist() else None
            parameters = tuple(_parameter(p) for p in raw["parameters"])
            constants = tuple(stored[f"constant{i}"] for i in range(len(stored)))
        except (zipfile.BadZipFile, EOFError, KeyError, TypeError, ValueError, SafetensorError) as e:
            raise ValueError(f"{path}: not a saved XLA program ({type(e).__name__}: {e})") from e
        hlo = HloProgram(module=module, text=text, parameters=parameters, constants=constants, neff=neff)
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=hlo)

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """Check the weights against the parameter map and put them on the device (once per weight set)."""
        _, builder, xlac = _xla()
        hlo: HloProgram = program.payload
        sig = program.signature
        problems = _weight_problems(hlo, sig, weights.tensors)
        if problems:
            return Failure(CheckpointError(problems=tuple(problems)))
        device = self.device
        on_device = [
            weights.derive(f"xla:{name}", lambda w=w: w.to(device))
            for name, w in zip(sig.weights, weights.tensors, strict=True)
        ]
        constants = [c.to(device) for c in hlo.constants]
        opname = f"xla::nxdi_{program.name}"
        computation = builder.computation_from_module_proto(opname, hlo.module)

        def call(*rest: Tensor) -> tuple[Tensor, ...]:
            flat = [*on_device, *(t.to(device) for t in rest)]
            args = [constants[p.index] if p.kind == "constant" else flat[p.index] for p in hlo.parameters]
            return tuple(xlac._xla_user_computation(opname, args, computation))

        return Success(LoadedProgram(program=program, call=call, in_place=(False,) * len(sig.cache)))

    def run(
        self, loaded: LoadedProgram, cache: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """`(outputs, new_cache)` as lazy device tensors; the runtime writes the cache back, then `finish`es."""
        flat = loaded.call(*cache, *inputs)
        n = len(loaded.program.signature.outputs)
        return tuple(flat[:n]), tuple(flat[n:])

    def collectives(self, world: int) -> Collectives:
        """HLO collectives among `world` partitions (see `collectives`)."""
        return collectives(world)

    def finish(self, tensors: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
        """Execute the step (everything pending on the device, cache updates included) and bring
        `tensors` back to the host."""
        torch_xla, _, _ = _xla()
        torch_xla.sync()
        return tuple(None if t is None else t.cpu() for t in tensors)

    def hlo_text(self, program: CompiledProgram) -> str:
        """The program's HLO module as text."""
        hlo: HloProgram = program.payload
        return hlo.text

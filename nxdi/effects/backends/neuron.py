"""The Neuron backend: the xla backend's HLO modules, compiled by neuronx-cc and run on NeuronCores.
Effects: imports torch-neuronx lazily, runs the neuronx-cc compiler, reads and writes program files,
moves tensors to and from the Neuron device.

A program is lowered exactly as the xla backend lowers it (`xla.lower`: the same HloModuleProto,
parameter map and cache aliases the XLA tier verifies on XLA:CPU), then handed to neuronx-cc as an
XLA module (`neuronx-cc compile --framework XLA module.hlo.pb --output model.neff`), so a program
that does not compile for the target fails at `compile()`, naming the program and quoting the
compiler. Weights stay HLO parameters, out of the NEFF: one weights file (or every rank's shard)
serves every bucket, and binding is a copy to the device, not a compile.

A saved program (`.neuron`) is the xla backend's zip plus `model.neff`. At run time the module
goes through torch-xla's Neuron device (the PJRT plugin torch-neuronx registers), where the KV
cache stays on the device and is donated and updated in place step by step, as on XLA:CPU. With
tensor parallelism the ranks run SPMD over the process's NeuronCores (`xla_spmd`), the HLO
collectives crossing the cores.

Without a Neuron device this backend is verified up to its last step: the XLA tier compiles through
it with a stand-in `neuronx-cc` that checks what it is given, and `tests/hardware` holds the tests
that run where a device exists.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import attrs
import torch
from returns.result import Result
from torch import Tensor

from nxdi.core.errors import CheckpointError
from nxdi.core.programs.collectives import Collectives
from nxdi.effects.backends import base, xla
from nxdi.effects.backends.base import CompiledProgram, FlatProgram, LoadedProgram, Signature, WeightSet

FORMAT = 2
"""Bumped whenever what `compile` saves changes meaning (part of `version()`)."""

INSTALL_HINT = (
    "the Neuron backend needs torch-neuronx and neuronx-cc, which are not installed. They come from "
    "the AWS Neuron package repository: on a Trainium/Inferentia instance with the Neuron driver and "
    "runtime, run `pip install 'nxdi[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com`. "
    "Without a Neuron device, use the CPU backend (the default)."
)

COMPILE_TIMEOUT = 4 * 3600
"""Seconds one program may take in neuronx-cc (large buckets of large models take an hour)."""


class NeuronUnavailableError(ImportError):
    """torch-neuronx or neuronx-cc cannot be imported."""


class NeuronCompileError(RuntimeError):
    """neuronx-cc refused a program."""


def _import(name: str) -> ModuleType:
    return base.import_optional(name, NeuronUnavailableError, INSTALL_HINT)


def _neuronx() -> ModuleType:
    """torch_neuronx, imported (which registers the Neuron device with torch-xla)."""
    return _import("torch_neuronx")


def register_device() -> None:
    """Make torch-xla's device the Neuron device (import torch-neuronx before torch-xla starts).

    Raises:
        NeuronUnavailableError: torch-neuronx is not installed.
    """
    _neuronx()


def compile_neff(module: bytes, compiler_args: Sequence[str], *, name: str) -> bytes:
    """The NEFF neuronx-cc makes of the serialized HloModuleProto `module`.

    Raises:
        NeuronUnavailableError: no `neuronx-cc` on PATH.
        NeuronCompileError: the compiler failed (its output quoted) or ran past COMPILE_TIMEOUT.
    """
    compiler = shutil.which("neuronx-cc")
    if compiler is None:
        raise NeuronUnavailableError(f"{INSTALL_HINT} (no neuronx-cc executable on PATH)")
    with tempfile.TemporaryDirectory(prefix="nxdi-neuronx-cc-") as work:
        hlo, neff = Path(work) / xla.MODULE, Path(work) / xla.NEFF
        hlo.write_bytes(module)
        command = [compiler, "compile", "--framework", "XLA", str(hlo), "--output", str(neff), *compiler_args]
        try:
            done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            raise NeuronCompileError(f"{name}: neuronx-cc ran past {COMPILE_TIMEOUT} s") from e
        if done.returncode != 0 or not neff.is_file():
            tail = (done.stdout + done.stderr)[-4000:]
            raise NeuronCompileError(f"{name}: neuronx-cc failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
        return neff.read_bytes()


@attrs.frozen(kw_only=True)
class NeuronBackend:
    """HLO modules compiled by neuronx-cc with separated weights, run on the Neuron device."""

    compiler_args: tuple[str, ...] = ()
    """Extra neuronx-cc arguments (e.g. `--auto-cast=none`, `--target=trn2`)."""
    name: str = "neuron"
    suffix: str = ".neuron"
    runner: xla.XlaBackend = attrs.field(factory=xla.XlaBackend)
    """Lowers and runs the modules (torch-xla, on the device torch-neuronx registers)."""

    def version(self) -> str:
        """torch-xla, torch-neuronx and neuronx-cc versions and the compiler arguments (they change the NEFF).

        Raises:
            NeuronUnavailableError: torch-neuronx or neuronx-cc is not installed.
        """
        neuronx, cc = _neuronx(), _import("neuronxcc")
        args = " ".join(self.compiler_args)
        versions = f"torch-neuronx-{neuronx.__version__}/neuronx-cc-{cc.__version__}"
        return f"neuron-hlo-{FORMAT}/{self.runner.version()}/{versions}/[{args}]"

    @property
    def device(self) -> torch.device:
        """The Neuron device (torch-xla's device once torch-neuronx is imported)."""
        _neuronx()
        return self.runner.device

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Lower `fn` as the xla backend does, then compile the module with neuronx-cc.

        Raises:
            NeuronUnavailableError: torch-neuronx or neuronx-cc is not installed.
            NeuronCompileError: neuronx-cc refused the module.
            ValueError: `example` does not have the signature's arity.
        """
        _neuronx()
        lowered = self.runner.compile(fn, signature, example, name=name)
        hlo: xla.HloProgram = lowered.payload
        neff = compile_neff(hlo.module, self.compiler_args, name=name)
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=attrs.evolve(hlo, neff=neff))

    def save(self, program: CompiledProgram, path: Path) -> None:
        """The xla backend's zip with the NEFF beside the module."""
        self.runner.save(program, path)

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        """Read a program written by `save`.

        Raises:
            NeuronUnavailableError: torch-neuronx is not installed.
            ValueError: the file is not a saved program of this backend (no NEFF in it).
        """
        _neuronx()
        program = self.runner.load(path, signature, name=name)
        if program.payload.neff is None:
            raise ValueError(f"{path}: holds no NEFF (was it compiled by the xla backend?)")
        return attrs.evolve(program, backend=self.name)

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """Check the weights against the parameter map and put them on the device (once per weight set)."""
        _neuronx()
        return self.runner.bind(program, weights)

    def run(
        self, loaded: LoadedProgram, cache: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """`(outputs, new_cache)`, lazy on the device (see `XlaBackend.run`)."""
        return self.runner.run(loaded, cache, inputs)

    def collectives(self, world: int) -> Collectives:
        """HLO collectives among `world` NeuronCores (see `xla.collectives`)."""
        return self.runner.collectives(world)

    def finish(self, tensors: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
        """Execute the step on the device and bring `tensors` back to the host."""
        return self.runner.finish(tensors)

    def hlo_text(self, program: CompiledProgram) -> str:
        """The program's HLO module as text (what neuronx-cc was given)."""
        return self.runner.hlo_text(program)

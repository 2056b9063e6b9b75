"""The Neuron backend: programs compiled by neuronx-cc through `torch_neuronx.trace`, run on NeuronCores.
Effects: imports torch-neuronx lazily, runs the Neuron compiler, reads and writes TorchScript files.

Same calling convention as every backend (`nxdi.effects.backends.base`). Weights are kept out of
the NEFF (`inline_weights_to_neff=False`): the traced module holds them as parameters, a saved
program carries the graph, and `bind` swaps in the checkpoint's tensors with
`torch_neuronx.replace_weights`, so one weights file serves every bucket here too.

Status: written against the documented torch-neuronx API; it has not run on a Neuron device in
this project's CI (tests/hardware covers it where a device exists). The KV cache is passed in and
returned like any tensor, so each step copies it between host and device.
TODO(#4): keep the cache on the device with `input_output_aliases` once a device can test it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import CheckpointError, Problem
from nxdi.effects.backends.base import CompiledProgram, FlatProgram, LoadedProgram, Signature, WeightSet

FORMAT = 1

INSTALL_HINT = (
    "the Neuron backend needs torch-neuronx and neuronx-cc, which are not installed. They come from "
    "the AWS Neuron package repository: on a Trainium/Inferentia instance with the Neuron driver and "
    "runtime, run `pip install 'nxdi[neuron]' --extra-index-url https://pip.repos.neuron.amazonaws.com`. "
    "Without a Neuron device, use the CPU backend (the default)."
)


class NeuronUnavailableError(ImportError):
    """torch-neuronx or neuronx-cc cannot be imported."""


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise NeuronUnavailableError(f"{INSTALL_HINT} (import {name!r} failed: {e})") from e


def _slot(name: str) -> str:
    """A parameter name for a weight name (module attribute names cannot hold dots)."""
    return name.replace(".", "__")


class _WithWeights(torch.nn.Module):
    """The flat program with its weights as parameters, so neuronx-cc keeps them out of the NEFF."""

    def __init__(self, fn: FlatProgram, names: Sequence[str], weights: Sequence[Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.order = [_slot(n) for n in names]
        self.params = torch.nn.ParameterDict(
            {s: torch.nn.Parameter(w, requires_grad=False) for s, w in zip(self.order, weights, strict=True)}
        )

    def forward(self, *rest: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.fn(*(self.params[s] for s in self.order), *rest))


@attrs.frozen(kw_only=True)
class NeuronBackend:
    """torch_neuronx.trace programs with separated weights."""

    compiler_args: tuple[str, ...] = ()
    """Extra neuronx-cc arguments (e.g. `--auto-cast=none`, `--target=trn2`)."""
    name: str = "neuron"
    suffix: str = ".pt"

    def version(self) -> str:
        """torch-neuronx and neuronx-cc versions and the compiler arguments (they change the NEFF).

        Raises:
            NeuronUnavailableError: torch-neuronx or neuronx-cc is not installed.
        """
        neuronx, cc = _import("torch_neuronx"), _import("neuronxcc")
        args = " ".join(self.compiler_args)
        return f"neuron-trace-{FORMAT}/torch-neuronx-{neuronx.__version__}/neuronx-cc-{cc.__version__}/[{args}]"

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Trace and compile with neuronx-cc; weights become separated parameters.

        Raises:
            NeuronUnavailableError: torch-neuronx is not installed.
            ValueError: `example` does not have the signature's arity.
        """
        neuronx = _import("torch_neuronx")
        if len(example) != signature.arity:
            raise ValueError(f"{name}: {len(example)} example tensors for a signature of arity {signature.arity}")
        w = len(signature.weights)
        module = _WithWeights(fn, signature.weights, example[:w])
        traced = neuronx.trace(
            module, tuple(example[w:]), inline_weights_to_neff=False, compiler_args=list(self.compiler_args)
        )
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=traced)

    def save(self, program: CompiledProgram, path: Path) -> None:
        """TorchScript file with the NEFF inside (parameters are replaced at bind)."""
        torch.jit.save(program.payload, str(path))

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        """Read a saved program (importing torch_neuronx registers the Neuron ops TorchScript needs)."""
        _import("torch_neuronx")
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=torch.jit.load(str(path)))

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """Replace the program's weights with `weights` (in place: load a program once per weight set)."""
        neuronx = _import("torch_neuronx")
        sig = program.signature
        if len(weights.tensors) != len(sig.weights):
            problem = Problem.of("weights", len(weights.tensors), f"the program takes {len(sig.weights)} weights")
            return Failure(CheckpointError(problems=(problem,)))
        state = {f"params.{_slot(n)}": w for n, w in zip(sig.weights, weights.tensors, strict=True)}
        neuronx.replace_weights(program.payload, state)
        return Success(LoadedProgram(program=program, call=program.payload, in_place=(False,) * len(sig.cache)))

    @property
    def device(self) -> torch.device:
        """The host: the runtime's cache lives in host memory."""
        return torch.device("cpu")

    def finish(self, tensors: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
        """Nothing is deferred: the outputs as they are."""
        return tuple(tensors)

    def run(
        self, loaded: LoadedProgram, cache: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """`(outputs, new_cache)`; the cache comes back as new tensors."""
        flat = loaded.call(*cache, *inputs)
        n = len(loaded.program.signature.outputs)
        return tuple(flat[:n]), tuple(flat[n:])

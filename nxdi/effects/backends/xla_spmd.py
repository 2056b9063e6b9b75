"""Tensor parallelism on the xla and neuron backends: every rank's program in one process, run SPMD
over `partitions` XLA devices (virtual CPU devices on XLA:CPU, NeuronCores on a Neuron device). Effects: switches torch-xla
to SPMD mode, moves tensors to the XLA devices, runs programs.

A tensor-parallel program is lowered once (`xla.lower`, rank 0's shapes, its rank an input, its
collectives HLO all-gathers and reduce-scatters over every partition): the same module every
Neuron rank would run. Here one process runs it on all partitions at once:

- every per-rank tensor (a weight shard, a cache) is a *global* tensor `[partitions, *shape]`
  sharded along dim 0, so partition r holds rank r's tensor;
- a step enters a manual-sharding region, where each partition sees its own `[*shape]` slice,
  calls the HLO module there (its collectives cross the partitions), and leaves it again: the
  results are global tensors, rank 0's outputs are returned, the new caches stay sharded;
- inputs that every rank gets alike (token ids, positions, sampling parameters) are replicated,
  and the rank input is each partition's index.

XLA must be in SPMD mode before any XLA tensor exists, with as many devices as partitions: on
XLA:CPU the process is started with `CPU_NUM_DEVICES=partitions` (`nxdi.effects.distributed.launch`);
on Neuron it must see that many NeuronCores (NEURON_RT_VISIBLE_CORES).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import CheckpointError
from nxdi.core.programs.collectives import RANK_INPUT, Collectives
from nxdi.effects.backends import neuron, xla
from nxdi.effects.backends.base import CompiledProgram, FlatProgram, LoadedProgram, Signature, WeightSet
from nxdi.effects.backends.neuron import NeuronBackend


@functools.cache
def _spmd(partitions: int) -> tuple[Any, Any]:
    """torch_xla's sharding module and the 1-d mesh `("r",)` of `partitions` devices, SPMD on.

    Raises:
        XlaUnavailableError: torch-xla is not installed.
        RuntimeError: the process does not see `partitions` XLA devices.
    """
    xr = xla._import("torch_xla.runtime")
    xs = xla._import("torch_xla.distributed.spmd")
    numpy = xla._import("numpy")
    xr.use_spmd()
    found = xr.global_runtime_device_count()
    if found != partitions:
        raise RuntimeError(
            f"tp_degree={partitions} runs over {partitions} XLA devices, this process has {found}: on XLA:CPU "
            f"start it with CPU_NUM_DEVICES={partitions} (nxdi's rank process is), on Neuron give it "
            f"{partitions} NeuronCores (NEURON_RT_VISIBLE_CORES)"
        )
    return xs, xs.Mesh(numpy.arange(partitions), (partitions,), ("r",))


def _spec(t: Tensor) -> tuple[str | None, ...]:
    return ("r", *([None] * (t.dim() - 1)))


def _placed(t: Tensor, device: torch.device, xs: Any, mesh: Any) -> Tensor:
    """`t` on the device, sharded along dim 0 (no checks: called for every input of every step)."""
    g = t.to(device)
    xs.mark_sharding(g, mesh, _spec(g))
    return g


@attrs.frozen(kw_only=True)
class XlaSpmdBackend:
    """The programs of `lowering` (the xla or the neuron backend), one per rank, run as one SPMD
    program over `partitions` devices.

    Compiled folders are `lowering`'s (same name, version and files): a folder compiled at tp N by
    `XlaBackend()` loads here with `partitions=N`.
    """

    partitions: int
    lowering: xla.XlaBackend | NeuronBackend = attrs.field(factory=xla.XlaBackend)

    @property
    def name(self) -> str:
        return self.lowering.name

    @property
    def suffix(self) -> str:
        return self.lowering.suffix

    def version(self) -> str:
        """The single-device backend's version (the programs are the same)."""
        return self.lowering.version()

    def _mesh(self) -> tuple[Any, Any]:
        """torch_xla's sharding module and the mesh, SPMD on over the backend's devices."""
        if isinstance(self.lowering, NeuronBackend):
            neuron.register_device()  # before torch-xla starts, so that it finds the NeuronCores
        return _spmd(self.partitions)

    @property
    def device(self) -> torch.device:
        """The XLA device the global tensors live on."""
        self._mesh()
        return self.lowering.device

    def shard(self, t: Tensor) -> Tensor:
        """Host `[partitions, *shape]` (rank r's tensor at r) to a device tensor sharded along dim 0."""
        xs, mesh = self._mesh()
        if t.shape[0] != self.partitions:
            raise ValueError(f"a per-rank tensor leads with {self.partitions} ranks, not {tuple(t.shape)}")
        return _placed(t, self.device, xs, mesh)

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Lower as the xla backend does (rank 0's program)."""
        return self.lowering.compile(fn, signature, example, name=name)

    def save(self, program: CompiledProgram, path: Path) -> None:
        self.lowering.save(program, path)

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        return self.lowering.load(path, signature, name=name)

    def hlo_text(self, program: CompiledProgram) -> str:
        return self.lowering.hlo_text(program)

    def collectives(self, world: int) -> Collectives:
        return self.lowering.collectives(world)

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """Check every rank's weights (`weights.tensors`: `[partitions, *shape]`, rank r's shard at
        r) against the parameter map and shard them over the devices (once per weight set)."""
        _, builder, xlac = xla._xla()
        xs, mesh = self._mesh()
        hlo: xla.HloProgram = program.payload
        sig = program.signature
        problems = xla._weight_problems(hlo, sig, [w[0] for w in weights.tensors])
        if problems:
            return Failure(CheckpointError(problems=tuple(problems)))
        sharded = [
            weights.derive(f"xla-spmd:{name}", lambda w=w: self.shard(w))
            for name, w in zip(sig.weights, weights.tensors, strict=True)
        ]
        constants = [self.shard(c[None].expand(self.partitions, *c.shape)) for c in hlo.constants]
        rank_at = len(sig.weights) + len(sig.cache) + sig.inputs.index(RANK_INPUT) if RANK_INPUT in sig.inputs else None
        ranks = self.shard(torch.arange(self.partitions))
        device = self.device
        opname = f"xla::nxdi_spmd_{program.name}"
        computation = builder.computation_from_module_proto(opname, hlo.module)

        def local(g: Tensor) -> Tensor:
            return xs.enable_manual_sharding(g, _spec(g), mesh=mesh).global_tensor[0]

        def call(cache: Sequence[Tensor], inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
            first = len(sharded) + len(cache)
            replicated = [
                ranks if first + i == rank_at else _placed(t[None].expand(self.partitions, *t.shape), device, xs, mesh)
                for i, t in enumerate(inputs)
            ]
            flat = [*sharded, *cache, *replicated]
            args = [local(constants[p.index] if p.kind == "constant" else flat[p.index]) for p in hlo.parameters]
            results = xlac._xla_user_computation(opname, args, computation)
            return tuple(
                xs.disable_manual_sharding(
                    r[None], _spec(r[None]), (self.partitions, *r.shape), mesh=mesh
                ).global_tensor
                for r in results
            )

        return Success(LoadedProgram(program=program, call=call, in_place=(False,) * len(sig.cache)))

    def run(
        self, loaded: LoadedProgram, cache: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """`(rank 0's outputs, every rank's new cache)`, lazy; `cache` is global `[partitions, ...]`."""
        flat = loaded.call(cache, inputs)
        n = len(loaded.program.signature.outputs)
        return tuple(o[0] for o in flat[:n]), tuple(flat[n:])

    def finish(self, tensors: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
        """Execute the step and bring `tensors` back to the host."""
        return self.lowering.finish(tensors)

"""The CPU backend: torch.export programs with weights as inputs, prepacked and run in place at load.
Effects: traces (torch.export), writes and reads `.pt2` program files, allocates packed weights.

Route (chosen by measurement, numbers in docs/cpu-backend.md):
- `compile` traces the pure flat program once per sub-model and bucket with `torch.export`
  (non-strict). Weights are *user inputs* of the exported graph, so a saved program holds the
  graph only (hundreds of KB), never weight bytes; one weights file serves every bucket.
- `load` deserializes the graph (`torch.export.load`); the Python program is not called again.
- `bind` turns the graph into a module bound to the weights and applies two load-time rewrites
  (`cpu_passes`): linears on oneDNN-prepacked weight copies, and in-place KV cache writes. Both
  keep the pure program's results; they are what makes decode fast here (the graph runs eagerly,
  op by op, so nothing is compiled at load and a load takes about a second). Last, its long runs
  of ops are handed to a runner that calls them from C++ (`cpu_runner`), the same calls in order.
- Why not Inductor: `torch.compile` with `freezing=True` prepacks too but cannot be cached
  ("mkldnn tensors unpickleable"), so it recompiles for tens of seconds per bucket on every load;
  without freezing, and in AOTInductor packages, weights stay in plain layout and decode is no
  faster than this route (docs/cpu-backend.md has the table).

Calling convention: see `nxdi.effects.backends.base`. A run's cache is consumed: with in-place
writes the returned cache tensors *are* the given ones, updated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor, fx

from nxdi.core.errors import CheckpointError, Problem
from nxdi.effects.backends import cpu_attention_blocks, cpu_fusions, cpu_passes, cpu_runner, kernels
from nxdi.effects.backends.base import CompiledProgram, FlatProgram, LoadedProgram, Signature, WeightSet

_KERNEL_WEIGHTS = (torch.bfloat16, torch.int8)
"""Weight dtypes whose decode linears run nxdi's own kernels (`kernels/`) once bound."""

FORMAT = 1
"""Bumped whenever what `compile` saves changes meaning (part of `version()`)."""


class _Flat(torch.nn.Module):
    """A module around a flat program, the form `torch.export` traces."""

    def __init__(self, fn: FlatProgram) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *flat: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.fn(*flat))


def _check_traced(ep: torch.export.ExportedProgram, signature: Signature, example: Sequence[Tensor]) -> None:
    """The traced graph has the signature's arity and returns caches shaped like its cache inputs."""
    n_out = len(ep.graph_signature.user_outputs)
    want = len(signature.outputs) + len(signature.cache)
    if n_out != want:
        raise ValueError(f"the program returned {n_out} tensors; its signature says {want} (outputs + cache)")
    outs = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    first = len(signature.weights)
    for i, name in enumerate(signature.cache):
        got, given = outs[len(signature.outputs) + i].meta["val"], example[first + i]
        if tuple(got.shape) != tuple(given.shape) or got.dtype != given.dtype:
            raise ValueError(
                f"cache {name!r} goes in as {tuple(given.shape)} {given.dtype} but comes out as "
                f"{tuple(got.shape)} {got.dtype}; a step must return each cache tensor unchanged in shape and dtype"
            )


def _weight_problems(graph_inputs: Sequence[fx.Node], signature: Signature, weights: Sequence[Tensor]) -> list[Problem]:
    """Every bound weight whose count, shape or dtype differs from what the program was traced with."""
    if len(weights) != len(signature.weights):
        return [Problem.of("weights", len(weights), f"the program takes {len(signature.weights)} weights")]
    problems = []
    for name, node, w in zip(signature.weights, graph_inputs, weights, strict=False):
        want = node.meta["val"]
        if tuple(w.shape) != tuple(want.shape) or w.dtype != want.dtype:
            problems.append(
                Problem.of(
                    name,
                    f"{tuple(w.shape)} {w.dtype}",
                    f"the program was compiled for {tuple(want.shape)} {want.dtype}",
                    "recompile for this checkpoint, or bind the checkpoint it was compiled for",
                )
            )
    return problems


def _plain_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """`ep.module()` with flat positional inputs/outputs and without the per-call input guards.

    The guards re-check every input's shape on each call (the runtime already picked the bucket
    whose shapes these are), `_assert_tensor_metadata` nodes re-check dtypes fixed at trace time,
    and the pytree codegen re-flattens the arguments; all are pure per-call overhead in a decode loop.
    """
    gm = ep.module()
    graph = gm.graph
    for node in list(graph.nodes):
        guard = node.op == "call_module" and str(node.target) == "_guards_fn"
        if guard or node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    graph.set_codegen(fx.graph.CodeGen())
    return gm


@attrs.frozen(kw_only=True)
class CpuBackend:
    """torch.export programs run eagerly on CPU, with prepacked weights and in-place cache writes."""

    pack_weights: bool = True
    """Fast linears at bind time: decode-sized bf16 ones run nxdi's kernel, the rest read weights prepacked
    for oneDNN (extra memory: one copy of those weights), int8 ones an int8 kernel."""
    in_place_cache: bool = True
    """Write the KV cache in place when the graph allows it (else every step copies each cache view)."""
    cpp_runner: bool = True
    """Call the bound graph's long runs of ops from C++ (`cpu_runner`), where nxdi's kernels load."""
    name: str = "cpu"
    suffix: str = ".pt2"

    def version(self) -> str:
        """Saved-program format and torch version: a program is reused only under both."""
        return f"cpu-export-{FORMAT}/torch-{torch.__version__}"

    def compile(
        self, fn: FlatProgram, signature: Signature, example: Sequence[Tensor], *, name: str
    ) -> CompiledProgram:
        """Trace `fn` with `torch.export` at the shapes of `example` (W + C + I tensors).

        Raises:
            ValueError: `example` does not have the signature's arity, or the program's results do
                not match the signature (the program or signature is wrong; nothing to recover).
        """
        if len(example) != signature.arity:
            raise ValueError(f"{name}: {len(example)} example tensors for a signature of arity {signature.arity}")
        with torch.no_grad():
            ep = torch.export.export(_Flat(fn), tuple(example), strict=False)
        _check_traced(ep, signature, example)
        ep.example_inputs = None  # they include the weights; a saved program must not
        weights = example[: len(signature.weights)]
        if self.cpp_runner or (self.pack_weights and any(w.dtype in _KERNEL_WEIGHTS for w in weights)):
            # Build nxdi's kernels library now (once per machine and torch version, ~40 s; the graph
            # runner is in it, for every dtype), so that load() only loads it; where it cannot be
            # built, load() falls back anyway.
            kernels.load()
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=ep)

    def save(self, program: CompiledProgram, path: Path) -> None:
        """Write the exported graph (no weights) to `path`."""
        torch.export.save(program.payload, str(path))

    def load(self, path: Path, signature: Signature, *, name: str) -> CompiledProgram:
        """Read a program saved by `save`; nothing is traced.

        Raises:
            ValueError: the file holds a program of a different arity (a manifest/program mix-up).
        """
        ep = torch.export.load(str(path))
        n_in = len(ep.graph_signature.user_inputs)
        if n_in != signature.arity:
            raise ValueError(f"{path}: the program takes {n_in} inputs but its manifest entry names {signature.arity}")
        return CompiledProgram(name=name, signature=signature, backend=self.name, payload=ep)

    def bind(self, program: CompiledProgram, weights: WeightSet) -> Result[LoadedProgram, CheckpointError]:
        """A runnable program with `weights` bound (prepacked, and the cache written in place, when enabled).

        Returns:
            The loaded program, or a CheckpointError naming every weight whose count, shape or dtype
            differs from what the program was compiled for.
        """
        sig = program.signature
        gm = _plain_module(program.payload)
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        problems = _weight_problems(inputs, sig, weights.tensors)
        if problems:
            return Failure(CheckpointError(problems=problems))
        w_nodes = inputs[: len(sig.weights)]
        c_nodes = inputs[len(sig.weights) : len(sig.weights) + len(sig.cache)]
        cpu_passes.drop_identity_conversions(gm)
        cpu_passes.eliminate_common_subexpressions(gm)
        cpu_passes.fold_constants(gm)
        if self.pack_weights:
            packable = cpu_passes.packable_dtypes()
            cpu_passes.bf16_weight_linears(gm, w_nodes, weights)
            cpu_passes.prepack_linears(gm, w_nodes, sig.weights, weights, packable)
            cpu_passes.quantized_weight_linears(gm, w_nodes, sig.weights, weights)
            cpu_fusions.fused_rms_norms(gm)
            cpu_fusions.fused_residual_norms(gm)
            cpu_fusions.fused_ropes(gm)
            cpu_fusions.decode_attentions(gm)
            cpu_fusions.fused_swiglus(gm)
        in_place = cpu_passes.reinplace_cache_writes(gm, c_nodes) if self.in_place_cache else (False,) * len(c_nodes)
        cpu_passes.scatter_half_floats_as_bits(gm)  # bit for bit torch's scatter, so in every form
        if self.pack_weights:
            cpu_attention_blocks.fused_attention_blocks(gm)  # matches the in-place int16 scatters above
        constants = cpu_passes.constants_as_inputs(gm)
        if self.cpp_runner and kernels.load():
            cpu_runner.run_in_cpp(gm, (*constants, *weights.tensors))
        gm.recompile()
        call = functools.partial(gm.forward, *constants, *weights.tensors)
        return Success(LoadedProgram(program=program, call=call, in_place=in_place))

    def collectives(self, world: int) -> None:
        """The programs call torch.distributed ops (`nxdi.effects.distributed.ops`)."""
        return None

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
        """`(outputs, new_cache)`; cache tensors written in place come back as the same objects.

        Runs under `no_grad`, not `inference_mode`: results stay ordinary tensors the caller may
        modify in place later (inference tensors refuse that outside inference mode).
        """
        with torch.no_grad():
            flat = loaded.call(*cache, *inputs)
        n = len(loaded.program.signature.outputs)
        return tuple(flat[:n]), tuple(flat[n:])

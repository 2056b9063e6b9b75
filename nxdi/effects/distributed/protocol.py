"""What the driver and a rank process say to each other: requests, replies, and how they travel.
Effects: reads and writes pipes.

The driver (the user's process) sends every rank the same request, in the same order; each rank
answers with a `Reply`. Requests and replies are frozen values pickled whole (tensors included)
and framed by `multiprocessing.connection` over the rank process's stdin and stdout.

- `Build`: make this rank's runtime, eagerly (`to_cpu`) or from a compiled folder (`load`); or,
  kind "spmd", every rank's runtime in the one process (the xla backend, `distributed.spmd`).
- `Run`: one step of one program (its `ProgramKey`); every rank runs it, rank 0 returns the outputs
  (a `nxdi.core.programs.step.StepOutputs`: logits, tokens and any extra outputs).
- `RunBlocks`: the same for a block-KV program (`is_block_kv_layout`), on every rank's whole block
  cache (each rank holds its KV heads of every block).
- `WriteLoraSlots`: dynamic multi-LoRA swaps; each rank copies its slices into its slots.
- `ResetCache`, `Close`.
- `Probe`: the rank's counters (collective calls and time, memory), for benchmarks.

A rank answers `Reply(ok=True, value=...)`, or `Reply(ok=False, ...)` carrying either an expected
failure as its error value (a CheckpointError or ArtifactError the driver turns into the
documented exception) or the traceback of an unexpected one.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal

import attrs
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.effects.backends.base import Backend


@attrs.frozen(kw_only=True)
class Build:
    """Make this rank's runtime."""

    kind: Literal["eager", "compiled", "spmd"]
    model: ModelSpec
    spec: NeuronSpec
    source: Any
    """The `nxdi.effects.engine.CheckpointSource` of the weights."""
    root: str | None = None
    """The compiled-model folder (kinds "compiled" and "spmd")."""
    backend: Backend | None = None
    """The backend that compiled the folder (kind "compiled")."""
    graph_key: str = ""
    warmup: bool = True


@attrs.frozen(eq=False, kw_only=True)
class Run:
    """One step: every rank runs the program `key` on the same inputs."""

    key: ProgramKey
    inputs: tuple[Tensor, ...]
    """input_ids, position_ids, last_index (and a multi-LoRA model's adapter slots: `StepInputs.to_tensors`)."""
    rows: Tensor | None
    params: Tensor
    uniforms: Tensor
    """The driver's random draws, so every rank samples alike."""


@attrs.frozen(eq=False, kw_only=True)
class RunBlocks:
    """One block-KV step: every rank runs the program `key` on the same inputs and block tables."""

    key: ProgramKey
    inputs: tuple[Tensor, ...]
    """input_ids, position_ids, last_index (which a block program ignores: each segment's output
    token is `blocks.out_index`)."""
    blocks: BlockInputs
    """Where every token reads and writes in the block cache (the same blocks on every rank)."""
    params: Tensor
    """[B*R, 3] sampling parameters, one row per segment."""
    uniforms: Tensor
    """[B*R] the driver's random draws, so every rank samples alike."""


@attrs.frozen(eq=False, kw_only=True)
class WriteLoraSlots:
    """Dynamic multi-LoRA: copy adapters into device slots (each rank takes its slices)."""

    writes: tuple[tuple[int, dict[str, Tensor]], ...]
    """(slot, one adapter's whole slot tensors by name), in order."""


@attrs.frozen(kw_only=True)
class ResetCache:
    """Zero the KV cache."""


@attrs.frozen(kw_only=True)
class Close:
    """Leave the process group and exit."""


@attrs.frozen(kw_only=True)
class Probe:
    """Report this rank's collective counters (then zero them when `reset`) and its memory."""

    reset: bool = False


Request = Build | Run | RunBlocks | WriteLoraSlots | ResetCache | Close | Probe


@attrs.frozen(kw_only=True)
class RankProbe:
    """What a rank reports to a `Probe`."""

    rank: int
    collectives: dict[str, tuple[int, float]]
    """Collective name -> (calls, seconds, waiting included) since the last reset."""
    anon_before_build: int = 0
    """Anonymous resident bytes when its runtime started building (interpreter, torch, process group)."""
    peak_anon_in_build: int = 0
    """The most anonymous resident bytes seen while building (reading weights, loading programs)."""


@attrs.frozen(eq=False, kw_only=True)
class Reply:
    """A rank's answer."""

    ok: bool
    value: Any = None
    """The result (ok), or the expected failure's error value."""
    traceback: str = ""
    """An unexpected failure's traceback (then `value` is None)."""


def send(conn: Any, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Any) -> Any:
    """The next message (raises EOFError when the other side is gone)."""
    return pickle.loads(conn.recv_bytes())

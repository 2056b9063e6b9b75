"""Rank processes on this host, one per tensor-parallel rank, driven by the user's process.
Effects: starts, watches and stops processes; talks to them over pipes; keeps their logs.

Theory of operation:
- `RankGroup(world)` starts `world` rank processes (`nxdi.effects.distributed.worker`), which form
  a gloo process group on a free local port. The user's process is the driver: it sends every rank
  the same request and collects their replies (`call`).
- Nothing hangs: while waiting, the driver polls every rank process. A rank that exits (killed,
  crashed) fails the call within a fraction of a second with a `RankError` naming it and quoting
  the end of its log; a rank that does not answer within the timeout fails it the same way. Either
  way every rank process is stopped first.
- Nothing is left behind: `close()`, garbage collection of the group and the driver's exit stop
  every rank (their pipes close, then any straggler is killed), and a rank dies with its driver
  even when the driver is killed (see the worker).
- `start(...)` builds a model's runtime in every rank and returns a `RemoteRuntime`: the Runtime
  calls the shell makes (run a step or a block-KV step, reset the cache, reseed), forwarded to
  every rank. The driver draws the sampling randomness once, so every rank samples alike, and gets
  the outputs from rank 0.
  A Build of kind "spmd" (the xla backend) starts one process that runs every rank itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.step import StepOutputs
from nxdi.effects.distributed import host_world, protocol
from nxdi.effects.distributed.errors import RankError
from nxdi.effects.runtime import LoraWrites, RandomStream

START_TIMEOUT = 900
"""Seconds every rank may take to start and build its runtime (reading weights, loading programs)."""
STEP_TIMEOUT = 300
"""Seconds a step may take on every rank before the ranks that did not answer are declared hung."""
HOST_KIB = 8192
"""Default shared-memory slot of the ranks' collectives (NXDI_HOST_COLLECTIVES_KIB): larger tensors go through gloo."""
_POLL = 0.05
_LOG_TAIL = 3000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(
    procs: list[subprocess.Popen[bytes]], conns: list[Connection], logs: Path, host: host_world.HostPlan | None
) -> None:
    """Close the pipes (ranks exit at their end), wait briefly, kill stragglers, drop the logs and
    the shared-memory file."""
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(logs, ignore_errors=True)
    if host is not None:
        host.close()


@attrs.frozen(kw_only=True)
class Node:
    """This host's share of a world spread over nodes: its ranks, and where the world meets."""

    first: int
    """The first rank this host runs (its ranks are `first .. first + count - 1`)."""
    count: int
    master_addr: str
    master_port: int


class RankGroup:
    """This host's rank processes of a `world`, and the pipes to them: every rank, or with `node`
    the node's ranks of a world spread over hosts.

    `host_kib` is the shared-memory slot of the ranks' collectives, in KiB (0: gloo only; see
    `host_world`; one host only); `threads` the intra-op threads of each rank (default: this
    process's torch threads shared out, so tensor parallelism uses the cores one rank would).
    """

    def __init__(
        self,
        world: int,
        *,
        threads: int | None = None,
        timeout: int | None = None,
        host_kib: int = HOST_KIB,
        environment: Mapping[str, str] | None = None,
        node: Node | None = None,
    ) -> None:
        self.world = world
        self.timeout = STEP_TIMEOUT if timeout is None else timeout
        self.logs = Path(tempfile.mkdtemp(prefix="nxdi-ranks-"))
        local = range(world) if node is None else range(node.first, node.first + node.count)
        self.ranks = tuple(local)
        """The global rank of each process this group holds, in order."""
        per_rank = threads or max(1, torch.get_num_threads() // len(local))
        addr, port = ("127.0.0.1", free_port()) if node is None else (node.master_addr, node.master_port)
        host = None
        if node is None and host_kib > 0 and world > 1:  # shared memory reaches this host's ranks only
            host = host_world.HostPlan(world, host_world.slot_bytes_for(host_kib))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.writers: list[Connection] = []
        self.readers: list[Connection] = []
        for rank in local:
            command = [sys.executable, "-m", "nxdi.effects.distributed.worker"]
            command += ["--rank", str(rank), "--world", str(world), "--master-port", str(port)]
            command += ["--master-addr", addr, "--lead", str(local[0])]
            command += ["--threads", str(per_rank), "--timeout", str(max(self.timeout, 60))]
            command += ["--parent", str(os.getpid())]
            if host is not None:
                command += ["--host-world", host.spec(rank).to_arg()]
            with open(self.logs / f"rank{rank}.log", "wb") as log:
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    pass_fds=host.fds(rank) if host is not None else (),
                    env=None if environment is None else dict(environment),
                )
            assert proc.stdin is not None and proc.stdout is not None
            self.writers.append(Connection(os.dup(proc.stdin.fileno()), readable=False))
            self.readers.append(Connection(os.dup(proc.stdout.fileno()), writable=False))
            proc.stdin.close()
            proc.stdout.close()
            self.procs.append(proc)
        if host is not None:
            host.close_pipes()
        conns = [*self.writers, *self.readers]
        self._finalizer = weakref.finalize(self, _stop, self.procs, conns, self.logs, host)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop every rank process (idempotent)."""
        self._finalizer()

    def _log_tail(self, rank: int) -> str:
        try:
            text = (self.logs / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""
        return text[-_LOG_TAIL:].strip()

    def abort(self) -> None:
        """Kill every rank process now (the others may be stuck in a collective with a lost rank)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.close()

    def _fail(self, index: int, why: str) -> RankError:
        """Stop the group because its `index`-th process (global rank `self.ranks[index]`) failed."""
        rank = self.ranks[index]
        tail = self._log_tail(rank)
        self.abort()
        quoted = "\n".join(f"    {line}" for line in tail.splitlines()) if tail else "    (empty)"
        message = (
            f"tensor-parallel rank {rank} of {self.world} {why}; every rank process was stopped. "
            f"Fix: load() or to_cpu() the model again. The end of rank {rank}'s log:\n{quoted}"
        )
        return RankError(message, rank)

    def call(self, request: protocol.Request, *, timeout: float | None = None) -> list[protocol.Reply]:
        """Send `request` to every rank of this group and return their replies in rank order.

        Raises:
            RankError: the group is closed, a rank process exited, or a rank did not answer within
                `timeout` seconds (default: the group's); every rank process is then stopped.
        """
        if self.closed:
            raise RankError("the tensor-parallel ranks were stopped; load() or to_cpu() the model again", -1)
        for rank, writer in enumerate(self.writers):
            try:
                protocol.send(writer, request)
            except OSError:
                raise self._fail(rank, f"is gone (exit code {self.procs[rank].poll()})") from None
        replies: list[Any] = [None] * len(self.procs)
        pending = set(range(len(self.procs)))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while pending:
            for conn in wait([self.readers[r] for r in pending], timeout=_POLL):
                rank = self.readers.index(conn)  # type: ignore[arg-type]
                try:
                    replies[rank] = protocol.receive(conn)
                except EOFError:  # it is exiting: give it a moment to report its exit code
                    try:
                        self.procs[rank].wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        raise self._fail(rank, "closed its pipe to the driver") from None
                    continue
                pending.discard(rank)
            dead = [r for r, p in enumerate(self.procs) if r in pending and p.poll() is not None]
            if dead:
                raise self._fail(dead[0], f"exited with code {self.procs[dead[0]].returncode}")
            if time.monotonic() > deadline:
                late = min(pending)
                raise self._fail(late, f"did not answer within {timeout or self.timeout:.0f} s (hung)")
        return replies


def _unexpected(group: RankGroup, replies: list[protocol.Reply]) -> RankError | None:
    for rank, reply in zip(group.ranks, replies, strict=True):
        if not reply.ok and reply.value is None:
            group.abort()
            return RankError(f"tensor-parallel rank {rank} failed:\n{reply.traceback}", rank)
    return None


class RemoteRuntime:
    """A model's runtime whose ranks run in rank processes (the `Runtime` calls the shell makes)."""

    def __init__(
        self, group: RankGroup, *, keys: Iterable[ProgramKey], seed: int = 0, deterministic: bool = False
    ) -> None:
        self.group = group
        self.random = RandomStream(seed=seed, deterministic=deterministic)
        self.programs: dict[ProgramKey, None] = dict.fromkeys(keys)
        """The compiled programs' keys; the programs themselves live in the rank processes."""

    def set_seed(self, seed: int) -> None:
        self.random.set_seed(seed)

    def _call(self, request: protocol.Request) -> Any:
        replies = self.group.call(request)
        error = _unexpected(self.group, replies)
        if error is not None:
            raise error
        return replies[0].value

    def run(
        self,
        key: ProgramKey,
        x: StepInputs,
        *,
        rows: Tensor | None,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs:
        """One step on every rank (see `Runtime.run`); the outputs come from rank 0."""
        draws = self.random.draw(x.input_ids.shape[0]) if uniforms is None else uniforms
        request = protocol.Run(key=key, inputs=x.to_tensors(), rows=rows, params=params, uniforms=draws)
        outputs: StepOutputs = self._call(request)
        return outputs

    def run_blocks(
        self,
        key: ProgramKey,
        x: StepInputs,
        blocks: BlockInputs,
        *,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs:
        """One block-KV step on every rank, each on its KV heads of the whole block cache (see
        `Runtime.run_blocks`); the outputs come from rank 0.

        Args:
            x: inputs [B, S] (B = `key.batch`, S = `key.tokens`).
            blocks: slots, block tables, prefixes, segments and output tokens of the rows.
            params: [B*R, 3] sampling parameters, one row per segment; `uniforms` [B*R] likewise
                (default: drawn here once, so every rank samples alike).

        Returns:
            logits [B, R, V] fp32 or None, tokens [B*R] or None, and the program's extras.

        Raises:
            RankError: a rank died, hung or failed (every rank process is then stopped).
        """
        draws = self.random.draw(params.shape[0]) if uniforms is None else uniforms
        request = protocol.RunBlocks(key=key, inputs=x.to_tensors(), blocks=blocks, params=params, uniforms=draws)
        outputs: StepOutputs = self._call(request)
        return outputs

    def write_lora_slots(self, writes: LoraWrites) -> None:
        """Every rank copies its slices of each adapter into its slot (see `Runtime.write_lora_slots`)."""
        self._call(protocol.WriteLoraSlots(writes=tuple((slot, dict(t)) for slot, t in writes)))

    def reset_cache(self) -> None:
        self._call(protocol.ResetCache())

    def probe(self, *, reset: bool = False) -> list[protocol.RankProbe]:
        """Every rank's counters (collectives since the last reset, memory of its build), in rank order."""
        replies = self.group.call(protocol.Probe(reset=reset))
        error = _unexpected(self.group, replies)
        if error is not None:
            raise error
        return [r.value for r in replies]

    def close(self) -> None:
        """Stop the rank processes."""
        self.group.close()


def start(
    build: protocol.Build,
    *,
    keys: Iterable[ProgramKey],
    threads: int | None = None,
    timeout: int | None = None,
    host_kib: int | None = None,
    environment: Mapping[str, str] | None = None,
    node: Node | None = None,
) -> Result[RemoteRuntime, Any]:
    """Start `build.spec.tp_degree` rank processes (one for a Build of kind "spmd", which runs
    every rank; with `node`, this node's ranks of the world) in `environment` (default: this
    process's) and build the model's runtime in each; outputs come from this host's first rank.

    Returns:
        The remote runtime, or the expected failure a rank reported (a ConfigError, CheckpointError
        or ArtifactError; every rank process is then stopped).

    Raises:
        RankError: a rank died, hung, or failed unexpectedly while starting.
    """
    kib = HOST_KIB if host_kib is None else host_kib
    world = 1 if build.kind == "spmd" else build.spec.tp_degree
    group = RankGroup(world, threads=threads, timeout=timeout, host_kib=kib, environment=environment, node=node)
    replies = group.call(build, timeout=START_TIMEOUT)
    error = _unexpected(group, replies)
    if error is not None:
        raise error
    failed = next((r.value for r in replies if not r.ok), None)
    if failed is not None:
        group.close()
        return Failure(failed)
    ods = build.spec.on_device_sampling_config
    return Success(RemoteRuntime(group, keys=keys, deterministic=ods is not None and ods.deterministic))

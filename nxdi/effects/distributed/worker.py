"""A rank process: one tensor-parallel rank of a model, driven by the user's process.
Effects: joins a gloo process group, reads checkpoints and compiled folders, runs programs,
talks to the driver over its stdin and stdout.

Started by `nxdi.effects.distributed.ranks.RankGroup` as `python -m nxdi.effects.distributed.worker`
(a fresh interpreter: the user's script is never imported again). It dies with its driver (a
watchdog thread notices within a fraction of a second that its parent is gone), ignores Ctrl-C
(the driver decides), and logs to its stderr, which the driver keeps in a file and quotes when the
rank fails. Anything the process prints goes to that log too, never into the protocol.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from returns.result import Failure, Success

from nxdi.core import families
from nxdi.core.programs import catalog
from nxdi.core.programs.inputs import StepInputs
from nxdi.effects import engine, memory
from nxdi.effects.distributed import ops, protocol, spmd
from nxdi.effects.distributed.host_world import HostWorld, HostWorldSpec
from nxdi.effects.distributed.protocol import RankProbe
from nxdi.effects.runtime import Runtime

_WATCH_INTERVAL = 0.2


def _die_with_parent(parent: int) -> None:
    """Exit as soon as the driver process is gone (it was killed or crashed), even mid-step.

    A watchdog thread polls the parent pid rather than asking the kernel (PR_SET_PDEATHSIG), which
    fires when the *thread* that started this process exits, and drivers may start ranks from
    short-lived threads."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_INTERVAL)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="nxdi-watch-driver", daemon=True).start()


class _Rank:
    """The state of one rank: its runtime, once built."""

    def __init__(self, rank: int, lead: int = 0) -> None:
        self.rank = rank
        self.lead = lead
        """The rank that answers with a step's outputs: the first this driver started (0 on one node)."""
        self.runtime: Runtime | None = None
        self.memory: dict[str, int] = {}
        """Anonymous resident bytes before the last build and at its peak."""

    def handle(self, request: protocol.Request) -> protocol.Reply:
        try:
            return self._handle(request)
        except Exception:  # an unexpected failure: the driver raises it with this traceback
            return protocol.Reply(ok=False, traceback=traceback.format_exc())

    def _handle(self, request: protocol.Request) -> protocol.Reply:
        match request:
            case protocol.Build():
                return self._build(request)
            case protocol.Run():
                assert self.runtime is not None, "a rank runs only after it is built"
                x = StepInputs.from_tensors(request.inputs)  # with a multi-LoRA model's adapter slots
                outs = self.runtime.run(
                    request.key,
                    x,
                    rows=request.rows,
                    params=request.params,
                    uniforms=request.uniforms,
                )
                return protocol.Reply(ok=True, value=outs if self.rank == self.lead else None)
            case protocol.RunBlocks():
                assert self.runtime is not None, "a rank runs only after it is built"
                ids, positions, last = request.inputs
                x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
                outs = self.runtime.run_blocks(
                    request.key,
                    x,
                    request.blocks,
                    params=request.params,
                    uniforms=request.uniforms,
                )
                return protocol.Reply(ok=True, value=outs if self.rank == self.lead else None)
            case protocol.WriteLoraSlots():
                assert self.runtime is not None, "a rank takes adapters only after it is built"
                self.runtime.write_lora_slots(request.writes)
                return protocol.Reply(ok=True)
            case protocol.ResetCache():
                assert self.runtime is not None
                self.runtime.reset_cache()
                return protocol.Reply(ok=True)
            case protocol.Close():
                return protocol.Reply(ok=True)
            case protocol.Probe():
                stats = ops.collective_stats(reset=request.reset)
                return protocol.Reply(ok=True, value=RankProbe(rank=self.rank, collectives=stats, **self.memory))
        raise AssertionError(f"unknown request {request!r}")

    def _build(self, request: protocol.Build) -> protocol.Reply:
        model = request.model
        found = families.record_for(model.model_type).bind(lambda record: catalog.program_for(record, model))
        if isinstance(found, Failure):
            return protocol.Reply(ok=False, value=found.failure())
        setup = engine.EngineModel(program=found.unwrap(), model=model, spec=request.spec, rank=self.rank)
        with memory.PeakSampler() as sampler:
            if request.kind == "eager":
                built: Any = engine.eager_runtime(setup, request.source)
            elif request.kind == "spmd":
                assert request.root is not None and request.backend is not None
                built = spmd.load_spmd(
                    request.root,
                    setup,
                    request.source,
                    backend=request.backend,  # type: ignore[arg-type]  # launch.runs_spmd chose it
                    graph_key=request.graph_key,
                    warmup=request.warmup,
                )
            else:
                assert request.root is not None and request.backend is not None
                built = engine.load_model(
                    request.root,
                    setup,
                    request.source,
                    backend=request.backend,
                    graph_key=request.graph_key,
                    warmup=request.warmup,
                )
        self.memory = {"anon_before_build": sampler.start.anon, "peak_anon_in_build": sampler.peak_anon}
        match built:
            case Success(runtime):
                self.runtime = runtime
                return protocol.Reply(ok=True)
            case Failure(error):
                return protocol.Reply(ok=False, value=error)
        raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank until the driver closes it or goes away."""
    p = argparse.ArgumentParser(prog="nxdi-rank")
    for flag in ("--rank", "--world", "--master-port", "--threads", "--timeout", "--parent"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--lead", type=int, default=0, help="the rank that returns outputs to this driver")
    p.add_argument("--host-world", default=None, help="shared-memory collectives (HostWorldSpec.to_arg)")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reader, writer = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray prints go to the log, not into the protocol
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    ops.register()
    if args.host_world is not None:
        ops.use_host_world(HostWorld(args.rank, args.world, HostWorldSpec.from_arg(args.host_world)))
    rank = _Rank(args.rank, args.lead)
    try:
        while True:
            try:
                request = protocol.receive(reader)
            except EOFError:
                break  # the driver is gone
            protocol.send(writer, rank.handle(request))
            if isinstance(request, protocol.Close):
                break
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads may abort it


if __name__ == "__main__":
    main()

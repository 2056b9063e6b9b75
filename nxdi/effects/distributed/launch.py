"""Where a model's ranks run: in this process (one rank, or this process's rank under torchrun), or
in rank processes this process starts and drives. Effects: joins process groups, starts processes.

- tp_degree 1: the model runs here (`nxdi.effects.engine`).
- Started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): this process is one rank.
  It joins the world's gloo process group and runs its rank here; every process runs the same
  script (SPMD) and gets the same outputs. The world may span nodes: each node's ranks are
  `start_rank_id .. start_rank_id + local_ranks_size - 1`, and WORLD_SIZE must equal tp_degree.
  Compiling happens once, on global rank 0, while the others wait.
- Otherwise this process is the driver: it starts tp_degree rank processes on this host
  (`nxdi.effects.distributed.ranks`) and forwards every step to them; the node must then run every
  rank (start_rank_id 0, local_ranks_size tp_degree).
- Or, with the transformers-neuronx guide's variables (NEURON_RT_ROOT_COMM_ID=<master>:<port>,
  NEURON_RANK_ID=<node>, NEURON_LOCAL_TP=<ranks per node>; `Env.neuron_nodes`), every node runs
  the same script as a driver of its own ranks of one world, which meets at the master; each
  driver gets the outputs from its first rank. NEURON_PP_STAGES (pipeline parallelism) is refused.
- A folder compiled by the xla or neuron backend at tp_degree > 1 runs in one process the driver
  starts, SPMD over one XLA device per rank (virtual CPU devices on XLA:CPU, NeuronCores on
  Neuron; `nxdi.effects.distributed.spmd`); not under torchrun.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch.distributed as dist
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem
from nxdi.effects import engine
from nxdi.effects.backends.base import Backend
from nxdi.effects.distributed import protocol, ranks
from nxdi.effects.distributed.errors import RankError
from nxdi.effects.env import Env, Torchrun, child_environment

T = TypeVar("T")


def _torchrun(model: engine.EngineModel, env: Env) -> Torchrun | None:
    """torchrun's world when this process is one rank of `model` (with tp_degree 1 every process
    started by torchrun runs a whole model of its own, data parallel)."""
    return env.torchrun if model.tp > 1 else None


def runs_spmd(model: engine.EngineModel, backend: Backend | None) -> bool:
    """Whether `model`'s ranks run in one process, SPMD over XLA devices (the xla and neuron
    backends, tp > 1)."""
    return backend is not None and backend.name in ("xla", "neuron") and model.tp > 1


def node_of(model: engine.EngineModel, env: Env) -> ranks.Node | None:
    """This host's ranks when the guide's multi-node variables spread `model` over nodes (see
    `Env.neuron_nodes`; checked by `check_placement`), else None."""
    nodes = env.neuron_nodes if model.tp > 1 and env.torchrun is None else None
    if nodes is None:
        return None
    first = nodes.node_rank * nodes.local_tp
    return ranks.Node(first=first, count=nodes.local_tp, master_addr=nodes.root_addr, master_port=nodes.root_port)


def _node_problems(model: engine.EngineModel, env: Env, backend: Backend | None) -> list[Problem]:
    """What contradicts the multi-node variables (or pipeline stages, which nxdi does not split)."""
    problems = []
    if env.pp_stages is not None and env.pp_stages > 1:
        why = (
            "asks for pipeline parallelism over nodes, which nxdi does not run (it splits models by tensor parallelism)"
        )
        fix = "unset it, and spread tp_degree over the nodes with NEURON_RT_ROOT_COMM_ID, NEURON_RANK_ID and NEURON_LOCAL_TP"
        problems.append(Problem.of("NEURON_PP_STAGES", env.pp_stages, why, fix))
    nodes, spec = env.neuron_nodes, model.spec
    if nodes is None or model.tp == 1:
        return problems
    if env.torchrun is not None:
        why = "spreads the ranks over nodes, and so does torchrun (RANK, WORLD_SIZE): one launcher at a time"
        problems.append(
            Problem.of(
                "NEURON_RANK_ID", nodes.node_rank, why, "unset the NEURON_* node variables, or run without torchrun"
            )
        )
        return problems
    if runs_spmd(model, backend):
        why = "spreads rank processes over nodes, but this backend runs every rank in one process (SPMD)"
        problems.append(Problem.of("NEURON_LOCAL_TP", nodes.local_tp, why, "use the cpu backend, or one node"))
    if spec.tp_degree % nodes.local_tp or (nodes.node_rank + 1) * nodes.local_tp > spec.tp_degree:
        nodes_needed = spec.tp_degree // nodes.local_tp if spec.tp_degree % nodes.local_tp == 0 else None
        why = f"with NEURON_RANK_ID={nodes.node_rank} names ranks {nodes.node_rank * nodes.local_tp}.."
        why += f"{(nodes.node_rank + 1) * nodes.local_tp - 1}, which tp_degree={spec.tp_degree} does not split into"
        fix = (
            f"give each of the {nodes_needed} nodes NEURON_RANK_ID 0..{nodes_needed - 1}"
            if nodes_needed
            else f"make NEURON_LOCAL_TP divide tp_degree={spec.tp_degree}"
        )
        problems.append(Problem.of("NEURON_LOCAL_TP", nodes.local_tp, why, fix))
    first, count = nodes.node_rank * nodes.local_tp, nodes.local_tp
    if (spec.start_rank_id, spec.local_ranks_size) not in ((0, spec.tp_degree), (first, count)):
        why = (
            f"with local_ranks_size={spec.local_ranks_size} differs from this node's ranks {first}..{first + count - 1}"
        )
        fix = f"set start_rank_id={first} and local_ranks_size={count}, or leave them unset"
        problems.append(Problem.of("start_rank_id", spec.start_rank_id, why, fix))
    return problems


def _placement_problems(model: engine.EngineModel, env: Env, backend: Backend | None) -> list[Problem]:
    spec, run = model.spec, _torchrun(model, env)
    first, count = spec.start_rank_id, spec.local_ranks_size
    last = first + count - 1
    nodes = _node_problems(model, env, backend)
    if nodes or node_of(model, env) is not None:
        return nodes
    if run is not None and runs_spmd(model, backend):
        why = "runs tensor parallelism in one process over one XLA device per rank, not as torchrun ranks"
        fix = "start one process without torchrun, or use the cpu backend under torchrun"
        return [Problem.of("NXDI_BACKEND", backend.name if backend else "", why, fix)]
    if run is None:
        if (first, count) != (0, spec.tp_degree):
            why = f"with local_ranks_size={count} names ranks {first}..{last} of {spec.tp_degree}, but without torchrun this host runs every rank"
            fix = f"set start_rank_id=0 and local_ranks_size={spec.tp_degree}, or launch every node with torchrun"
            return [Problem.of("start_rank_id", first, why, fix)]
        return []
    problems = []
    if run.world_size != spec.tp_degree:
        why = f"differs from torchrun's WORLD_SIZE={run.world_size} (every rank of the world serves one model)"
        problems.append(Problem.of("tp_degree", spec.tp_degree, why, "make them equal"))
    if not first <= run.rank <= last:
        why = (
            f"with local_ranks_size={count} names ranks {first}..{last}, but torchrun made this process rank {run.rank}"
        )
        fix = "give each node start_rank_id = its node rank * local_ranks_size"
        problems.append(Problem.of("start_rank_id", first, why, fix))
    return problems


def check_placement(
    model: engine.EngineModel, env: Env, backend: Backend | None = None
) -> Result[engine.EngineModel, ConfigError]:
    """`model` placed on this process's rank (under torchrun), or as is; a Failure when the rank
    settings contradict how the process was started (or `backend` cannot run it that way)."""
    problems = _placement_problems(model, env, backend)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    run = _torchrun(model, env)
    return Success(attrs.evolve(model, rank=run.rank) if run else model)


def join(run: Torchrun, *, timeout: int) -> None:
    """Join torchrun's world as a gloo process group (once per process), left at interpreter exit.
    The environment names it (`env://`: torchrun's agent already serves the rendezvous store at
    MASTER_ADDR:MASTER_PORT)."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=run.rank,
        world_size=run.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    atexit.register(_leave)


def _leave() -> None:
    # Without this, gloo's threads outlive the interpreter's teardown and the process aborts
    # ("terminate called without an active exception"), which torchrun reports as a failed rank.
    if dist.is_initialized():
        dist.destroy_process_group()


def once(model: engine.EngineModel, env: Env, action: Callable[[], T]) -> T | None:
    """Run `action` here, or, when this process is one torchrun rank of `model`, on global rank 0
    only while the others wait (so a shared folder is written once).

    Returns:
        Its result on the process that ran it, None on the others.

    Raises:
        What `action` raised, on rank 0; on the other ranks a RankError quoting it.
    """
    run = _torchrun(model, env)
    if run is None:
        return action()
    join(run, timeout=env.rank_timeout or ranks.STEP_TIMEOUT)
    result, failure = None, None
    if run.rank == 0:
        try:
            result = action()
        except BaseException as exc:
            failure = exc
    told = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(told, src=0)
    if failure is not None:
        raise failure
    if told[0] is not None:
        raise RankError(f"rank 0 failed, so this rank stops too: {told[0]}", 0)
    return result


def open_runtime(
    model: engine.EngineModel,
    source: engine.CheckpointSource,
    env: Env,
    *,
    root: str | os.PathLike[str] | None = None,
    backend: Backend | None = None,
    graph_key: str = "",
    warmup: bool = True,
) -> Result[Any, Any]:
    """The runtime of `model`: eager when `root` is None, else loaded from the compiled folder `root`.

    Returns:
        A `Runtime` (ranks in this process) or a `ranks.RemoteRuntime` (rank processes), or the
        expected failure: a ConfigError (rank settings), CheckpointError or ArtifactError.

    Raises:
        RankError: a rank process died, hung or failed unexpectedly.
    """
    placed = check_placement(model, env, None if root is None else backend)
    run = _torchrun(model, env)
    spmd = root is not None and runs_spmd(model, backend)
    if isinstance(placed, Failure) or model.tp == 1 or run is not None:
        if run is not None and isinstance(placed, Success):
            join(run, timeout=env.rank_timeout or ranks.STEP_TIMEOUT)
        return placed.bind(
            lambda here: _here(here, source, root=root, backend=backend, graph_key=graph_key, warmup=warmup)
        )
    build = protocol.Build(
        kind="eager" if root is None else "spmd" if spmd else "compiled",
        model=model.model,
        spec=model.spec,
        source=source,
        root=None if root is None else str(Path(root).resolve()),
        backend=backend,
        graph_key=graph_key,
        warmup=warmup,
    )
    return ranks.start(
        build,
        keys=model.program_keys(),
        threads=env.num_threads,
        timeout=env.rank_timeout,
        host_kib=env.host_collectives_kib,
        # XLA on the host CPU, with a device per rank (set before the process first uses torch-xla)
        environment=_spmd_environment(model, backend) if spmd else None,
        node=node_of(model, env),
    )


def _spmd_environment(model: engine.EngineModel, backend: Backend | None) -> dict[str, str] | None:
    """The rank process's environment: on XLA:CPU a virtual device per rank (set before the process
    first uses torch-xla); on Neuron the NeuronCores the runtime gives it."""
    if backend is not None and backend.name == "xla":
        return child_environment({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(model.tp)})
    return None


def _here(
    model: engine.EngineModel,
    source: engine.CheckpointSource,
    *,
    root: str | os.PathLike[str] | None,
    backend: Backend | None,
    graph_key: str,
    warmup: bool,
) -> Result[Any, Any]:
    if root is None:
        return engine.eager_runtime(model, source)
    assert backend is not None
    return engine.load_model(root, model, source, backend=backend, graph_key=graph_key, warmup=warmup)

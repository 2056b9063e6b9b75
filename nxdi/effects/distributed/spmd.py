"""Tensor parallelism on the xla and neuron backends: every rank of a model in one process, its
compiled programs run SPMD over one XLA device per rank (`nxdi.effects.backends.xla_spmd`).
Effects: reads checkpoints and compiled folders, runs XLA.

The driver starts one rank process (on XLA:CPU with `CPU_NUM_DEVICES=tp`, see `launch`); it loads
the compiled folder, reads every rank's weight shard the way that rank would, and stacks them into
global tensors, rank r's at index r.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.programs.kv_cache import KVCache
from nxdi.effects import artifacts, engine
from nxdi.effects.backends.neuron import NeuronBackend
from nxdi.effects.backends.xla import XlaBackend
from nxdi.effects.backends.xla_spmd import XlaSpmdBackend
from nxdi.effects.runtime import Runtime


def all_rank_weights(
    folder: Path, model: engine.EngineModel, source: engine.CheckpointSource
) -> Result[dict[str, Tensor], Any]:
    """Every rank's weights of `model`, stacked: name -> `[tp, *shard shape]` (see `engine.rank_weights`)."""
    names = model.weight_names(source.plan)
    stacked: dict[str, list[Tensor]] = {n: [] for n in names}
    for rank in range(model.tp):
        read = engine.rank_weights(folder, attrs.evolve(model, rank=rank), source)
        if isinstance(read, Failure):
            return read
        tensors = read.unwrap()
        for n in names:
            stacked[n].append(tensors[n])
    return Success({n: torch.stack(ts) for n, ts in stacked.items()})


def load_spmd(
    root: str | os.PathLike[str],
    model: engine.EngineModel,
    source: engine.CheckpointSource,
    *,
    backend: XlaBackend | NeuronBackend,
    graph_key: str,
    warmup: bool = True,
) -> Result[Runtime, Any]:
    """The runtime of every rank of `model` (tp > 1) from a folder `backend` compiled.

    Returns:
        A `Runtime` whose cache tensors are `[tp, R, K, T, D]` (sharded over the devices), or the
        failures of `engine.load_model`.

    Raises:
        RuntimeError: this process does not see tp XLA devices (see `xla_spmd`).
    """
    spmd = XlaSpmdBackend(partitions=model.tp, lowering=backend)
    folder = Path(root)
    names = model.weight_names(source.plan)

    def build(programs: Any, stacked: dict[str, Tensor]) -> Result[Runtime, Any]:
        rank0 = model.program.weights({n: t[0] for n, t in stacked.items()}, spec=model.model)
        host = model.empty_cache(length=model.spec.max_length)
        cache = KVCache.from_tensors(
            [spmd.shard(torch.zeros((model.tp, *t.shape), dtype=t.dtype)) for t in host.to_tensors()]
        )
        return engine.bind_programs(spmd, programs, 0, names, stacked).map(
            lambda bound: engine.runtime_for(model, bound, rank0, spmd, cache=cache, lead=1)
        )

    loaded: Result[Runtime, Any] = artifacts.load_programs(folder, spmd, graph_key=graph_key).bind(
        lambda programs: all_rank_weights(folder, model, source).bind(lambda stacked: build(programs, stacked))
    )
    if warmup and isinstance(loaded, Success):
        engine.warm_up(loaded.unwrap(), model)
    return loaded

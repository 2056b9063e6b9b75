"""A model's life cycle on the engine: the one compile path, the one load path, and the eager path.
Effects: traces programs through a backend, reads and writes the compiled-model folder and its
weights, allocates the KV cache, runs warm-up steps.

A model is an `EngineModel`: its family's program, its architecture and its NeuronSpec. From it:

- `compile_model(root, model, weights, ...)` traces one step program per sub-model and bucket
  (reusing unchanged ones), writes the weights once when asked (`save_sharded_checkpoint`), and
  the manifest last (`nxdi.effects.artifacts`).
- `load_model(root, model, ...)` reads the programs back without tracing, binds them to the
  weights (the folder's, else the original checkpoint's through the weight plan) and returns a
  ready `Runtime`, warmed up when asked. Every expected failure is a Result.
- `eager_runtime(model, weights)` runs the pure programs eagerly (`to_cpu()`).

Every program, eager or compiled, is called the same way, with its weights already bound:
`program(cache, inputs, params, uniforms) -> (logits | None, tokens | None, cache)`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ArtifactError, CheckpointError, Problem
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import buckets
from nxdi.core.programs import catalog, kv_cache
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepSpec, example_inputs, step
from nxdi.core.weight_plan import WeightPlan
from nxdi.effects import artifacts, checkpoint, weight_loader
from nxdi.effects.artifacts import CompileResult, ProgramRequest
from nxdi.effects.backends.base import Backend, LoadedProgram, Signature, WeightSet
from nxdi.effects.runtime import Program, Runtime

SHARDED_WEIGHTS = "weights/tp0_sharded_checkpoint.safetensors"
"""Where `compile_model` writes the converted weights (NxDI's name for rank 0's shard)."""
INPUTS = ("input_ids", "position_ids", "last_index", "sampling_params", "uniforms")


@attrs.frozen(kw_only=True)
class EngineModel:
    """Everything static about one model on the engine."""

    program: catalog.Program
    """The family's program (forward pass, weight table)."""
    model: ModelSpec
    spec: NeuronSpec

    @property
    def step_spec(self) -> StepSpec:
        """The static part of every step program."""
        ods = self.spec.on_device_sampling_config
        if ods is None:
            return StepSpec(model=self.model)
        return StepSpec(
            model=self.model,
            on_device_sampling=True,
            # dynamic sampling takes per-row parameters, so the program must be able to sample.
            do_sample=ods.do_sample or ods.dynamic,
            global_topk=ods.global_topk,
            output_logits=self.spec.output_logits,
        )

    def buckets(self) -> dict[Phase, tuple[int, ...]]:
        """The compiled sequence buckets per sub-model (the planners' tables, which a parsed spec has)."""
        tables = {Phase.CONTEXT: buckets.context_table_for(self.spec), Phase.TOKEN: buckets.token_table_for(self.spec)}
        out = {}
        for phase, table in tables.items():
            assert isinstance(table, Success), f"a validated spec has valid bucket tables: {table}"
            out[phase] = table.unwrap().lengths
        return out

    def batch(self, phase: Phase) -> int:
        """Rows of the programs of `phase`."""
        return self.spec.ctx_batch_size if phase is Phase.CONTEXT else self.spec.tkg_batch_size

    def weight_names(self) -> tuple[str, ...]:
        """The weights a program binds, in order: the table's, a tied lm_head left out (it is the embedding)."""
        tied, _ = self.program.table.tied
        entries = self.program.table.entries(self.model)
        return tuple(n for n, slot, _ in entries if not (self.model.tie_word_embeddings and slot == tied))

    def cache_dtype(self) -> torch.dtype:
        return weight_ops.torch_dtype(self.spec.attention_dtype or self.spec.torch_dtype)

    def empty_cache(self, *, length: int, batch: int | None = None) -> KVCache:
        """A zero KV cache: every cache row (garbage rows included) unless `batch` is given."""
        rows = self.spec.kv_cache_batch_size + self.spec.kv_cache_padding_size if batch is None else batch
        return kv_cache.empty_cache(self.model, batch=rows, length=length, dtype=self.cache_dtype())


# --- the step as a flat program -----------------------------------------------------------------


class _FlatStep:
    """The step as `fn(*weights, *cache, *inputs) -> (*outputs, *cache)` (what a backend traces)."""

    def __init__(self, model: EngineModel) -> None:
        self.model, self.names = model, model.weight_names()

    def __call__(self, *flat: Tensor) -> tuple[Tensor, ...]:
        w, c = len(self.names), 2 * self.model.model.num_layers
        weights = self.model.program.weights(dict(zip(self.names, flat[:w], strict=True)), spec=self.model.model)
        ids, positions, last, params, uniforms = flat[w + c :]
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        forward, spec = self.model.program.forward, self.model.step_spec
        logits, tokens, new = step(
            forward, weights, KVCache.from_tensors(flat[w : w + c]), x, params, uniforms, spec=spec
        )
        return (*(t for t in (logits, tokens) if t is not None), *new.to_tensors())


def _signature(model: EngineModel) -> Signature:
    spec = model.step_spec
    cache = tuple(f"layers.{i}.{kv}" for i in range(model.model.num_layers) for kv in ("k", "v"))
    if not spec.on_device_sampling:
        outputs: tuple[str, ...] = ("logits",)
    else:
        outputs = ("logits", "tokens") if spec.output_logits else ("tokens",)
    return Signature(weights=model.weight_names(), cache=cache, inputs=INPUTS, outputs=outputs)


def _example(model: EngineModel, weights: Sequence[Tensor], phase: Phase, bucket: int) -> list[Tensor]:
    batch = model.batch(phase)
    x, params, uniforms = example_inputs(batch=batch, tokens=bucket if phase is Phase.CONTEXT else 1)
    cache = model.empty_cache(length=bucket, batch=batch)
    return [*weights, *cache.to_tensors(), *x.to_tensors(), params, uniforms]


def _bound(backend: Backend, loaded: LoadedProgram) -> Program:
    """A bound backend program in the runtime's calling convention."""
    outputs = loaded.program.signature.outputs

    def call(cache: KVCache, x: StepInputs, params: Tensor, uniforms: Tensor) -> Any:
        outs, new = backend.run(loaded, cache.to_tensors(), (*x.to_tensors(), params, uniforms))
        named = dict(zip(outputs, outs, strict=True))
        return named.get("logits"), named.get("tokens"), KVCache.from_tensors(new)

    return call


def _runtime(model: EngineModel, programs: Mapping[tuple[Phase, int], Program], weights: Any) -> Runtime:
    ods = model.spec.on_device_sampling_config
    return Runtime(
        cache=model.empty_cache(length=model.spec.max_length),
        programs=programs,
        weights=weights,
        deterministic=ods is not None and ods.deterministic,
    )


def _warmup(runtime: Runtime, model: EngineModel) -> None:
    """Run every program once on example inputs, then clear the cache (first calls allocate)."""
    for phase, bucket in runtime.programs:
        x, params, _ = example_inputs(batch=model.batch(phase), tokens=bucket if phase is Phase.CONTEXT else 1)
        runtime.run(phase, bucket, x, rows=None, params=params)
    runtime.reset_cache()


# --- the three paths ----------------------------------------------------------------------------


def eager_runtime(model: EngineModel, weights: Mapping[str, Tensor]) -> Runtime:
    """The pure step programs, run eagerly, bound to `weights` (named as the weight table names them)."""
    value = model.program.weights(weights, spec=model.model)
    program = functools.partial(step, model.program.forward, value, spec=model.step_spec)
    programs = {(phase, b): program for phase, lengths in model.buckets().items() for b in lengths}
    return _runtime(model, programs, value)


def write_weights(root: str | os.PathLike[str], model: EngineModel, weights: Mapping[str, Tensor]) -> Path:
    """Write the weights the programs bind (a tied lm_head once, as the embedding) to the folder's shard file."""
    return checkpoint.write_safetensors(Path(root) / SHARDED_WEIGHTS, {n: weights[n] for n in model.weight_names()})


def compile_model(
    root: str | os.PathLike[str],
    model: EngineModel,
    weights: Mapping[str, Tensor],
    *,
    backend: Backend,
    graph_key: str,
    save_weights: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    record: Iterable[str] = (),
) -> CompileResult:
    """Compile every program of `model` into the folder `root` (see `artifacts.compile_programs`).

    Args:
        weights: the converted weights (they give the traced shapes; saved when `save_weights`).
        save_weights: write them once to `SHARDED_WEIGHTS`, so loading needs no checkpoint.
        record: other files of the folder (e.g. `neuron_config.json`) the manifest should verify.

    Raises:
        Exceptions from tracing propagate; the folder then reads as not compiled.
    """
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    files = list(record)
    if save_weights:
        write_weights(folder, model, weights)
        files.append(SHARDED_WEIGHTS)
    flat, signature, tensors = _FlatStep(model), _signature(model), [weights[n] for n in model.weight_names()]
    requests = [
        ProgramRequest(
            phase=phase,
            bucket=bucket,
            fn=flat,
            signature=signature,
            example=functools.partial(_example, model, tensors, phase, bucket),
        )
        for phase, lengths in model.buckets().items()
        for bucket in lengths
    ]
    return artifacts.compile_programs(
        folder, requests, graph_key=graph_key, backend=backend, cache_dir=cache_dir, record=files
    )


@attrs.frozen(kw_only=True)
class CheckpointSource:
    """Where a compiled model's weights come from when its folder holds none."""

    path: str
    """The original Hugging Face checkpoint."""
    plan: WeightPlan
    """How it converts into the programs' weights."""


def _weights(root: Path, model: EngineModel, source: CheckpointSource) -> Result[dict[str, Tensor], Any]:
    """The folder's weights file, else the original checkpoint converted by the plan."""
    if (root / SHARDED_WEIGHTS).is_file():
        with checkpoint.open_checkpoint(root / SHARDED_WEIGHTS) as ckpt:
            tensors = dict(ckpt.iter_tensors())
        missing = [n for n in model.weight_names() if n not in tensors]
        if missing:
            why = f"lacks the weights {missing}"
            return Failure(ArtifactError(problems=(Problem.of(str(root / SHARDED_WEIGHTS), len(tensors), why),)))
        return Success(tensors)
    try:
        checkpoint.find_checkpoint(source.path)
    except FileNotFoundError:
        why = (
            "holds no checkpoint: the folder was compiled without save_sharded_checkpoint, so its weights come from it"
        )
        fix = "restore the checkpoint, or compile with save_sharded_checkpoint=True"
        return Failure(ArtifactError(problems=(Problem.of(source.path, "<missing>", why, fix),), not_found=True))
    return weight_loader.get_state_dict(source.path, source.plan)


def _bind(
    backend: Backend, programs: Mapping[tuple[Phase, int], Any], model: EngineModel, tensors: Mapping[str, Tensor]
) -> Result[dict[tuple[Phase, int], Program], CheckpointError]:
    weight_set = WeightSet(tensors=tuple(tensors[n] for n in model.weight_names()))
    bound: dict[tuple[Phase, int], Program] = {}
    problems: list[Problem] = []
    for key, compiled in programs.items():
        match backend.bind(compiled, weight_set):
            case Success(loaded):
                bound[key] = _bound(backend, loaded)
            case Failure(err):
                problems.extend(p.prefixed(compiled.name) for p in err.problems)
    return Failure(CheckpointError(problems=tuple(problems))) if problems else Success(bound)


def load_model(
    root: str | os.PathLike[str],
    model: EngineModel,
    *,
    backend: Backend,
    graph_key: str,
    checkpoint_source: CheckpointSource,
    warmup: bool = True,
) -> Result[Runtime, ArtifactError | CheckpointError]:
    """A runtime from the compiled folder `root`: programs read back (no tracing), bound to the weights.

    Returns:
        `Success(Runtime)` (warmed up when `warmup`), or a Failure: `ArtifactError` when nothing is
        compiled there (`not_found`), the folder is altered, of another format, backend or
        configuration, or its weights are gone; `CheckpointError` when the original checkpoint does
        not fit the plan or the weights do not fit the programs (every problem listed).
    """
    folder = Path(root)
    loaded: Result[Runtime, ArtifactError | CheckpointError] = artifacts.load_programs(
        folder, backend, graph_key=graph_key
    ).bind(
        lambda programs: _weights(folder, model, checkpoint_source).bind(
            lambda tensors: _bind(backend, programs, model, tensors).map(
                lambda bound: _runtime(model, bound, model.program.weights(tensors, spec=model.model))
            )
        )
    )
    match loaded:
        case Success(runtime) if warmup:
            _warmup(runtime, model)
    return loaded

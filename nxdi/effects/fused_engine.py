"""A fused-speculation model on the engine: a draft model and its target in one program per bucket.
Effects: reads both checkpoints, traces the programs, allocates the joined KV cache, runs warm-up steps.

A `FusedEngineModel` (the target's and the draft's `EngineModel`, one rank) with a `FusedSource`
(both checkpoints) goes through the engine's own three paths (`engine.eager_runtime`,
`engine.compile_model`, `engine.load_model`, and `write_shards`, `repin_source`): it is an
`engine.Deployable`. What is fused-specific lives here:

- Weights: every program binds the target's weights under `target_model.` and the draft's under
  `draft_model.` (NxDI's prefixes for a fused model), each converted by its own weight plan from
  its own checkpoint (the draft's: `draft_model_path`); `save_sharded_checkpoint` writes both
  models' weights to one shard file.
- Cache: one `KVCache`, the target's layers then the draft's (then, with EAGLE, the target's
  hidden-state cache, `nxdi.core.programs.eagle_fused`), `max_length + speculation_length` slots
  per row (`nxdi.core.planning.fused_programs`).
- Programs (`fused_programs.fused_keys`): context encoding runs
  `fused_speculation.context_step`, a fused step `fused_speculation.fused_step` (with an EAGLE
  draft: `eagle_fused.context_step` and `eagle_fused.fused_step`, or with `token_tree_config`
  `eagle_tree.fused_step`); all take the
  engine's inputs (`engine.INPUTS`: a fused step's `uniforms` are [B, k]).
- Pins (`checkpoints`): a compiled folder pins the target's checkpoint in its manifest, as any
  model, and the draft's in `draft_source.json` (listed in the manifest): loading refuses either
  checkpoint if it changed since compile, unless the folder holds the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.errors import CheckpointError, Problem
from nxdi.core.host import weight_ops
from nxdi.core.planning import eagle_tree as eagle_tree_plan
from nxdi.core.planning import fused_programs
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs import eagle, eagle_fused, eagle_tree, fused_speculation
from nxdi.core.programs.collectives import SINGLE
from nxdi.core.programs.fused_speculation import FusedSpec, FusedWeights
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import example_inputs
from nxdi.effects import checkpoint, engine, weight_loader
from nxdi.effects.artifacts import ProgramRequest
from nxdi.effects.backends.base import Backend, Signature
from nxdi.effects.runtime import Program, Runtime

TARGET_PREFIX = "target_model."
DRAFT_PREFIX = "draft_model."
DRAFT_SOURCE = "draft_source.json"
"""The draft checkpoint's files as compiled (like the manifest's `source` for the target's)."""


@attrs.frozen(kw_only=True)
class FusedSource:
    """Where both models' weights come from."""

    target: engine.CheckpointSource
    draft: engine.CheckpointSource


@attrs.frozen(kw_only=True)
class FusedEngineModel:
    """Everything static about a fused model: the target and its draft, on one rank."""

    target: engine.EngineModel
    draft: engine.EngineModel
    eagle: EagleDraft | None = None
    """The EAGLE draft's checkpoint layout with `enable_eagle_speculation` (the draft is an EAGLE
    draft, `nxdi.core.programs.eagle_fused`), else None (the draft is an ordinary decoder)."""

    @property
    def spec(self) -> NeuronSpec:
        """The target's NeuronSpec: it decides batches, buckets, sampling and speculation_length."""
        return self.target.spec

    def fused_spec(self) -> FusedSpec:
        return FusedSpec(
            target=self.target.step_spec,
            draft=self.draft.step_spec,
            speculation_length=self.spec.speculation_length,
            max_length=self.spec.max_length,
            tree=eagle_tree_plan.tree_of(self.spec),
        )

    def program_keys(self) -> tuple[ProgramKey, ...]:
        keys = fused_programs.fused_keys(self.spec)
        assert isinstance(keys, Success), f"a validated spec has valid bucket tables: {keys}"
        return keys.unwrap()

    def empty_cache(self, *, length: int, batch: int | None = None, device: torch.device | None = None) -> KVCache:
        """Both zero caches joined: every cache row of the target (garbage rows too) unless `batch`."""
        rows = self.spec.kv_cache_batch_size + self.spec.kv_cache_padding_size if batch is None else batch
        made = (m.empty_cache(length=length, batch=rows, device=device) for m in (self.target, self.draft))
        joined = fused_speculation.join_caches(*made)
        if self.eagle is None:
            return joined
        dtype = weight_ops.torch_dtype(self.target.spec.torch_dtype)
        width = self.target.model.hidden_size
        hidden = eagle_fused.hidden_cache(batch=rows, length=length, width=width, dtype=dtype, device=device)
        return fused_speculation.join_caches(joined, hidden)

    @property
    def cache_layers(self) -> int:
        """Layers of the joined cache: the target's, the draft's, and with EAGLE the hidden states'."""
        return self.target.model.num_layers + self.draft.model.num_layers + (self.eagle is not None)

    def weight_names(self, source: FusedSource) -> tuple[str, ...]:
        """The weights every program binds, in order: the target's, then the draft's, prefixed."""
        return (
            *(TARGET_PREFIX + n for n in self.target.weight_names(source.target.plan)),
            *(DRAFT_PREFIX + n for n in self.draft.weight_names(source.draft.plan)),
        )

    def weights(self, tensors: Mapping[str, Tensor]) -> FusedWeights:
        """Both programs' weights values from prefixed tensors."""
        draft = _unprefixed(tensors, DRAFT_PREFIX)
        if self.eagle is None:
            value = self.draft.program.weights(draft, spec=self.draft.model)
        else:
            slots = self.eagle.table(self.draft.program.table).slots(draft, self.draft.model)
            value = eagle.weights_from_slots(slots, spec=self.draft.model)
        target = self.target.program.weights(_unprefixed(tensors, TARGET_PREFIX), spec=self.target.model)
        return FusedWeights(target=target, draft=value)

    def program(self, key: ProgramKey, weights: FusedWeights) -> Program:
        """The pure program of `key`, its weights bound: (cache, x, params, uniforms) -> (outputs, cache)."""
        spec = self.fused_spec()
        forward = self.target.program.forward_outputs
        if self.eagle is not None:
            run = eagle_fused.context_step if key.phase is Phase.CONTEXT else eagle_fused.fused_step
            if spec.tree is not None and key.phase is not Phase.CONTEXT:
                run = eagle_tree.fused_step  # token_tree_config: the draft proposes a tree
            return functools.partial(run, forward, weights, spec=spec)
        decode, context = fused_speculation.decoder_draft(self.draft.program.forward_outputs, spec.draft, SINGLE)
        if key.phase is Phase.CONTEXT:
            return functools.partial(fused_speculation.context_step, forward, context, weights, spec=spec)
        return functools.partial(fused_speculation.fused_step, forward, decode, weights, spec=spec)

    def outputs(self, key: ProgramKey) -> tuple[str, ...]:
        return self.fused_spec().outputs(context=key.phase is Phase.CONTEXT)

    def example(self, key: ProgramKey) -> tuple[StepInputs, Tensor, Tensor]:
        """Inputs of `key`'s shapes (tracing, warm-up): a fused step's uniforms are [B, k]."""
        x, params, uniforms = example_inputs(batch=key.batch, tokens=key.tokens)
        if key.phase is Phase.CONTEXT:
            return x, params, uniforms
        return x, params, torch.full((key.batch, self.spec.speculation_length), 0.5)

    # --- what the engine's three paths need (`engine.Deployable`) ---

    @property
    def rank(self) -> int:
        """The one rank the fused programs run on."""
        return self.target.rank

    def bound_names(self, source: FusedSource) -> tuple[str, ...]:
        return self.weight_names(source)

    def checkpoints(self, source: FusedSource) -> tuple[engine.Pinned, ...]:
        """The target's checkpoint (pinned in the manifest), then the draft's (in `draft_source.json`)."""
        draft = engine.Pinned(source=source.draft, side=DRAFT_SOURCE, prefix=DRAFT_PREFIX.rstrip("."))
        return (engine.Pinned(source=source.target), draft)

    def read(self, source: FusedSource, *, check_values: bool = False) -> Result[dict[str, Tensor], CheckpointError]:
        return read_weights(self, source, check_values=check_values)

    def example_weights(self, source: FusedSource) -> Result[list[Tensor], CheckpointError]:
        target, draft = (
            weight_loader.example_weights(m.weight_plan(s.plan), s.path)
            for m, s in ((self.target, source.target), (self.draft, source.draft))
        )
        return target.bind(lambda t: draft.map(lambda d: [*t, *d]))

    def write_shards(self, folder: Path, source: FusedSource) -> Result[tuple[str, ...], CheckpointError]:
        """Both models' weights (prefixed, an alias once) in one shard file."""
        names, rel = self.weight_names(source), engine.sharded_weights(0)
        return read_weights(self, source).map(
            lambda t: (checkpoint.write_safetensors(folder / rel, {n: t[n] for n in names}), (rel,))[1]
        )

    def request(
        self, names: Sequence[str], key: ProgramKey, example: Sequence[Tensor], backend: Backend
    ) -> ProgramRequest:
        return ProgramRequest(
            key=key,
            fn=_Flat(self, names, key),
            signature=_signature(self, names, key),
            example=functools.partial(_example, self, example, key),
        )

    def eager(self, tensors: Mapping[str, Tensor]) -> Runtime:
        value = self.weights(tensors)
        programs = {key: self.program(key, value) for key in self.program_keys()}
        cache = self.empty_cache(length=fused_programs.cache_length(self.spec))
        return engine.runtime_for(self.target, programs, value, cache=cache)

    def runtime(self, bound: Mapping[ProgramKey, Program], tensors: Mapping[str, Tensor], backend: Backend) -> Runtime:
        cache = self.empty_cache(length=fused_programs.cache_length(self.spec), device=backend.device)
        return engine.runtime_for(self.target, bound, self.weights(tensors), backend, cache=cache)

    def warm_up(self, runtime: Runtime) -> None:
        warm_up(runtime, self)


def _unprefixed(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}


def _prefixed(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {prefix + n: t for n, t in tensors.items()}


def read_weights(
    model: FusedEngineModel, source: FusedSource, *, check_values: bool = False
) -> Result[dict[str, Tensor], CheckpointError]:
    """Both models' converted weights, prefixed, each from its own checkpoint (NaN and inf refused
    with `check_values`, unless the source allows them); a CheckpointError names every problem of
    both (the draft's under `draft_model.`)."""
    target = engine.read_weights(model.target, source.target, check_values=check_values)
    draft = engine.read_weights(model.draft, source.draft, check_values=check_values)
    match target, draft:
        case Success(t), Success(d):
            return Success({**_prefixed(t, TARGET_PREFIX), **_prefixed(d, DRAFT_PREFIX)})
    problems = [*_problems(target, ""), *_problems(draft, DRAFT_PREFIX.rstrip("."))]
    return Failure(CheckpointError(problems=tuple(problems)))


def _problems(result: Result[Any, Any], prefix: str) -> list[Problem]:
    if not isinstance(result, Failure):
        return []
    found = result.failure().problems
    return [p.prefixed(prefix) for p in found] if prefix else list(found)


class _Flat:
    """A fused program as `fn(*weights, *cache, *inputs) -> (*outputs, *cache)` (what a backend traces)."""

    def __init__(self, model: FusedEngineModel, names: Sequence[str], key: ProgramKey) -> None:
        self.model, self.names, self.key = model, tuple(names), key

    def __call__(self, *flat: Tensor) -> tuple[Tensor, ...]:
        w = len(self.names)
        c = 2 * self.model.cache_layers
        weights = self.model.weights(dict(zip(self.names, flat[:w], strict=True)))
        ids, positions, last, params, uniforms = flat[w + c :]
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        outs, new = self.model.program(self.key, weights)(KVCache.from_tensors(flat[w : w + c]), x, params, uniforms)
        named = outs.named()
        return (*(named[n] for n in self.model.outputs(self.key)), *new.to_tensors())


def _signature(model: FusedEngineModel, names: Sequence[str], key: ProgramKey) -> Signature:
    layers = [f"layers.{i}" for i in range(model.target.model.num_layers)]
    layers += [f"draft.layers.{i}" for i in range(model.draft.model.num_layers)]
    layers += ["eagle.hidden"] if model.eagle is not None else []
    cache = tuple(f"{layer}.{kv}" for layer in layers for kv in ("k", "v"))
    return Signature(weights=tuple(names), cache=cache, inputs=engine.INPUTS, outputs=model.outputs(key))


def _example(model: FusedEngineModel, weights: Sequence[Tensor], key: ProgramKey) -> list[Tensor]:
    x, params, uniforms = model.example(key)
    cache = model.empty_cache(length=key.length, batch=key.batch)
    return [*weights, *cache.to_tensors(), *x.to_tensors(), params, uniforms]


def warm_up(runtime: Runtime, model: FusedEngineModel) -> None:
    """Run every program once on example inputs, then clear the cache (first calls allocate)."""
    for key in runtime.programs:
        x, params, uniforms = model.example(key)
        runtime.run(key, x, rows=None, params=params, uniforms=uniforms)
    runtime.reset_cache()

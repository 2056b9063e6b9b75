"""A fused-speculation model on the engine: a draft model and its target in one program per bucket.
Effects: reads both checkpoints, traces and writes the programs, reads them back, allocates the
joined KV cache, runs warm-up steps.

The same three paths as `nxdi.effects.engine` (eager, compile, load), for a `FusedEngineModel`
(the target's and the draft's `EngineModel`, one rank) and a `FusedSource` (both checkpoints):

- Weights: every program binds the target's weights under `target_model.` and the draft's under
  `draft_model.` (NxDI's prefixes for a fused model), each converted by its own weight plan from
  its own checkpoint (the draft's: `draft_model_path`).
- Cache: one `KVCache`, the target's layers then the draft's (then, with EAGLE, the target's
  hidden-state cache, `nxdi.core.programs.eagle_fused`), `max_length + speculation_length` slots
  per row (`nxdi.core.planning.fused_programs`).
- Programs (`fused_programs.fused_keys`): context encoding runs
  `fused_speculation.context_step`, a fused step `fused_speculation.fused_step` (with an EAGLE
  draft: `eagle_fused.context_step` and `eagle_fused.fused_step`, or with `token_tree_config`
  `eagle_tree.fused_step`); all take the
  engine's inputs (`engine.INPUTS`: a fused step's `uniforms` are [B, k]).
- A compiled folder pins the target's checkpoint in its manifest, as any model, and the draft's in
  `draft_source.json` (listed in the manifest): loading refuses either checkpoint if it changed
  since compile, unless the folder holds the weights (`save_sharded_checkpoint`: one shard file
  with both models' weights).

(Over 400 lines: the three paths of one fused model, kept with the model value they share, as
`nxdi.effects.engine` keeps its own.)
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.errors import ArtifactError, CheckpointError, Problem
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
from nxdi.effects import artifacts, checkpoint, checkpoint_scan, engine, files, weight_loader
from nxdi.effects.artifacts import CompileResult, ProgramRequest
from nxdi.effects.backends.base import Backend, Signature
from nxdi.effects.distributed import ops
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
        tree = None
        if self.spec.token_tree_config is not None:
            parsed = eagle_tree_plan.parse_eagle_tree(self.spec.token_tree_config)
            assert isinstance(parsed, Success), f"a validated spec has a valid token tree: {parsed}"
            tree = parsed.unwrap()
        return FusedSpec(
            target=self.target.step_spec,
            draft=self.draft.step_spec,
            speculation_length=self.spec.speculation_length,
            max_length=self.spec.max_length,
            tree=tree,
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


def _scan_both(
    source: FusedSource,
) -> Result[tuple[tuple[checkpoint_scan.SourceFile, ...], tuple[checkpoint_scan.SourceFile, ...]], CheckpointError]:
    """Check both checkpoints as compile() does (headers, then NaN/inf unless allowed): their files
    to pin, target's then draft's, or every problem of either (the draft's prefixed)."""
    scans = [
        weight_loader.scan_source(s.path, s.plan, allow_nonfinite=s.allow_nonfinite)
        for s in (source.target, source.draft)
    ]
    failed = [*_problems(scans[0], ""), *_problems(scans[1], DRAFT_PREFIX.rstrip("."))]
    if failed:
        return Failure(CheckpointError(problems=tuple(failed)))
    return Success((scans[0].unwrap().files, scans[1].unwrap().files))


def eager_runtime(model: FusedEngineModel, source: FusedSource) -> Result[Runtime, CheckpointError]:
    """The pure fused programs, run eagerly, bound to both models' weights."""

    def build(tensors: Mapping[str, Tensor]) -> Runtime:
        value = model.weights(tensors)
        programs = {key: model.program(key, value) for key in model.program_keys()}
        cache = model.empty_cache(length=fused_programs.cache_length(model.spec))
        return engine.runtime_for(model.target, programs, value, cache=cache)

    return read_weights(model, source, check_values=True).map(build)


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


def _write_draft_pin(folder: Path, pinned: Iterable[checkpoint_scan.SourceFile]) -> str:
    """Write the draft checkpoint's files into `draft_source.json` (atomically); its name."""
    doc = {"files": [f.to_json() for f in pinned]}
    files.write_text_atomic(folder / DRAFT_SOURCE, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return DRAFT_SOURCE


def compile_model(
    root: str | os.PathLike[str],
    model: FusedEngineModel,
    source: FusedSource,
    *,
    backend: Backend,
    graph_key: str,
    save_weights: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    record: Iterable[str] = (),
    previous: str | os.PathLike[str] | None = None,
) -> Result[CompileResult, CheckpointError]:
    """Compile every fused program into the folder `root` (as `engine.compile_model`): both
    checkpoints are checked from their headers, then read once (NaN and inf refused unless allowed)
    and pinned; with `save_weights` both models' weights go to one shard file.

    Returns:
        The compile result, or a CheckpointError naming every problem of either checkpoint.

    Raises:
        Exceptions from tracing propagate; the folder then reads as not compiled.
    """
    folder = Path(root)
    scanned = _scan_both(source)
    if isinstance(scanned, Failure):
        return scanned
    target_files, draft_files = scanned.unwrap()
    folder.mkdir(parents=True, exist_ok=True)
    recorded = [*record, _write_draft_pin(folder, draft_files)]
    if save_weights:
        written = write_shards(folder, model, source, listed=False)
        if isinstance(written, Failure):
            return Failure(written.failure())
        recorded.append(engine.sharded_weights(0))
    names = model.weight_names(source)
    examples = [
        weight_loader.example_weights(m.weight_plan(s.plan), s.path)
        for m, s in ((model.target, source.target), (model.draft, source.draft))
    ]
    ops.register()

    def requests(weights: Sequence[Tensor]) -> list[ProgramRequest]:
        return [
            ProgramRequest(
                key=key,
                fn=_Flat(model, names, key),
                signature=_signature(model, names, key),
                example=functools.partial(_example, model, weights, key),
            )
            for key in model.program_keys()
        ]

    return (
        examples[0]
        .bind(lambda t: examples[1].map(lambda d: [*t, *d]))
        .map(
            lambda weights: artifacts.compile_programs(
                folder,
                requests(weights),
                graph_key=graph_key,
                backend=backend,
                cache_dir=cache_dir,
                record=recorded,
                previous=previous,
                source=target_files,
            )
        )
    )


def write_shards(
    root: str | os.PathLike[str], model: FusedEngineModel, source: FusedSource, *, listed: bool = True
) -> Result[Path, Any]:
    """Write both models' weights (prefixed, an alias once) to the folder's shard file; with `listed`
    and a compiled `root`, list it in the manifest so loading reads it (as `engine.write_shards`)."""
    folder = Path(root)
    names = model.weight_names(source)
    written = read_weights(model, source).map(
        lambda t: checkpoint.write_safetensors(folder / engine.sharded_weights(0), {n: t[n] for n in names})
    )
    if isinstance(written, Failure) or not listed or not (folder / artifacts.MANIFEST).is_file():
        return written.map(lambda _: folder)
    return artifacts.add_files(folder, [engine.sharded_weights(0)]).map(lambda _: folder)


def repin_source(root: str | os.PathLike[str], source: FusedSource) -> Result[Any, Any]:
    """Accept both checkpoints as they are now (checked as compile() checks them) and pin them:
    the target's in the manifest, the draft's in `draft_source.json` (recorded again)."""
    folder = Path(root)
    scanned = _scan_both(source)
    if isinstance(scanned, Failure):
        return scanned
    target_files, draft_files = scanned.unwrap()
    return artifacts.replace_source(folder, target_files).bind(
        lambda _: artifacts.add_files(folder, [_write_draft_pin(folder, draft_files)])
    )


def _weights(root: Path, model: FusedEngineModel, source: FusedSource) -> Result[dict[str, Tensor], Any]:
    """Both models' weights for the compiled folder `root`: its shard file when the manifest lists
    it, else each original checkpoint, which must be the one pinned at compile (see `engine.rank_weights`)."""
    manifest = artifacts.read_manifest(root)
    if isinstance(manifest, Failure):
        return manifest
    rel = engine.sharded_weights(0)
    if rel in {f.path for f in manifest.unwrap().files}:
        shard = root / rel
        try:
            with checkpoint.open_checkpoint(shard) as ckpt:
                tensors = dict(ckpt.iter_tensors())
        except (checkpoint.CheckpointReadError, OSError) as e:
            why = f"cannot be read as weights ({type(e).__name__}: {e})"
            fix = "compile again with save_sharded_checkpoint=True (or write it again with shard_weights())"
            return Failure(ArtifactError(problems=(Problem.of(str(shard), "<unreadable>", why, fix),)))
        missing = [n for n in model.weight_names(source) if n not in tensors]
        if missing:
            return Failure(
                ArtifactError(problems=(Problem.of(str(shard), len(tensors), f"lacks the weights {missing}"),))
            )
        return Success(tensors)
    pins = [(source.target, manifest.unwrap().source), (source.draft, _read_draft_pin(root))]
    problems: list[Problem] = []
    missing = False
    for src, pinned in pins:
        try:
            found = checkpoint.find_checkpoint(src.path)
        except FileNotFoundError:
            why = (
                "holds no checkpoint: the folder was compiled without save_sharded_checkpoint, so weights come from it"
            )
            fix = "restore the checkpoint, or compile with save_sharded_checkpoint=True"
            problems.append(Problem.of(src.path, "<missing>", why, fix))
            missing = True
            continue
        problems.extend(_problems(checkpoint_scan.check_pinned(pinned, found), ""))
    if problems:  # a gone checkpoint reads as weights gone (FileNotFoundError), as for any model
        return Failure(ArtifactError(problems=tuple(problems), not_found=missing))
    return read_weights(model, source)


def _read_draft_pin(root: Path) -> tuple[checkpoint_scan.SourceFile, ...]:
    """The draft checkpoint's files as compiled (none when the folder holds no record: nothing pinned)."""
    path = root / DRAFT_SOURCE
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text(encoding="utf-8"))
    return tuple(checkpoint_scan.SourceFile.from_json(f) for f in raw.get("files", ()))


def load_model(
    root: str | os.PathLike[str],
    model: FusedEngineModel,
    source: FusedSource,
    *,
    backend: Backend,
    graph_key: str,
    warmup: bool = True,
) -> Result[Runtime, ArtifactError | CheckpointError]:
    """The fused runtime from the compiled folder `root`: programs read back (no tracing), bound to
    both models' weights (see `engine.load_model` for the failures)."""
    folder = Path(root)
    ops.register()
    names = model.weight_names(source)

    def runtime(programs: Mapping[ProgramKey, Any], tensors: Mapping[str, Tensor]) -> Result[Runtime, Any]:
        cache = model.empty_cache(length=fused_programs.cache_length(model.spec), device=backend.device)
        value = model.weights(tensors)
        return engine.bind_programs(backend, programs, 0, names, tensors).map(
            lambda bound: engine.runtime_for(model.target, bound, value, backend, cache=cache)
        )

    loaded: Result[Runtime, Any] = artifacts.load_programs(folder, backend, graph_key=graph_key).bind(
        lambda programs: _weights(folder, model, source).bind(lambda tensors: runtime(programs, tensors))
    )
    match loaded:
        case Success(rt) if warmup:
            warm_up(rt, model)
    return loaded


def warm_up(runtime: Runtime, model: FusedEngineModel) -> None:
    """Run every program once on example inputs, then clear the cache (first calls allocate)."""
    for key in runtime.programs:
        x, params, uniforms = model.example(key)
        runtime.run(key, x, rows=None, params=params, uniforms=uniforms)
    runtime.reset_cache()

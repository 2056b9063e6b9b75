"""A model's life cycle on one rank: the one compile path, the one load path, and the eager path.
Effects: traces programs through a backend, reads the checkpoint and the compiled-model folder,
writes the folder and its weights, allocates the KV cache, runs warm-up steps.

A model is an `EngineModel`: its family's program, its architecture, its NeuronSpec, and the rank
this process runs (0 of 1 without tensor parallelism). Weights always come from a
`CheckpointSource` (the original checkpoint and the model's weight plan), read through the rank's
plan, so a rank reads only its slices. From it:

- `compile_model(root, model, source, ...)` traces one step program per `ProgramKey` (sub-model,
  bucket, batch: `EngineModel.program_keys`), reusing unchanged ones; the same program serves
  every rank, traced from the checkpoint's headers alone. It writes every rank's weights when
  asked (`save_sharded_checkpoint`), the manifest last.
- `load_model(root, model, source, ...)` reads the programs back without tracing, binds them to
  this rank's weights (its shard file in the folder, else its slices of the original checkpoint)
  and returns a ready `Runtime`, warmed up when asked. Every expected failure is a Result.
- `eager_runtime(model, source)` runs the pure programs eagerly (`to_cpu()`).

The three paths (and `write_shards`, `repin_source`) take any `Deployable`: an `EngineModel`
with its `CheckpointSource`, or a fused model (`nxdi.effects.fused_engine`: a target and its
draft in one program per bucket) with both checkpoints. The model says which checkpoints its
weights come from and where each is pinned (`source_pins`), how its weights are read, written
and bound, how each program is traced, and how its runtime is built and warmed up.

Every program, eager or compiled, is called the same way, with its weights already bound:
`program(cache, inputs, params, uniforms) -> (StepOutputs, cache)`: logits, tokens and any extra
outputs (a mixture of experts' routing, `StepSpec.extras`), which a compiled program returns as
named outputs (`StepSpec.outputs`, its signature's). With several
ranks, these run in every rank process (`nxdi.effects.distributed`), in lockstep; on the xla and
neuron backends one process runs them all (`nxdi.effects.distributed.spmd`, from the pieces here:
`rank_weights`, `bind_programs`, `runtime_for`, `warm_up`). A compiled tensor-parallel program
takes its rank as an input (`RANK_INPUT`), so one program serves every rank.

With `is_block_kv_layout` the programs are block-KV steps (`nxdi.core.programs.block_kv`): keys
from the block plan (`nxdi.core.planning.block_programs`), the whole block cache as their cache,
`BLOCK_INPUTS` as their inputs, run by `Runtime.run_blocks` (under tensor parallelism on every
rank, each on its KV heads of every block: `EngineModel.empty_cache`).

With `lora_config` every program also carries the stacked LoRA adapters (read from the adapter
files at compile and load, `nxdi.effects.lora_adapters.read_for`; bound after the model's own
weights) and takes each row's adapter slot as the input `adapter_ids` (`nxdi.core.programs.lora`).

With `is_medusa` every program also runs the Medusa heads (`EngineModel.forward_outputs`,
`nxdi.core.programs.medusa`), bound as further weights after the model's own, read from its
heads file (`CheckpointSource.medusa_heads`, `nxdi.effects.medusa_heads`, pinned in the manifest
with the checkpoint's files); its speculation
programs are the tree steps (`medusa_speculation_length` tokens per row).

(Over 400 lines: the three paths share the weight reading, flat-step and binding definitions
here, and splitting them would put one calling convention in several rooms; the fused model's
paths are these same functions, through `Deployable`. The block-KV
variants of those definitions are branches of them for the same reason; the next kind of step
should move the flat step, example and binding into their own module.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ArtifactError, CheckpointError, Problem
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import block_programs, lora_ranks, model_programs, sharding
from nxdi.core.planning import lora as lora_plan
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.block_programs import BlockPlan
from nxdi.core.planning.medusa import MedusaPlan
from nxdi.core.planning.partition import Partition, check_partition, program_shard_plan
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.planning.rank_weights import rank_plan
from nxdi.core.programs import block_kv, catalog, kv_cache, lora, medusa
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.collectives import RANK_INPUT, SINGLE, Collectives, with_rank
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs, StepSpec, example_inputs, step
from nxdi.core.weight_plan import Combine, Take, WeightPlan
from nxdi.effects import artifacts, checkpoint, lora_adapters, medusa_heads, source_pins, weight_loader
from nxdi.effects.artifacts import CompileResult, ProgramRequest
from nxdi.effects.backends.base import Backend, LoadedProgram, Signature, WeightSet
from nxdi.effects.distributed import ops
from nxdi.effects.runtime import LoraWrites, Program, Runtime
from nxdi.effects.source_pins import CheckpointSource, Pinned

INPUTS = ("input_ids", "position_ids", "last_index", "sampling_params", "uniforms")
LORA_INPUTS = ("input_ids", "position_ids", "last_index", "adapter_ids", "sampling_params", "uniforms")
"""A multi-LoRA model's inputs: each row's adapter slot too (`StepInputs.adapter_ids`)."""
BLOCK_INPUTS = ("input_ids", "position_ids", *block_kv.NAMES, "sampling_params", "uniforms")
"""A block-KV program's inputs: each segment's output token is `out_index`, so no `last_index`."""


def sharded_weights(rank: int) -> str:
    """Where rank `rank`'s weights go in a compiled-model folder (NxDI's file name)."""
    return f"weights/tp{rank}_sharded_checkpoint.safetensors"


@attrs.frozen(kw_only=True)
class EngineModel:
    """Everything static about one model on the engine, seen from one rank."""

    program: catalog.Program
    """The family's program (forward pass, weight table)."""
    model: ModelSpec
    spec: NeuronSpec
    rank: int = 0
    """The tensor-parallel rank this process runs."""
    lowering: Backend | None = attrs.field(default=None, eq=False)
    """The backend a program is compiled for, when its collectives lower natively (`collectives`)."""

    @property
    def tp(self) -> int:
        return self.spec.tp_degree

    def shard_plan(self) -> sharding.ShardPlan:
        """The sharding of the program's layout (Q, K and V fused) over tp ranks."""
        planned = program_shard_plan(self.model, self.spec)
        assert isinstance(planned, Success), f"a model that passed its checks shards: {planned}"
        return planned.unwrap()

    def partition(self) -> Partition:
        """What every rank holds (one rank: everything, GQA kept native; with its MoE settings)."""
        if self.tp == 1:
            return Partition.single(self.model, moe=self.spec.moe)
        checked = check_partition(self.model, self.spec)
        assert isinstance(checked, Success), f"a model that passed its checks shards: {checked}"
        return checked.unwrap()

    def collectives(self) -> Collectives:
        """How this rank's programs meet the others (the identity with one rank): the backend's own
        collectives when it lowers them (XLA), else torch.distributed ops."""
        if self.tp == 1:
            return SINGLE
        native = None if self.lowering is None else self.lowering.collectives(self.tp)
        return native if native is not None else ops.collectives(self.tp)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The per-step inputs of its compiled programs (the rank too under tensor parallelism)."""
        names: tuple[str, ...] = BLOCK_INPUTS if self.spec.is_block_kv_layout else INPUTS
        names = LORA_INPUTS if self.spec.lora_config is not None else names
        return names if self.tp == 1 else (*names, RANK_INPUT)

    def block_plan(self) -> BlockPlan | None:
        """The block-KV programs and their selection (`is_block_kv_layout`), else None."""
        if not self.spec.is_block_kv_layout:
            return None
        planned = block_programs.block_plan(self.spec)
        assert isinstance(planned, Success), f"a model that passed its checks has block buckets: {planned}"
        return planned.unwrap()

    def weight_plan(self, plan: WeightPlan) -> WeightPlan:
        """This rank's share of the model's weight plan."""
        if self.tp == 1:
            return plan
        ranked = rank_plan(plan, self.shard_plan(), self.rank)
        assert isinstance(ranked, Success), f"the weight plan and the sharding plan describe one model: {ranked}"
        return ranked.unwrap()

    @property
    def step_spec(self) -> StepSpec:
        """The static part of every step program."""
        ods = self.spec.on_device_sampling_config
        # One rank needs no partition, unless it carries a mixture of experts' settings.
        part = self.partition() if self.tp > 1 or self.model.is_moe else None
        if ods is None:
            return StepSpec(model=self.model, partition=part)
        return StepSpec(
            model=self.model,
            partition=part,
            on_device_sampling=True,
            # dynamic sampling takes per-row parameters, so the program must be able to sample.
            do_sample=ods.do_sample or ods.dynamic,
            global_topk=ods.global_topk,
            output_logits=self.spec.output_logits,
        )

    def step_spec_for(self, key: ProgramKey) -> StepSpec:
        """The static part of `key`'s program: a speculation step returns every token's logits (a
        Medusa model's is its tree step); a Medusa program returns the heads' candidates too."""
        spec = key.phase is Phase.SPECULATION
        more = medusa.outputs(tree=spec) if self.spec.is_medusa else ()
        return dataclasses.replace(self.step_spec, all_logits=spec, program_outputs=more)

    def medusa(self) -> MedusaPlan | None:
        """The Medusa plan (`is_medusa`), else None."""
        if not self.spec.is_medusa:
            return None
        planned = medusa_plan.plan_for(self.spec)
        assert isinstance(planned, Success), f"a validated spec has a valid Medusa tree: {planned}"
        return planned.unwrap()

    def lora_layout(self) -> lora_plan.LoraLayout | None:
        """Where a multi-LoRA model's adapters go (`lora_config`), else None."""
        cfg = self.spec.lora_config
        if cfg is None:
            return None
        planned = lora_plan.layout_for(self.model, cfg)
        assert isinstance(planned, Success), f"a model that passed its checks has a LoRA layout: {planned}"
        return planned.unwrap()

    def lora_sharded(self) -> bool:
        """Whether the adapters' plain matrices are split over the ranks (`lora_shard_linear_layer`)."""
        cfg = self.spec.lora_config
        return cfg is not None and cfg.lora_shard_linear_layer

    def lora_takes(self) -> dict[str, Take | None]:
        """This rank's slice of every stacked adapter tensor (`lora_ranks.rank_takes`); empty at
        tp 1 or without `lora_config`."""
        layout = self.lora_layout()
        if layout is None or self.tp == 1:
            return {}
        return lora_ranks.rank_takes(layout, self.shard_plan(), self.rank, shard_linear=self.lora_sharded())

    @property
    def forward_outputs(self) -> Any:
        """The step's forward: the family program's, or for Medusa that plus the heads
        (`medusa.forward_outputs`), or with `lora_config` that with each row's adapter (`lora.forward_outputs`)."""
        plan = self.medusa()
        if plan is not None:
            return functools.partial(medusa.forward_outputs, base=self.program.forward_outputs, plan=plan)
        if self.spec.lora_config is not None:
            return functools.partial(lora.forward_outputs, base=self.program.forward_outputs)
        return self.program.forward_outputs

    def weights_value(self, tensors: Mapping[str, Tensor]) -> Any:
        """The programs' weights value from named tensors (with Medusa, the heads beside the program's;
        with LoRA, the stacked adapters)."""
        value = self.program.weights(tensors, spec=self.model)
        plan, layout = self.medusa(), self.lora_layout()
        if layout is not None:  # under tensor parallelism, the rank's widths and gathers
            shards, split = self.shard_plan(), self.lora_sharded()
            widths = {t: lora_ranks.part_widths(layout, shards, t) for t in layout.targets()}
            gathers = lora_ranks.gathers(layout, shards, shard_linear=split)
            return lora.weights_from_tensors(value, tensors, layout, widths=widths, gathers=gathers)
        if plan is None:
            return value
        return medusa.MedusaWeights(decoder=value, heads=medusa.heads_from_tensors(tensors, plan.num_heads))

    def example_inputs(self, *, batch: int, tokens: int) -> tuple[StepInputs, Tensor, Tensor]:
        """`step.example_inputs`, with every row on adapter slot 0 for a multi-LoRA model."""
        x, params, uniforms = example_inputs(batch=batch, tokens=tokens)
        if self.spec.lora_config is None:
            return x, params, uniforms
        return dataclasses.replace(x, adapter_ids=torch.zeros(batch, dtype=torch.int64)), params, uniforms

    def program_keys(self) -> tuple[ProgramKey, ...]:
        """Every program the model compiles (`model_programs.plain_keys`: what `nxdi plan` counts)."""
        keys = model_programs.plain_keys(self.spec)
        assert isinstance(keys, Success), f"a validated spec has valid bucket tables: {keys}"
        return keys.unwrap()

    def weight_names(self, plan: WeightPlan) -> tuple[str, ...]:
        """The weights a program binds, in order: the rank plan's own tensors (an alias is bound
        once), then a Medusa model's heads or a multi-LoRA model's stacked adapters."""
        own = tuple(s.name for s in self.weight_plan(plan).steps if s.combine is not Combine.ALIAS)
        heads, layout = self.medusa(), self.lora_layout()
        if layout is not None:
            return (*own, *layout.shapes())
        return own if heads is None else (*own, *medusa_plan.head_names(heads.num_heads))

    def cache_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype (`NeuronSpec.kv_dtype`): float8 with KV-cache quantization."""
        return weight_ops.torch_dtype(self.spec.kv_dtype)

    def empty_cache(self, *, length: int, batch: int | None = None, device: torch.device | None = None) -> KVCache:
        """A zero KV cache of this rank's kv heads and its share of `length` positions (all of them
        unless flash decoding splits them): every cache row (garbage rows too) unless `batch` is given.
        With the block layout: every block (and the garbage block), whatever `length` and `batch`."""
        if self.spec.is_block_kv_layout:
            return block_kv.empty_block_cache(
                self.model,
                num_blocks=self.spec.pa_num_blocks,
                block_size=self.spec.pa_block_size,
                dtype=self.cache_dtype(),
                heads=self.partition().kv_heads,
                device=device,
            )
        rows = self.spec.kv_cache_batch_size + self.spec.kv_cache_padding_size if batch is None else batch
        part = self.partition()
        slots = part.cache_slots(length)
        dtype = self.cache_dtype()
        return kv_cache.empty_cache(
            self.model, batch=rows, length=slots, dtype=dtype, heads=part.kv_heads, device=device
        )

    # --- what the three paths need (`Deployable`) ---

    def bound_names(self, source: CheckpointSource) -> tuple[str, ...]:
        return self.weight_names(source.plan)

    def checkpoints(self, source: CheckpointSource) -> tuple[Pinned, ...]:
        return (Pinned(source=source),)

    def read(
        self, source: CheckpointSource, *, check_values: bool = False
    ) -> Result[dict[str, Tensor], CheckpointError]:
        return read_weights(self, source, check_values=check_values)

    def example_weights(self, source: CheckpointSource) -> Result[list[Tensor], CheckpointError]:
        """Zeros of this rank's weights from the checkpoint's headers, then of a Medusa model's
        heads or a multi-LoRA model's stacked adapters (read, so bad ones are refused before tracing)."""
        own = weight_loader.example_weights(self.weight_plan(source.plan), source.path)
        if not self.spec.is_medusa and self.spec.lora_config is None:
            return own
        return own.bind(
            lambda example: read_extra(self, source).map(
                lambda extra: [*example, *(torch.zeros_like(t) for t in extra.values())]
            )
        )

    def write_shards(self, folder: Path, source: CheckpointSource) -> Result[tuple[str, ...], CheckpointError]:
        """Every rank's weights, one rank at a time (memory holds one rank's shard at most)."""
        for rank in range(self.tp):
            written = write_weights(folder, attrs.evolve(self, rank=rank), source)
            if isinstance(written, Failure):
                return Failure(written.failure())
        return Success(tuple(sharded_weights(rank) for rank in range(self.tp)))

    def request(
        self, names: Sequence[str], key: ProgramKey, example: Sequence[Tensor], backend: Backend
    ) -> ProgramRequest:
        m = attrs.evolve(self, lowering=backend)  # its collectives, when the backend lowers them itself
        return ProgramRequest(
            key=key,
            fn=_FlatStep(m, names, m.step_spec_for(key)),
            signature=_signature(m, names, key),
            example=functools.partial(_example, m, example, key),
        )

    def eager(self, tensors: Mapping[str, Tensor]) -> Runtime:
        value, coll = self.weights_value(tensors), self.collectives()
        programs: dict[ProgramKey, Program] = {
            key: functools.partial(step, self.forward_outputs, value, spec=self.step_spec_for(key), coll=coll)
            for key in self.program_keys()
        }
        return runtime_for(self, programs, value)

    def runtime(self, bound: Mapping[ProgramKey, Program], tensors: Mapping[str, Tensor], backend: Backend) -> Runtime:
        # With LoRA the runtime keeps the stacked adapters too: dynamic multi-LoRA writes its slots in place.
        lora_on = self.spec.lora_config is not None
        value = self.weights_value(tensors) if lora_on else self.program.weights(tensors, spec=self.model)
        return runtime_for(self, bound, value, backend)

    def warm_up(self, runtime: Runtime) -> None:
        warm_up(runtime, self)


# --- weights --------------------------------------------------------------------------------------


def read_weights(
    model: EngineModel, source: CheckpointSource, *, check_values: bool = False
) -> Result[dict[str, Tensor], CheckpointError]:
    """This rank's converted weights, read slice by slice from the original checkpoint; with
    `check_values`, NaN and inf in what it reads are refused (unless `source.allow_nonfinite`)."""
    refuse = check_values and not source.allow_nonfinite
    read = weight_loader.get_state_dict(source.path, model.weight_plan(source.plan), refuse_nonfinite=refuse)
    if not model.spec.is_medusa and model.spec.lora_config is None:
        return read
    return read.bind(lambda tensors: read_extra(model, source).map(lambda extra: {**tensors, **extra}))


def read_extra(model: EngineModel, source: CheckpointSource) -> Result[dict[str, Tensor], CheckpointError]:
    """The weights bound after the checkpoint's: a Medusa model's heads, a multi-LoRA model's
    stacked adapters (`lora_adapters.read_for`, every adapter checked), else none."""
    if model.spec.lora_config is not None:
        takes = model.lora_takes()
        return lora_adapters.read_for(model.spec, model.model).map(lambda stacked: lora_adapters.sliced(stacked, takes))
    return read_heads(model, source) if model.spec.is_medusa else Success({})


def read_heads(model: EngineModel, source: CheckpointSource) -> Result[dict[str, Tensor], CheckpointError]:
    """A Medusa model's heads from `source.medusa_heads`, checked (`nxdi.effects.medusa_heads`)."""
    assert source.medusa_heads is not None, "a Medusa model's source names its heads file"
    return medusa_heads.read_for(model.spec, model.model, source.medusa_heads, allow_nonfinite=source.allow_nonfinite)


def write_weights(
    root: str | os.PathLike[str], model: EngineModel, source: CheckpointSource
) -> Result[Path, CheckpointError]:
    """Read this rank's weights and write them (an alias once) to its shard file in the folder `root`."""
    names = model.weight_names(source.plan)
    return read_weights(model, source).map(
        lambda tensors: checkpoint.write_safetensors(
            Path(root) / sharded_weights(model.rank), {n: tensors[n] for n in names}
        )
    )


# --- the step as a flat program -----------------------------------------------------------------


class _FlatStep:
    """The step as `fn(*weights, *cache, *inputs) -> (*outputs, *cache)` (what a backend traces)."""

    def __init__(self, model: EngineModel, names: Sequence[str], spec: StepSpec) -> None:
        self.model, self.names, self.spec = model, tuple(names), spec

    def __call__(self, *flat: Tensor) -> tuple[Tensor, ...]:
        m = self.model
        w, c = len(self.names), 2 * m.model.num_layers
        weights = m.weights_value(dict(zip(self.names, flat[:w], strict=True)))
        blocks = None
        if m.spec.is_block_kv_layout:
            ids, positions, *rest = flat[w + c :]
            blocks = BlockInputs.from_tensors(rest[: len(block_kv.NAMES)])
            params, uniforms, *rank = rest[len(block_kv.NAMES) :]
            x = StepInputs(input_ids=ids, position_ids=positions, last_index=blocks.out_index[:, 0])
        elif m.spec.lora_config is not None:
            ids, positions, last, slots, params, uniforms, *rank = flat[w + c :]
            x = StepInputs(input_ids=ids, position_ids=positions, last_index=last, adapter_ids=slots)
        else:
            ids, positions, last, params, uniforms, *rank = flat[w + c :]
            x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        cache = KVCache.from_tensors(flat[w : w + c])
        spec, coll = self.spec, m.collectives()
        if rank:
            coll = with_rank(coll, rank[0])
        outs, new = step(m.forward_outputs, weights, cache, x, params, uniforms, spec=spec, coll=coll, blocks=blocks)
        named = outs.named()
        return (*(named[n] for n in spec.outputs), *new.to_tensors())


def _signature(model: EngineModel, names: Sequence[str], key: ProgramKey) -> Signature:
    cache = tuple(f"layers.{i}.{kv}" for i in range(model.model.num_layers) for kv in ("k", "v"))
    outputs = model.step_spec_for(key).outputs
    return Signature(weights=tuple(names), cache=cache, inputs=model.inputs, outputs=outputs)


def _example(model: EngineModel, weights: Sequence[Tensor], key: ProgramKey) -> list[Tensor]:
    cache = model.empty_cache(length=key.length, batch=key.batch)
    rank = [torch.tensor(model.rank)] if model.tp > 1 else []
    plan = model.block_plan()
    if plan is not None:
        x, blocks, params, uniforms = block_example(plan, key)
        return [
            *weights,
            *cache.to_tensors(),
            x.input_ids,
            x.position_ids,
            *blocks.to_tensors(),
            params,
            uniforms,
            *rank,
        ]
    x, params, uniforms = model.example_inputs(batch=key.batch, tokens=key.tokens)
    return [*weights, *cache.to_tensors(), *x.to_tensors(), params, uniforms, *rank]


def block_example(plan: BlockPlan, key: ProgramKey) -> tuple[StepInputs, BlockInputs, Tensor, Tensor]:
    """Inputs of a block program's shapes that write only the garbage block (tracing, warm-up)."""
    b, s, r, nb = key.batch, key.tokens, plan.segments, plan.blocks(key)
    x, _, _ = example_inputs(batch=b, tokens=s)
    blocks = BlockInputs(
        slot_mapping=torch.full((b, s), -1, dtype=torch.int64),
        block_table=torch.zeros((b, r, nb), dtype=torch.int64),
        computed=torch.zeros((b, r), dtype=torch.int64),
        segment=torch.zeros((b, s), dtype=torch.int64),
        out_index=torch.full((b, r), s - 1, dtype=torch.int64),
    )
    return x, blocks, torch.ones(b * r, 3), torch.full((b * r,), 0.5)


def _bound(backend: Backend, loaded: LoadedProgram, rank: int) -> Program:
    """A bound backend program in the runtime's calling convention (fed `rank` when it takes one)."""
    outputs = loaded.program.signature.outputs
    extra = (torch.tensor(rank),) if RANK_INPUT in loaded.program.signature.inputs else ()

    def call(cache: KVCache, x: StepInputs, params: Tensor, uniforms: Tensor, blocks: BlockInputs | None = None) -> Any:
        given = x.to_tensors() if blocks is None else (x.input_ids, x.position_ids, *blocks.to_tensors())
        outs, new = backend.run(loaded, cache.to_tensors(), (*given, params, uniforms, *extra))
        return StepOutputs.from_named(dict(zip(outputs, outs, strict=True))), KVCache.from_tensors(new)

    return call


def runtime_for(
    model: EngineModel,
    programs: Mapping[ProgramKey, Program],
    weights: Any,
    backend: Backend | None = None,
    *,
    cache: KVCache | None = None,
    lead: int = 0,
) -> Runtime:
    """The runtime of `programs`, its cache (default: empty) on the backend's device (the host when
    eager); `lead` leading rank dims on every cache tensor (see `Runtime`)."""
    ods = model.spec.on_device_sampling_config
    if cache is None:
        cache = model.empty_cache(length=model.spec.max_length, device=None if backend is None else backend.device)
    return Runtime(
        cache=cache,
        programs=programs,
        weights=weights,
        deterministic=ods is not None and ods.deterministic,
        kv_group=model.partition().kv_group,
        finish=None if backend is None else backend.finish,
        lead=lead,
        lora_writer=functools.partial(write_lora_slots, model) if model.spec.lora_config is not None else None,
    )


def write_lora_slots(model: EngineModel, weights: Any, writes: LoraWrites) -> None:
    """Copy each adapter's slot tensors (whole, as `lora.slot_tensors` makes them) into its slot of
    `weights`' stacked adapters (a `lora.LoraWeights`), this rank's slice of each."""
    layout = model.lora_layout()
    assert layout is not None and isinstance(weights, lora.LoraWeights), "a multi-LoRA model's weights"
    lora_adapters.write_slots(lora.named_tensors(weights, layout), model.lora_takes(), writes)


def warm_up(runtime: Runtime, model: EngineModel) -> None:
    """Run every program once on example inputs, then clear the cache (first calls allocate)."""
    plan = model.block_plan()
    for key in runtime.programs:
        if plan is not None:
            x, blocks, params, _ = block_example(plan, key)
            runtime.run_blocks(key, x, blocks, params=params)
            continue
        x, params, _ = model.example_inputs(batch=key.batch, tokens=key.tokens)
        runtime.run(key, x, rows=None, params=params)
    runtime.reset_cache()


# --- the three paths ----------------------------------------------------------------------------


class Deployable(Protocol):
    """What the three paths need of a model: an `EngineModel`, or a fused model (a target and its
    draft in one program per bucket: `nxdi.effects.fused_engine.FusedEngineModel`). `source` is the
    model's own kind of weight source (`CheckpointSource`, `FusedSource`)."""

    @property
    def rank(self) -> int: ...

    def program_keys(self) -> tuple[ProgramKey, ...]: ...

    def bound_names(self, source: Any) -> tuple[str, ...]:
        """The weights every program binds, in order (an alias once)."""
        ...

    def checkpoints(self, source: Any) -> tuple[Pinned, ...]:
        """Every checkpoint the weights come from, the one pinned in the manifest's `source` first."""
        ...

    def read(self, source: Any, *, check_values: bool = False) -> Result[dict[str, Tensor], CheckpointError]:
        """This rank's converted weights by bound name (NaN and inf refused with `check_values`)."""
        ...

    def example_weights(self, source: Any) -> Result[list[Tensor], CheckpointError]:
        """Zeros of the bound weights' shapes, in order, from the checkpoints' headers (tracing)."""
        ...

    def write_shards(self, folder: Path, source: Any) -> Result[tuple[str, ...], CheckpointError]:
        """Write the weights into `folder`'s shard files (every rank's); their paths in the folder."""
        ...

    def request(self, names: Sequence[str], key: ProgramKey, example: Sequence[Tensor], backend: Backend) -> Any:
        """The `artifacts.ProgramRequest` compiling `key`'s program for `backend`."""
        ...

    def eager(self, tensors: Mapping[str, Tensor]) -> Runtime:
        """The runtime of the pure programs, run eagerly, bound to `tensors`."""
        ...

    def runtime(self, bound: Mapping[ProgramKey, Program], tensors: Mapping[str, Tensor], backend: Backend) -> Runtime:
        """The runtime of the compiled programs `bound`, its cache on the backend's device."""
        ...

    def warm_up(self, runtime: Runtime) -> None:
        """Run every program once on example inputs, then clear the cache."""
        ...


def eager_runtime(model: Deployable, source: Any) -> Result[Runtime, CheckpointError]:
    """This rank's pure step programs, run eagerly, bound to its weights from `source` (NaN and
    inf refused unless the source allows them)."""
    return model.read(source, check_values=True).map(model.eager)


def compile_model(
    root: str | os.PathLike[str],
    model: Deployable,
    source: Any,
    *,
    backend: Backend,
    graph_key: str,
    save_weights: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    record: Iterable[str] = (),
    previous: str | os.PathLike[str] | None = None,
) -> Result[CompileResult, CheckpointError]:
    """Compile every program of `model` into the folder `root` (see `artifacts.compile_programs`;
    `previous`: the compiled folder a build folder `root` will replace, whose unchanged programs
    are reused).

    Every checkpoint is first checked from its headers (keys, shapes, floating dtypes) and then read
    once, file by file (`source_pins.scan`): NaN and inf weights are refused unless the source allows
    them, and every file's size, mtime and sha256 are pinned (in the manifest; a fused draft's in
    its own file, `Pinned.side`). The programs are traced from the checkpoints' headers alone,
    once for every rank (all ranks hold the same shapes). With `save_weights` every rank's weights
    are written, one rank at a time, so loading needs no checkpoint (and memory holds one rank's
    shard at most).

    Returns:
        The compile result, or a CheckpointError when a checkpoint does not fit the model or
        holds NaN or inf (every problem of every checkpoint listed).

    Raises:
        Exceptions from tracing propagate; the folder then reads as not compiled.
    """
    folder = Path(root)
    scanned = source_pins.scan(model.checkpoints(source))
    if isinstance(scanned, Failure):
        return Failure(scanned.failure())
    folder.mkdir(parents=True, exist_ok=True)
    files = [*record, *source_pins.write_side_pins(folder, scanned.unwrap())]
    if save_weights:
        written = model.write_shards(folder, source)
        if isinstance(written, Failure):
            return Failure(written.failure())
        files.extend(written.unwrap())
    names = model.bound_names(source)
    ops.register()  # otherwise collectives trace as nxdi:: ops

    def requests(example: Sequence[Tensor]) -> list[ProgramRequest]:
        return [model.request(names, key, example, backend) for key in model.program_keys()]

    return model.example_weights(source).map(
        lambda example: artifacts.compile_programs(
            folder,
            requests(example),
            graph_key=graph_key,
            backend=backend,
            cache_dir=cache_dir,
            record=files,
            previous=previous,
            source=source_pins.manifest_source(scanned.unwrap()),
        )
    )


def rank_weights(root: Path, model: Deployable, source: Any) -> Result[dict[str, Tensor], Any]:
    """This rank's weights for the compiled folder `root`: its shard file there when the manifest
    lists it (written by this compile, or by `write_shards` since), else read from the original
    checkpoints, which must be the ones pinned at compile (an ArtifactError when one is gone, or
    changed since: see `checkpoint_scan.check_pinned`). A shard the manifest does not list (left
    by an earlier compile) is never read: nothing says which weights it holds."""
    return artifacts.read_manifest(root).bind(lambda manifest: _rank_weights(root, manifest, model, source))


def _rank_weights(
    root: Path, manifest: artifacts.Manifest, model: Deployable, source: Any
) -> Result[dict[str, Tensor], Any]:
    rel = sharded_weights(model.rank)
    if rel in {f.path for f in manifest.files}:
        return _read_shard(root / rel, model.bound_names(source))
    # The programs were traced, and the values checked, for the checkpoints as they were at compile.
    checked = source_pins.check(root, manifest.source, model.checkpoints(source))
    return checked.bind(lambda _: model.read(source))


def _read_shard(shard: Path, names: Sequence[str]) -> Result[dict[str, Tensor], ArtifactError]:
    """A shard file the manifest lists, holding every weight of `names`."""
    try:
        with checkpoint.open_checkpoint(shard) as ckpt:
            tensors = dict(ckpt.iter_tensors())
    except (checkpoint.CheckpointReadError, OSError) as e:  # it matched the manifest, yet is unreadable
        why = f"cannot be read as weights ({type(e).__name__}: {e})"
        fix = "compile again with save_sharded_checkpoint=True (or write it again with shard_weights())"
        return Failure(ArtifactError(problems=(Problem.of(str(shard), "<unreadable>", why, fix),)))
    missing = [n for n in names if n not in tensors]
    if missing:
        return Failure(ArtifactError(problems=(Problem.of(str(shard), len(tensors), f"lacks the weights {missing}"),)))
    return Success(tensors)


def write_shards(root: str | os.PathLike[str], model: Deployable, source: Any) -> Result[Path, Any]:
    """Write every rank's weights into the folder `root` (`Deployable.write_shards`) and, when `root`
    is compiled, list them in its manifest so that loading uses them (see `rank_weights`). The
    caller holds the folder's lock exclusively.

    Returns:
        The folder, or the CheckpointError of reading the weights.
    """
    folder = Path(root)
    written = model.write_shards(folder, source)
    if isinstance(written, Failure) or not (folder / artifacts.MANIFEST).is_file():
        return written.map(lambda _: folder)  # not compiled yet: compile() writes its own weights, or none
    return written.bind(lambda rels: artifacts.add_files(folder, rels)).map(lambda _: folder)


def repin_source(root: str | os.PathLike[str], model: Deployable, source: Any) -> Result[artifacts.Manifest, Any]:
    """Accept the original checkpoints as they are now for the compiled folder `root`: check them as
    compile() does (`source_pins.scan`) and pin their files: in the manifest (`artifacts.replace_source`),
    with a Medusa model's heads file (checked when loading reads it), and a fused draft's in its own
    file (recorded again). The caller holds the folder's lock exclusively.

    Returns:
        The new manifest, or a CheckpointError (a checkpoint does not fit the model, or holds NaN
        or inf; the heads file is missing) or the ArtifactError of reading the manifest.
    """
    folder = Path(root)

    def pin(scanned: source_pins.Scanned) -> Result[artifacts.Manifest, Any]:
        replaced = artifacts.replace_source(folder, source_pins.manifest_source(scanned))
        sides = source_pins.write_side_pins(folder, scanned) if isinstance(replaced, Success) else []
        return replaced.bind(lambda m: artifacts.add_files(folder, sides) if sides else Success(m))

    return source_pins.scan(model.checkpoints(source)).bind(pin)


def bind_programs(
    backend: Backend,
    programs: Mapping[ProgramKey, Any],
    rank: int,
    names: Sequence[str],
    tensors: Mapping[str, Tensor],
) -> Result[dict[ProgramKey, Program], CheckpointError]:
    """Every compiled program bound to the weights `tensors` (by signature name) for `rank`.

    Returns:
        The runtime's programs by key, or a CheckpointError listing every weight that
        does not fit a program (prefixed with the program's name).
    """
    weight_set = WeightSet(tensors=tuple(tensors[n] for n in names))
    bound: dict[ProgramKey, Program] = {}
    problems: list[Problem] = []
    for key, compiled in programs.items():
        match backend.bind(compiled, weight_set):
            case Success(loaded):
                bound[key] = _bound(backend, loaded, rank)
            case Failure(err):
                problems.extend(p.prefixed(compiled.name) for p in err.problems)
    return Failure(CheckpointError(problems=tuple(problems))) if problems else Success(bound)


def load_model(
    root: str | os.PathLike[str],
    model: Deployable,
    source: Any,
    *,
    backend: Backend,
    graph_key: str,
    warmup: bool = True,
) -> Result[Runtime, ArtifactError | CheckpointError]:
    """This rank's runtime from the compiled folder `root`: programs read back (no tracing), bound to
    its weights (`rank_weights`).

    Returns:
        `Success(Runtime)` (warmed up when `warmup`), or a Failure: `ArtifactError` when nothing is
        compiled there (`not_found`), the folder is altered, of another format, backend or
        configuration, or its weights are gone or come from an original checkpoint that changed
        since compile; `CheckpointError` when the original checkpoint does
        not fit the plan or the weights do not fit the programs (every problem listed).
    """
    folder = Path(root)
    ops.register()  # before reading programs that call nxdi:: collectives
    names = model.bound_names(source)
    loaded: Result[Runtime, ArtifactError | CheckpointError] = artifacts.load_programs(
        folder, backend, graph_key=graph_key
    ).bind(
        lambda programs: rank_weights(folder, model, source).bind(
            lambda tensors: bind_programs(backend, programs, model.rank, names, tensors).map(
                lambda bound: model.runtime(bound, tensors, backend)
            )
        )
    )
    match loaded:
        case Success(runtime) if warmup:
            model.warm_up(runtime)
    return loaded


def write_hlo(
    root: str | os.PathLike[str], backend: Backend, directory: str | os.PathLike[str]
) -> Result[list[Path], ArtifactError]:
    """Write the HLO text of every program compiled in `root` to `directory/<program>.hlo.txt`.

    Returns:
        The files written, or the ArtifactError of reading the folder (see `artifacts.load_programs`).

    Raises:
        ValueError: `backend` keeps no HLO (only the xla backend lowers to HLO).
    """
    text = getattr(backend, "hlo_text", None)
    if text is None:
        raise ValueError(f"the {backend.name} backend keeps no HLO; compile with the xla backend (NXDI_BACKEND=xla)")
    out = Path(directory)

    def write(programs: Mapping[ProgramKey, Any]) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for program in programs.values():
            path = out / f"{program.name}.hlo.txt"
            path.write_text(text(program))
            written.append(path)
        return written

    return artifacts.load_programs(root, backend).map(write)

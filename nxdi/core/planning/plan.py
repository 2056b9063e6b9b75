"""The deployment plan: buckets, sharding, KV cache, memory and LoRA capacity of one configuration. Pure.

`plan_for(model, spec, ...)` answers "will this model fit, with which buckets, how is it split, how
many adapters fit?" without torch, a device or a compile. It fails only when a part cannot be computed
at all (an invalid bucket list, an impossible flash-decoding group, unknown LoRA target modules);
a configuration that can be planned but will not run as asked (a TP degree the platform does not
support, memory that does not fit, sequence parallelism over odd buckets, more adapters than fit) is
planned anyway and its `problems` say why, so one call reports everything.
"""

from __future__ import annotations

from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.config.sub_specs import LoraSpec
from nxdi.core.errors import ConfigError, Problem, problems_of
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import (
    block_buckets,
    buckets,
    fused_programs,
    kv_layout,
    lora,
    memory,
    model_programs,
    sharding,
    speculation_memory,
)
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.platform import INSTANCES, PLATFORMS, Platform


@attrs.frozen(kw_only=True)
class LoraRequest:
    """A LoRA capacity question: adapters of this size, in this much memory per core."""

    rank: int = attrs.field(default=16, validator=attrs.validators.gt(0))
    target_modules: tuple[str, ...] = lora.DEFAULT_TARGET_MODULES
    adapter_bytes: int | None = None
    """Size of one adapter (e.g. its checkpoint size); overrides rank and target_modules."""
    reserved_bytes_per_core: int | None = None
    """Memory set aside per core for adapters; None means whatever the plan leaves free."""
    shard_linear_layer: bool = True


@attrs.frozen(kw_only=True)
class Plan:
    """Everything `nxdi plan` reports for one configuration."""

    platform: Platform
    instance: str | None
    logical_nc_config: int
    context_encoding: buckets.BucketTable
    token_generation: buckets.BucketTable
    speculation: buckets.BucketTable | None
    """The speculation programs' table: fused programs' (`enable_fused_speculation`), Medusa's tree
    programs', or plain speculation programs'; None without speculation."""
    sharding: sharding.ShardPlan
    kv_cache: kv_layout.KVLayout
    memory: memory.MemoryPlan
    lora: lora.LoraCapacity | None
    block: block_buckets.BlockTables | None = None
    """Prefix-caching / chunked-prefill tables, compiled instead of the plain CTE (and, with prefix
    caching, TKG) tables; None without those features."""
    programs: tuple[ProgramKey, ...] = ()
    """Every program the engine compiles (`model_programs.keys_for`)."""
    problems: tuple[Problem, ...] = ()
    """Why this configuration will not run as asked (empty when it will)."""
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The `nxdi plan --json` document."""
        return {
            "platform": self.platform.value,
            "instance": self.instance,
            "logical_nc_config": self.logical_nc_config,
            "buckets": _buckets_dict(self),
            "sharding": _sharding_dict(self.sharding),
            "kv_cache": _kv_dict(self.kv_cache),
            "memory": _memory_dict(self.memory),
            "lora": _lora_dict(self.lora),
            "programs": _programs_dict(self.programs),
            "problems": [attrs.asdict(p) for p in self.problems],
            "warnings": list(self.warnings),
        }


def _table(t: buckets.BucketTable) -> list[Any]:
    return [list(b) for b in t.buckets_2d()] if t.is_2d else list(t.lengths)


def _buckets_dict(p: Plan) -> dict[str, Any]:
    """Each compiled table, and under `axes` what its entries are (a 2-D table lists pairs)."""
    ctx, tkg = _table(p.context_encoding), _table(p.token_generation)
    axes: dict[str, list[str]] = {
        "context_encoding": ["seq"],
        "token_generation": ["batch", "seq"] if p.token_generation.is_2d else ["seq"],
    }
    b = p.block
    if b is not None and b.chunked_prefill is not None:
        ctx, axes["context_encoding"] = [list(x) for x in b.chunked_prefill.buckets()], ["chunk", "tiles"]
    elif b is not None and b.prefix_context is not None:
        ctx, axes["context_encoding"] = [list(x) for x in b.prefix_context.buckets()], ["prefill", "prefix"]
    if b is not None and b.prefix_token is not None:
        tkg, axes["token_generation"] = [list(x) for x in b.prefix_token.buckets()], ["active", "prefix"]
    out: dict[str, Any] = {"context_encoding": ctx, "token_generation": tkg}
    if p.speculation is not None:
        out["speculation"], axes["speculation"] = _table(p.speculation), ["seq"]
    return {**out, "axes": axes}


def _programs_dict(keys: tuple[ProgramKey, ...]) -> dict[str, Any]:
    """How many programs compile, in all and per phase (phases with none left out)."""
    by_phase = {phase.value: sum(k.phase is phase for k in keys) for phase in Phase}
    return {"total": len(keys), "by_phase": {name: n for name, n in by_phase.items() if n}}


def _sharding_dict(s: sharding.ShardPlan) -> dict[str, Any]:
    c = s.counts
    e = s.experts_per_rank()
    t = s.experts_per_rank(token_generation=True) if s.hybrid else None
    return {
        "tp_degree": s.tp,
        "strategy": c.strategy.value,
        "num_attention_heads": c.q,
        "num_key_value_heads": c.kv,
        "q_heads": c.q_padded,
        "kv_heads": c.kv_padded,
        "q_heads_per_rank": c.q_per_rank,
        "kv_heads_per_rank": c.kv_per_rank,
        "params_per_rank": s.rank_params(),
        "experts_per_rank": None if e is None else e[0],
        "expert_rows_per_rank": None if e is None else e[1],
        # hybrid sharding: token generation's own copy of the experts (None: it uses the one above)
        "tkg_experts_per_rank": None if t is None else t[0],
        "tkg_expert_rows_per_rank": None if t is None else t[1],
    }


def _kv_dict(k: kv_layout.KVLayout) -> dict[str, Any]:
    return {
        "shape_per_rank": list(k.shape_per_rank),
        "num_layers": k.num_layers,
        "dtype": k.dtype,
        "bytes_per_rank": k.bytes_per_rank,
        "total_bytes": k.total_bytes,
    }


def _memory_dict(m: memory.MemoryPlan) -> dict[str, Any]:
    return {
        "weights_bytes": m.weights_bytes,
        "kv_cache_bytes": m.kv_cache_bytes,
        "total_bytes": m.total_bytes,
        "per_core_bytes": m.per_core_bytes,
        "weights_bytes_per_core": m.weights_bytes_per_core,
        "kv_cache_bytes_per_core": m.kv_cache_bytes_per_core,
        "lora_bytes_per_core": m.lora_bytes_per_core,
        "activation_bytes_per_core": m.activation_bytes_per_core,
        "speculation_bytes_per_core": m.speculation_bytes_per_core,
        "draft_weights_bytes_per_core": m.draft_weights_bytes_per_core,
        "draft_kv_cache_bytes_per_core": m.draft_kv_cache_bytes_per_core,
        "medusa_heads_bytes_per_core": m.medusa_heads_bytes_per_core,
        "hidden_cache_bytes_per_core": m.hidden_cache_bytes_per_core,
        "hbm_per_core_bytes": m.hbm_per_core_bytes,
        "fits": m.fits,
        "min_tp_degree": m.min_tp_degree,
    }


def _lora_dict(c: lora.LoraCapacity | None) -> dict[str, Any]:
    if c is None:
        return {"max_adapters": None}
    return {
        "max_adapters": c.max_adapters,
        "adapter_bytes": c.adapter.total_bytes,
        "bytes_per_core": c.bytes_per_core,
        "reserved_bytes_per_core": c.reserved_bytes_per_core,
        "requested": c.requested,
    }


def _platform(spec: NeuronSpec, platform: Platform | None, instance: str | None) -> Platform:
    """instance > platform argument > spec.target > trn1."""
    known = INSTANCES.get(instance) if instance is not None else None
    if known is not None:
        return known.platform
    if platform is not None:
        return platform
    return Platform(spec.target) if spec.target is not None else Platform.TRN1


def _lnc_note(spec: NeuronSpec, where: Platform) -> tuple[str, ...]:
    default = PLATFORMS[where].default_lnc
    if spec.logical_nc_config == default:
        return ()
    return (
        f"logical_nc_config={spec.logical_nc_config} differs from {where.value}'s default LNC={default}; "
        f"per-core HBM and valid TP degrees are those of LNC={spec.logical_nc_config}",
    )


def _lora_capacity(
    model: ModelSpec,
    spec: NeuronSpec,
    mem: memory.MemoryPlan,
    plan: sharding.ShardPlan,
    request: LoraRequest | None,
) -> Result[lora.LoraCapacity | None, ConfigError]:
    """Capacity for the requested adapters, else for `spec.lora_config`'s, else None. An adapter
    known by rank and target modules takes, per core, exactly what the engine allocates for it
    (`lora_ranks.bytes_per_slot`); one known only by its size, `lora.bytes_per_core`'s estimate."""
    free = max(mem.hbm_per_core_bytes - (mem.per_core_bytes - mem.lora_bytes_per_core), 0)
    cfg = spec.lora_config
    layout: Result[lora.LoraLayout | None, ConfigError] = Success(None)
    size: Result[lora.AdapterSize, ConfigError]
    if request is not None:
        if request.adapter_bytes is not None:
            size = Success(lora.adapter_size_of(request.adapter_bytes))
        else:
            size = lora.adapter_size(
                model, rank=request.rank, target_modules=request.target_modules, dtype=spec.torch_dtype
            )
            asked = LoraSpec(max_lora_rank=request.rank, target_modules=request.target_modules, max_loras=1)
            layout = size.bind(lambda _: lora.layout_for(model, asked))
        reserved = free if request.reserved_bytes_per_core is None else request.reserved_bytes_per_core
        shard, requested = request.shard_linear_layer, cfg.effective_max_loras if cfg is not None else None
    elif cfg is not None:
        size = lora.adapter_size_for(model, cfg, dtype=spec.torch_dtype)
        layout = lora.layout_for(model, cfg)
        reserved, shard, requested = free, cfg.lora_shard_linear_layer, cfg.effective_max_loras
    else:
        return Success(None)

    def capacity(s: lora.AdapterSize, where: lora.LoraLayout | None) -> Result[lora.LoraCapacity, ConfigError]:
        load = memory.LoraLoad(adapter=s, max_loras=1, shard_linear_layer=shard, layout=where)
        return lora.lora_capacity(
            s,
            reserved_bytes=reserved,
            tp=spec.tp_degree,
            shard_linear_layer=shard,
            requested=requested,
            per_core=memory.lora_slot_bytes(load, plan, spec.torch_dtype),
        )

    return size.bind(lambda s: layout.bind(lambda where: capacity(s, where)))


def _verdict(spec: NeuronSpec, p: Plan) -> tuple[Problem, ...]:
    """Why the planned configuration will not run as asked."""
    found = list(
        problems_of(
            sharding.check_tp_degree(spec.tp_degree, platform=p.platform, lnc=p.logical_nc_config, instance=p.instance),
            sharding.check_sequence_parallel(spec.tp_degree, p.context_encoding.lengths)
            if spec.sequence_parallel_enabled
            else Success(0),
        )
    )
    m = p.memory
    if not m.fits:
        fix = f"use tp_degree={m.min_tp_degree}" if m.min_tp_degree else "use a larger instance, quantize, or shrink"
        found.append(
            Problem.of(
                "tp_degree",
                spec.tp_degree,
                f"needs {m.per_core_bytes / 2**30:.2f} GiB per core, more than the "
                f"{m.hbm_per_core_bytes / 2**30:.2f} GiB of a {p.platform.value} core",
                fix,
            )
        )
    c = p.lora
    if c is not None and c.requested is not None and c.requested > c.max_adapters:
        found.append(
            Problem.of("lora_config.max_loras", c.requested, f"only {c.max_adapters} adapters fit", "lower max_loras")
        )
    return tuple(found)


def _speculation_table(spec: NeuronSpec) -> Result[buckets.BucketTable | None, ConfigError]:
    """The table of the speculation programs `spec` compiles (fused, Medusa tree or plain), else None."""
    if spec.enable_fused_speculation:
        return fused_programs.fused_table_for(spec)
    if spec.is_medusa:
        return medusa_plan.tree_table_for(spec)
    return buckets.speculation_table_for(spec) if spec.speculation_length > 0 else Success(None)


def _speculation_notes(spec: NeuronSpec, draft: speculation_memory.Draft | None) -> tuple[str, ...]:
    notes = []
    if spec.enable_fused_speculation and draft is None:
        notes.append(speculation_memory.NOT_COUNTED)
    if not spec.trace_tokengen_model and not spec.enable_fused_speculation:
        notes.append(
            "trace_tokengen_model=False: no token-generation programs are compiled (decoding runs in speculation steps)"
        )
    return tuple(notes)


def plan_for(
    model: ModelSpec,
    spec: NeuronSpec,
    *,
    platform: Platform | None = None,
    instance: str | None = None,
    lora_request: LoraRequest | None = None,
    draft: speculation_memory.Draft | None = None,
) -> Result[Plan, ConfigError]:
    """Plan `model` under `spec` on `instance` (or `platform`, or `spec.target`, or trn1), with a
    fused-speculation `draft` counted when given (else the plan warns that it is not counted).

    Returns:
        `Success(Plan)` whose `problems` list what will not run as asked, or `Failure` listing every
        part that cannot be planned at all.
    """
    where = _platform(spec, platform, instance)
    ctx, tkg = buckets.context_table_for(spec), buckets.token_table_for(spec)
    spec_table = _speculation_table(spec)
    block = block_buckets.block_tables_for(spec)
    shard, kv = sharding.shard_plan_for(model, spec), kv_layout.kv_layout_for(model, spec)
    mem = memory.memory_plan_for(model, spec, platform=where, instance=instance, draft=draft)
    capacity = mem.bind(lambda m: shard.bind(lambda sh: _lora_capacity(model, spec, m, sh, lora_request)))
    keys = model_programs.keys_for(spec)
    match ctx, tkg, spec_table, block, shard, kv, mem, capacity, keys:
        case (
            Success(c),
            Success(t),
            Success(s),
            Success(bl),
            Success(sh),
            Success(k),
            Success(m),
            Success(cap),
            Success(programs),
        ):
            plan = Plan(
                platform=where,
                instance=instance,
                logical_nc_config=spec.logical_nc_config,
                context_encoding=c,
                token_generation=t,
                speculation=s,
                block=bl,
                sharding=sh,
                kv_cache=k,
                memory=m,
                lora=cap,
                programs=programs,
                warnings=(*sh.notes, *_lnc_note(spec, where), *_speculation_notes(spec, draft)),
            )
            return Success(attrs.evolve(plan, problems=_verdict(spec, plan)))
    problems = dict.fromkeys(problems_of(ctx, tkg, spec_table, block, shard, kv, mem, capacity, keys))
    return Failure(ConfigError(problems=tuple(problems)))

"""The `nxdi plan` report: a planned configuration as readable text or as a JSON document. Pure.

`plan_document` is the stable machine-readable form (`nxdi plan --json`): `Plan.to_dict()`'s keys
(`buckets`, `sharding`, `kv_cache`, `memory`, `lora`, `problems`, `warnings`, ...) plus `model` and
`settings`. `render_plan` prints the same facts for people. Memory is shown in GiB (2**30 bytes),
LoRA sizes in MB/GB (10**6/10**9 bytes), as `nxdi plan --help` says.
"""

from __future__ import annotations

from typing import Any

import attrs

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import block_buckets, buckets
from nxdi.core.planning.plan import Plan

GIB = 1 << 30
MIB = 1 << 20
MB = 10**6
GB = 10**9


@attrs.frozen(kw_only=True)
class PlanRun:
    """What one `nxdi plan` invocation planned, with where its inputs came from."""

    model: ModelSpec
    spec: NeuronSpec
    plan: Plan
    config_file: str
    dtype_source: str
    """Where torch_dtype came from: `--torch-dtype`, `config.json` or `default`."""
    lora_memory_given: bool = False
    """Whether the LoRA memory per core was given (else it is what the plan leaves free)."""
    notes: tuple[str, ...] = ()
    """Notes from parsing the flags (deprecated names, ...), reported as warnings."""


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    return {
        "model_type": m.model_type,
        "num_params": m.num_params(),
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "num_experts": m.num_experts,
        "active_params": m.active_params(),
    }


def _settings_dict(r: PlanRun) -> dict[str, Any]:
    s = r.spec
    return {
        "tp_degree": s.tp_degree,
        "batch_size": s.batch_size,
        "max_context_length": s.max_context_length,
        "max_length": s.max_length,
        "torch_dtype": s.torch_dtype,
        "torch_dtype_source": r.dtype_source,
        "enable_bucketing": s.enable_bucketing,
    }


def plan_document(r: PlanRun) -> dict[str, Any]:
    """The `nxdi plan --json` document (standard JSON values only)."""
    doc = r.plan.to_dict()
    doc["warnings"] = [*doc["warnings"], *r.notes]
    return {"model": _model_dict(r.model), "settings": _settings_dict(r), **doc}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _count(n: int) -> str:
    """8030261248 -> '8.03B'."""
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def _n(count: int, noun: str) -> str:
    """3, 'query head' -> '3 query heads'."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _model_lines(r: PlanRun) -> list[str]:
    m, s = r.model, r.spec
    experts = (
        f", {m.num_experts} experts ({m.num_experts_per_tok} per token: {_count(m.active_params())} active)"
        if m.is_moe
        else ""
    )
    return [
        f"Model      {m.model_type} from {r.config_file}: {_count(m.num_params())} parameters{experts}",
        f"           {m.num_layers} layers, hidden {m.hidden_size}, ffn {m.intermediate_size}, vocab {m.vocab_size}; "
        f"{m.num_attention_heads} query heads, {m.num_kv_heads} KV heads, head_dim {m.head_dim}",
        f"Settings   tp_degree {s.tp_degree}, batch_size {s.batch_size}, max_context_length {s.max_context_length}, "
        f"max_length {s.max_length}, torch_dtype {s.torch_dtype} (from {r.dtype_source})",
    ]


def _target_line(p: Plan) -> str:
    where = f"{p.instance} ({p.platform.value})" if p.instance else p.platform.value
    hbm = _gib(p.memory.hbm_per_core_bytes)
    return f"Target     {where}, LNC {p.logical_nc_config}: {hbm} GiB HBM per logical core"


def _sharding_lines(p: Plan) -> list[str]:
    c = p.sharding.counts
    q = f"{c.q} query heads" + (f" padded to {c.q_padded}" if c.q_padded != c.q else "")
    kv = f"{c.kv} KV heads" + (f" -> {c.kv_padded}" if c.kv_padded != c.kv else "")
    return [
        f"Sharding   {c.strategy.value} over {c.tp} ranks: {q}, {kv}",
        f"           per rank: {_n(c.q_per_rank, 'query head')}, {_n(c.kv_per_rank, 'KV head')} "
        f"({_n(c.kv_groups, 'query head')} per KV head), {_count(p.sharding.rank_params())} parameters",
    ]


def _experts_lines(m: ModelSpec, p: Plan) -> list[str]:
    """Where a mixture of experts' experts live: how many each rank holds, and how much of each
    (under hybrid sharding, context encoding's layout and token generation's copy)."""
    if p.sharding.experts_per_rank() is None:
        return []
    phases = (("", False),) if not p.sharding.hybrid else (("context encoding ", False), ("token generation ", True))
    lines = []
    for label, tkg in phases:
        held = p.sharding.experts_per_rank(token_generation=tkg)
        assert held is not None
        local, width = held
        groups = m.num_experts // local
        split = "whole" if width >= m.intermediate_size else f"{width} of its {m.intermediate_size} intermediate rows"
        where = f"in {groups} expert groups of {p.sharding.tp // groups} ranks" if groups > 1 else "on every rank"
        lines.append(
            f"Experts    {label}{m.num_experts} per layer {where}: {_n(local, 'expert')} per rank, each {split}"
        )
    return lines


def _kv_lines(p: Plan) -> list[str]:
    k = p.kv_cache
    shape = ", ".join(str(d) for d in k.shape_per_rank)
    quant = f" (read as {k.compute_dtype})" if k.quantized else ""
    return [
        f"KV cache   K and V per layer and rank: [{shape}] [B, K, T, D] {k.dtype}{quant}",
        f"           {k.num_layers} layers: {k.bytes_per_rank / MIB:.1f} MiB per rank, {_gib(k.total_bytes)} GiB in total",
    ]


def _memory_lines(p: Plan) -> list[str]:
    m = p.memory
    rows = (
        ("weights", m.weights_bytes_per_core),
        ("KV cache", m.kv_cache_bytes_per_core),
        ("LoRA adapters", m.lora_bytes_per_core),
        ("activations (estimate)", m.activation_bytes_per_core),
    )
    speculation = (
        ("draft weights", m.draft_weights_bytes_per_core),
        ("draft KV cache", m.draft_kv_cache_bytes_per_core),
        ("Medusa heads", m.medusa_heads_bytes_per_core),
        ("EAGLE hidden states", m.hidden_cache_bytes_per_core),
    )
    rows += tuple((name, n) for name, n in speculation if n)  # only what this configuration holds
    lines = ["Memory per core (GiB)"]
    lines += [f"  {name:<24}{_gib(n):>9}" for name, n in rows]
    share = 100 * m.per_core_bytes / m.hbm_per_core_bytes
    lines.append(f"  {'total':<24}{_gib(m.per_core_bytes):>9}  of {_gib(m.hbm_per_core_bytes)} HBM ({share:.0f}%)")
    where = p.instance or p.platform.value
    smallest = (
        f"smallest TP degree that fits on {where}: {m.min_tp_degree}"
        if m.min_tp_degree is not None
        else f"no valid TP degree fits on {where}"
    )
    verdict = "fits" if m.fits else f"DOES NOT FIT (short by {_gib(m.per_core_bytes - m.hbm_per_core_bytes)} GiB)"
    lines.append(f"Verdict    {verdict}; {smallest}")
    return lines


def _table_lines(name: str, t: buckets.BucketTable) -> list[str]:
    lengths = ", ".join(str(n) for n in t.lengths)
    if not t.is_2d:
        return [f"  {name:<24}{lengths}"]
    return [f"  {name if i == 0 else '':<24}batch {b}: {lengths}" for i, b in enumerate(t.batch_sizes)]


def _pair_lines(name: str, rows: tuple[int, ...], cols: tuple[int, ...], axes: tuple[str, str]) -> list[str]:
    """A 2-D table as one line per row value: `prefill 512: prefix 0, 512, 1024`."""
    shown = ", ".join(str(c) for c in cols)
    return [f"  {name if i == 0 else '':<24}{axes[0]} {r}: {axes[1]} {shown}" for i, r in enumerate(rows)]


def _block_lines(b: block_buckets.BlockTables, p: Plan) -> list[str]:
    """The block-KV tables, in place of the plain ones they replace."""
    if b.chunked_prefill is not None:
        c = b.chunked_prefill
        ctx = _pair_lines("chunked prefill", c.chunks, c.tiles, ("chunk", "tiles"))
        ctx.append(f"  {'':<24}(tiles of {c.q_tile_size} x {c.kv_tile_size} tokens; {c.max_num_tiles} in all)")
    elif b.prefix_context is not None:
        ctx = _pair_lines(
            "context (prefix cache)", b.prefix_context.active, b.prefix_context.prefix, ("prefill", "prefix")
        )
    else:
        ctx = _table_lines("context encoding", p.context_encoding)
    if b.prefix_token is not None:
        t = b.prefix_token
        return ctx + _pair_lines("token gen, prefix cache", t.active, t.prefix, ("active", "prefix"))
    return ctx + _table_lines("token generation", p.token_generation)


def _bucket_lines(p: Plan) -> list[str]:
    if p.block is not None:
        lines = _block_lines(p.block, p)
    else:
        lines = [
            *_table_lines("context encoding", p.context_encoding),
            *_table_lines("token generation", p.token_generation),
        ]
    if p.speculation is not None:
        fused = p.speculation.kind is Phase.FUSED_SPECULATION
        name = "fused speculation" if fused else f"speculation (+{p.speculation.extra_tokens})"
        lines += _table_lines(name, p.speculation)
    return ["Buckets", *lines]


def _program_lines(p: Plan) -> list[str]:
    """How many programs compile, per phase."""
    counts = {phase: sum(k.phase is phase for k in p.programs) for phase in Phase}
    shown = ", ".join(f"{n} {phase.value}" for phase, n in counts.items() if n)
    return [f"Programs   {len(p.programs)} compiled: {shown}"]


def _lora_lines(p: Plan, *, memory_given: bool) -> list[str]:
    c = p.lora
    if c is None:
        return []
    asked = "" if c.requested is None else f" (max_loras asks for {c.requested})"
    return [
        f"LoRA       {c.max_adapters} adapters fit{asked}: {c.adapter.total_bytes / MB:.1f} MB each, "
        f"{c.bytes_per_core / MB:.2f} MB per core, in {c.reserved_bytes_per_core / GB:.2f} GB per core "
        + ("reserved" if memory_given else "(what the plan leaves free)")
    ]


def render_plan(r: PlanRun) -> str:
    """The plan as text: model, target, sharding, KV cache, memory verdict, buckets, LoRA, warnings, problems."""
    p = r.plan
    lines = [*_model_lines(r), _target_line(p), "", *_sharding_lines(p), *_experts_lines(r.model, p), *_kv_lines(p), ""]
    lines += [*_memory_lines(p), "", *_bucket_lines(p), *_program_lines(p)]
    lora = _lora_lines(p, memory_given=r.lora_memory_given)
    if lora:
        lines += ["", *lora]
    warnings = (*p.warnings, *r.notes)
    if warnings:
        lines += ["", "Warnings", *(f"  - {w}" for w in warnings)]
    if p.problems:
        lines += ["", "Problems (the configuration will not run as asked)", *(f"  - {x.render()}" for x in p.problems)]
    else:
        lines += ["", "No problems: the configuration runs as asked."]
    return "\n".join(lines)

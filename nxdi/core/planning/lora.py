"""Multi-LoRA capacity: adapter sizes and how many adapters fit in the memory reserved per core. Pure.

Theory of operation:
- A LoRA adapter on a linear layer `W [out, in]` adds `A [r, in]` and `B [out, r]`: `r * (in + out)`
  parameters per layer and target module.
- Under tensor parallelism one of A and B follows the base layer's split and the other is a plain linear
  layer. For a column-parallel base (q, k, v, gate, up) B is split and A is the plain one; for a
  row-parallel base (o, down) A is split and B is the plain one.
- `lora_shard_linear_layer=False` duplicates the plain layer on every core, so a core holds it in full
  plus `1/tp` of the other: about half the adapter. `True` shards it too (at the cost of an all-gather),
  so a core holds `1/tp` of the adapter.
- An adapter size given only as a total (a checkpoint's size) is taken as half plain, half split.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs
from returns.result import Failure, Result, Success

from nxdi.core import families
from nxdi.core.config.neuron_spec import DTYPE_BYTES
from nxdi.core.config.sub_specs import LoraSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.model_spec import ModelSpec

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ROW_PARALLEL_MODULES = frozenset({"o_proj", "down_proj"})
KNOWN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@attrs.frozen(kw_only=True)
class AdapterSize:
    """Bytes of one adapter, split into the part a duplicated linear layer keeps whole on every core."""

    total_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    plain_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    """Bytes of the plain (non-base-split) LoRA matrices: duplicated per core unless sharded."""

    @property
    def split_bytes(self) -> int:
        """Bytes of the LoRA matrices that always follow the base layer's tensor-parallel split."""
        return self.total_bytes - self.plain_bytes


def _module_dims(model: ModelSpec, module: str) -> tuple[int, int]:
    """(in, out) features of a target module's base layer."""
    e, f, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    dims = {
        "q_proj": (e, q),
        "k_proj": (e, kv),
        "v_proj": (e, kv),
        "o_proj": (q, e),
        "gate_proj": (e, f),
        "up_proj": (e, f),
        "down_proj": (f, e),
    }
    return dims[module]


def adapter_size(
    model: ModelSpec, *, rank: int, target_modules: Sequence[str] = DEFAULT_TARGET_MODULES, dtype: str = "bfloat16"
) -> Result[AdapterSize, ConfigError]:
    """Size of one rank-`rank` adapter on `target_modules` of every layer of `model`.

    Returns:
        `Failure` listing a non-positive rank, unknown target modules (with the known ones as the fix),
        a gate_proj target on a model without a gated MLP, and an unknown dtype.
    """
    problems: list[Problem] = []
    if rank < 1:
        problems.append(Problem.of("max_lora_rank", rank, "must be a positive integer"))
    unknown = [m for m in target_modules if m not in KNOWN_MODULES]
    if unknown:
        problems.append(
            Problem.of("target_modules", list(target_modules), f"unknown modules {unknown}", f"use {KNOWN_MODULES}")
        )
    if "gate_proj" in target_modules and not model.gated_mlp:
        problems.append(Problem.of("target_modules", list(target_modules), "gate_proj needs a gated MLP"))
    if dtype not in DTYPE_BYTES:
        problems.append(Problem.of("dtype", dtype, f"is not a known dtype ({', '.join(DTYPE_BYTES)})"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    total = plain = 0
    for module in dict.fromkeys(target_modules):
        fan_in, fan_out = _module_dims(model, module)
        a, b = rank * fan_in, fan_out * rank
        total += a + b
        plain += b if module in ROW_PARALLEL_MODULES else a
    scale = model.num_layers * DTYPE_BYTES[dtype]
    return Success(AdapterSize(total_bytes=total * scale, plain_bytes=plain * scale))


def adapter_size_of(total_bytes: int) -> AdapterSize:
    """An adapter known only by its total size: half plain, half split."""
    return AdapterSize(total_bytes=total_bytes, plain_bytes=total_bytes // 2)


def bytes_per_core(size: AdapterSize, *, tp: int, shard_linear_layer: bool) -> int:
    """Bytes one core holds for one adapter (rounded up)."""
    if shard_linear_layer:
        return -(-size.total_bytes // tp)
    return size.plain_bytes + -(-size.split_bytes // tp)


def max_adapters(
    size: AdapterSize, *, reserved_bytes: int, tp: int, shard_linear_layer: bool, per_core: int | None = None
) -> Result[int, ConfigError]:
    """How many adapters fit in `reserved_bytes` per core, each taking `per_core` bytes on a core
    when known exactly (`lora_ranks.bytes_per_slot`), else `bytes_per_core`'s estimate.

    Returns:
        `Failure` when tp is not positive, the reservation is negative, or the adapter is empty.
    """
    problems: list[Problem] = []
    if tp < 1:
        problems.append(Problem.of("tp_degree", tp, "must be a positive integer"))
    if reserved_bytes < 0:
        problems.append(Problem.of("reserved_bytes", reserved_bytes, "must be >= 0"))
    if size.total_bytes <= 0:
        problems.append(Problem.of("adapter_size", size.total_bytes, "must be positive"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    each = per_core if per_core is not None else bytes_per_core(size, tp=tp, shard_linear_layer=shard_linear_layer)
    return Success(reserved_bytes // each)


@attrs.frozen(kw_only=True)
class LoraCapacity:
    """How many adapters of one size fit in the memory reserved for them on each core."""

    adapter: AdapterSize
    bytes_per_core: int
    """Bytes one adapter takes on one core."""
    reserved_bytes_per_core: int
    max_adapters: int
    requested: int | None = None
    """`max_loras` asked for, if any."""


def lora_capacity(
    size: AdapterSize,
    *,
    reserved_bytes: int,
    tp: int,
    shard_linear_layer: bool,
    requested: int | None = None,
    per_core: int | None = None,
) -> Result[LoraCapacity, ConfigError]:
    """`max_adapters` with the per-core size it is based on (see `max_adapters`)."""
    each = per_core if per_core is not None else bytes_per_core(size, tp=tp, shard_linear_layer=shard_linear_layer)
    fit = max_adapters(size, reserved_bytes=reserved_bytes, tp=tp, shard_linear_layer=shard_linear_layer, per_core=each)
    return fit.map(
        lambda n: LoraCapacity(
            adapter=size,
            bytes_per_core=each,
            reserved_bytes_per_core=reserved_bytes,
            max_adapters=n,
            requested=requested,
        )
    )


def adapter_size_for(model: ModelSpec, spec: LoraSpec, *, dtype: str) -> Result[AdapterSize, ConfigError]:
    """Size of one adapter at `max_lora_rank` on `target_modules` (q, k, v, o when unset)."""
    modules = spec.target_modules or DEFAULT_TARGET_MODULES
    return adapter_size(model, rank=spec.max_lora_rank, target_modules=modules, dtype=dtype)


# --- the programs' stacked adapter weights ---------------------------------------------------------

QKV_MODULES = ("q_proj", "k_proj", "v_proj")
TARGET_OF = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
"""Target module -> the program's linear layer that carries it (Q, K and V share the fused `qkv`)."""
TARGETS = ("qkv", "o", "gate", "up", "down")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def weight_name(layer: int, target: str, matrix: str) -> str:
    """A stacked adapter tensor's name among a program's weights: `lora.layers.{i}.{target}.{a|b}`
    (a Q, K or V adapter's B is `lora.layers.{i}.{q|k|v}.b`: they share the fused `qkv.a`)."""
    return f"lora.layers.{layer}.{target}.{matrix}"


def b_name(layer: int, module: str) -> str:
    """The stacked B of `module` (`q_proj` -> `lora.layers.{i}.q.b`, `o_proj` -> `...o.b`)."""
    return weight_name(layer, module.removesuffix("_proj"), "b")


@attrs.frozen(kw_only=True)
class LoraLayout:
    """Where adapters go in the programs' weights: per layer and target module, A [S, R, in] and
    B [S, out, R] for S device slots, each adapter's matrices at its slot. Q, K and V adapters
    share the fused QKV projection: their A matrices are stacked along the rank in one `qkv.a`
    [S, R * m, E] (m of the three targeted), each keeps its own B, so the device holds exactly the
    `r * (in + out)` per module the planner counts (`adapter_size`)."""

    model: ModelSpec
    slots: int = attrs.field(validator=attrs.validators.ge(1))
    """S: `effective_max_loras` (slot 0 is the base model's, all zeros, with enable_base_model_only)."""
    rank: int = attrs.field(validator=attrs.validators.ge(1))
    """R: `max_lora_rank`; a smaller adapter's extra rows and columns stay zero."""
    modules: tuple[str, ...]
    """The target modules, in `KNOWN_MODULES` order."""
    base_slot: bool
    """Slot 0 holds no adapter (enable_base_model_only): rows with adapter id 0 run the base model."""
    transposed: bool = False
    """`lora_memory_transpose`: every matrix is stored `[in, out]` (A `[S, in, R_t]`, B `[S, R, out]`),
    the layout the batched products read without a transposed operand; else `[out, in]`."""

    def targets(self) -> tuple[str, ...]:
        """The program linears that carry adapters, in `TARGETS` order."""
        return tuple(t for t in TARGETS if any(TARGET_OF[m] == t for m in self.modules))

    def qkv_modules(self) -> tuple[str, ...]:
        return tuple(m for m in QKV_MODULES if m in self.modules)

    def slot_of(self, position: int) -> int:
        """The device slot of the `position`-th adapter of lora_ckpt_paths (NxDI's adapter index)."""
        return position + (1 if self.base_slot else 0)

    def dims(self, module: str) -> tuple[int, int]:
        """(in, out) features of a target module's base layer."""
        return _module_dims(self.model, module)

    def a_column(self, module: str) -> int:
        """The first rank row of `module`'s A within its target's A (Q, K, V side by side)."""
        return self.qkv_modules().index(module) * self.rank if TARGET_OF[module] == "qkv" else 0

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        """Every stacked tensor's name and shape as stored, in binding order: per layer and target
        its A [S, R_t, in], then the B [S, out, R] of each module it carries (the last two dims
        swapped when `transposed`)."""
        return {name: self.stored(shape) for name, shape in self.logical_shapes().items()}

    def logical_shapes(self) -> dict[str, tuple[int, int, int]]:
        """`shapes()` in the `[out, in]` orientation the programs compute with, whatever `transposed`."""
        out: dict[str, tuple[int, int, int]] = {}
        for layer in range(self.model.num_layers):
            for target in self.targets():
                carried = [m for m in self.modules if TARGET_OF[m] == target]
                out[weight_name(layer, target, "a")] = (self.slots, self.rank * len(carried), self.dims(carried[0])[0])
                for m in carried:
                    out[b_name(layer, m)] = (self.slots, self.dims(m)[1], self.rank)
        return out

    def stored(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """A logical `[S, out, in]` shape as stored."""
        return (shape[0], shape[2], shape[1]) if self.transposed else shape

    def stored_dim(self, dim: int) -> int:
        """A logical dim (1 or 2) of a stacked tensor as stored."""
        return 3 - dim if self.transposed and dim > 0 else dim


def layout_for(model: ModelSpec, spec: LoraSpec) -> Result[LoraLayout, ConfigError]:
    """The stacked layout of `spec`'s adapters on `model` (target modules q, k, v, o when unset).

    Returns:
        `Failure` listing target modules nxdi does not know, MLP modules on a model without a gated
        dense MLP (a mixture of experts, a plain MLP), and a model without per-layer q/k/v/o.
    """
    modules = spec.target_modules or DEFAULT_TARGET_MODULES
    problems: list[Problem] = []
    field = "lora_config.target_modules"
    unknown = [m for m in modules if m not in KNOWN_MODULES]
    if unknown:
        why = f"names modules nxdi cannot attach adapters to: {unknown}"
        problems.append(Problem.of(field, list(modules), why, f"target only {', '.join(KNOWN_MODULES)}"))
    mlp = [m for m in modules if m in ("gate_proj", "up_proj", "down_proj")]
    if mlp and (model.is_moe or not model.gated_mlp):
        kind = "a mixture of experts" if model.is_moe else "a plain (ungated) MLP"
        why = f"targets {mlp}, which this base model lacks: it has {kind}"
        problems.append(Problem.of(field, list(modules), why, "target the attention projections only"))
    record = families.by_model_type().get(model.model_type)
    if record is not None and not record.lora:
        served = ", ".join(r.model_type for r in families.RECORDS if r.lora)
        why = f"is set on a {model.model_type} model; multi-LoRA serving runs on {served}"
        problems.append(
            Problem.of("lora_config", "LoraServingConfig(...)", why, "serve this model without lora_config")
        )
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    return Success(
        LoraLayout(
            model=model,
            slots=spec.effective_max_loras,
            rank=spec.max_lora_rank,
            modules=tuple(m for m in KNOWN_MODULES if m in modules),
            base_slot=spec.enable_base_model_only,
            transposed=spec.lora_memory_transpose,
        )
    )


def parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" | "B") of a PEFT adapter tensor name
    (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`), None for any other name."""
    found = _KEY.search(key)
    if found is None or found.group(2) not in KNOWN_MODULES:
        return None
    return int(found.group(1)), found.group(2), found.group(3)


def check_adapter(adapter_id: str, shapes: Mapping[str, tuple[int, ...]], layout: LoraLayout) -> tuple[Problem, ...]:
    """Every problem with one adapter's tensors (name -> shape) against `layout`: a tensor that is
    no A or B matrix of a known module (embeddings, biases, modules_to_save: they cannot take
    effect), a layer past the model's, a module outside target_modules, a rank above
    max_lora_rank, shapes of another base model (each tensor named with the shape it needs), and
    an A without its B or the reverse. Fields read `lora_config.lora_ckpt_paths[<id>].<tensor>`."""
    field = f"lora_config.lora_ckpt_paths[{adapter_id}]"
    problems: list[Problem] = []
    seen: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        parsed = parse_key(key)
        if parsed is None:
            why = "is not the lora_A/lora_B weight of a q/k/v/o/gate/up/down projection, so it cannot take effect"
            problems.append(Problem.of(f"{field}.{key}", list(shape), why, "save the adapter without it"))
            continue
        layer, module, matrix = parsed
        if layer >= layout.model.num_layers:
            why = f"is for layer {layer}, but the base model has {layout.model.num_layers} layers"
            problems.append(Problem.of(f"{field}.{key}", list(shape), why, "use an adapter trained on this base model"))
        elif module not in layout.modules:
            fix = f"add {module} to lora_config.target_modules (now {list(layout.modules)})"
            problems.append(Problem.of(f"{field}.{key}", list(shape), f"adapts {module}, not a target module", fix))
        else:
            seen.setdefault((layer, module), {})[matrix] = shape
            problems.extend(_shape_problems(f"{field}.{key}", shape, matrix, layout.dims(module), layout.rank))
    for (layer, module), pair in sorted(seen.items()):
        if len(pair) == 1:
            (have,) = pair
            lacking = "B" if have == "A" else "A"
            why = f"has lora_{have} but no lora_{lacking} for layers.{layer}.{module}"
            problems.append(Problem.of(field, f"layers.{layer}.{module}", why, "save both matrices"))
        elif pair["A"][:1] != pair["B"][1:2]:
            why = f"layers.{layer}.{module}: lora_A has rank {pair['A'][0]}, lora_B {pair['B'][1]}"
            problems.append(Problem.of(field, f"layers.{layer}.{module}", why, "save a consistent adapter"))
    return tuple(problems)


def _shape_problems(
    name: str, shape: tuple[int, ...], matrix: str, dims: tuple[int, int], max_rank: int
) -> list[Problem]:
    """A [r, in] / B [out, r] against the base layer's (in, out) and max_lora_rank."""
    fan_in, fan_out = dims
    if len(shape) != 2:
        return [Problem.of(name, list(shape), "is not a matrix", "use an adapter in the PEFT format")]
    rank, width = (shape[0], shape[1]) if matrix == "A" else (shape[1], shape[0])
    want = fan_in if matrix == "A" else fan_out
    problems = []
    if width != want:
        need = [rank, want] if matrix == "A" else [want, rank]
        why = f"does not fit the base model's layer (needs {need}): an adapter for another base model"
        problems.append(Problem.of(name, list(shape), why, "use an adapter trained on this base model"))
    if rank > max_rank:
        why = f"has rank {rank}, above lora_config.max_lora_rank={max_rank}"
        problems.append(Problem.of(name, list(shape), why, f"set max_lora_rank >= {rank}"))
    return problems

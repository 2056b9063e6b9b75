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

from collections.abc import Sequence

import attrs
from returns.result import Failure, Result, Success

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
    size: AdapterSize, *, reserved_bytes: int, tp: int, shard_linear_layer: bool
) -> Result[int, ConfigError]:
    """How many adapters fit in `reserved_bytes` per core.

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
    return Success(reserved_bytes // bytes_per_core(size, tp=tp, shard_linear_layer=shard_linear_layer))


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
    size: AdapterSize, *, reserved_bytes: int, tp: int, shard_linear_layer: bool, requested: int | None = None
) -> Result[LoraCapacity, ConfigError]:
    """`max_adapters` with the per-core size it is based on (see `max_adapters`)."""
    return max_adapters(size, reserved_bytes=reserved_bytes, tp=tp, shard_linear_layer=shard_linear_layer).map(
        lambda n: LoraCapacity(
            adapter=size,
            bytes_per_core=bytes_per_core(size, tp=tp, shard_linear_layer=shard_linear_layer),
            reserved_bytes_per_core=reserved_bytes,
            max_adapters=n,
            requested=requested,
        )
    )


def adapter_size_for(model: ModelSpec, spec: LoraSpec, *, dtype: str) -> Result[AdapterSize, ConfigError]:
    """Size of one adapter at `max_lora_rank` on `target_modules` (q, k, v, o when unset)."""
    modules = spec.target_modules or DEFAULT_TARGET_MODULES
    return adapter_size(model, rank=spec.max_lora_rank, target_modules=modules, dtype=dtype)

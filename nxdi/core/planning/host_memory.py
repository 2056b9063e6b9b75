"""Host memory: whether a model's weights, KV cache and activations fit in the memory this host has
free, decided before anything is allocated. Pure.

Theory of operation:
- The CPU engine (and the eager path, `to_cpu()`) holds everything in host memory. Every rank this
  host runs (`local_ranks_size`: all of them unless torchrun spreads them over nodes) holds its
  weights, its KV cache (every cache row at max_length) and its activations.
- The figures come from the device memory planner (`memory.memory_plan_for`), per core times the
  ranks, with the model's sliding window ignored: the CPU engine keeps every position in its cache.
- The verdict compares their sum with the bytes the effects layer reads as available
  (`nxdi.effects.memory.available_bytes`); unknown (off Linux) means no verdict. Refusing here
  replaces the OS killing the process part way through allocating.
"""

from __future__ import annotations

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import memory

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit below it, e.g. `12.5 GiB`."""
    size, unit = float(n), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{size:,.1f} {_UNITS[unit]}"


@attrs.frozen(kw_only=True)
class HostNeed:
    """The host memory a model holds once loaded, over every rank this host runs."""

    ranks: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes

    def render(self) -> str:
        """`weights 1.2 GiB + KV cache 3.0 GiB + activations 0.1 GiB = 4.3 GiB (2 ranks)`."""
        parts = (
            f"weights {format_bytes(self.weights_bytes)} + KV cache {format_bytes(self.kv_cache_bytes)} "
            f"+ activations {format_bytes(self.activation_bytes)} = {format_bytes(self.total_bytes)}"
        )
        return parts + (f" ({self.ranks} ranks)" if self.ranks > 1 else "")


def host_need_for(model: ModelSpec, spec: NeuronSpec) -> Result[HostNeed, ConfigError]:
    """What loading `model` with `spec` holds in this host's memory (see the module rules).

    Returns:
        `Failure` when the memory planner cannot plan the configuration (see `memory.memory_plan_for`).
    """
    full_cache = attrs.evolve(model, sliding_window=None, full_attention_layers=())
    ranks = min(spec.local_ranks_size, spec.tp_degree)
    return memory.memory_plan_for(full_cache, spec).map(
        lambda plan: HostNeed(
            ranks=ranks,
            weights_bytes=plan.weights_bytes_per_core * ranks,
            kv_cache_bytes=plan.kv_cache_bytes_per_core * ranks,
            activation_bytes=plan.activation_bytes_per_core * ranks,
        )
    )


def _culprit(need: HostNeed, spec: NeuronSpec) -> Problem:
    """The problem, named after the settings behind the largest part of `need`."""
    largest = max(need.weights_bytes, need.kv_cache_bytes, need.activation_bytes)
    dtype = f"a smaller torch_dtype than {spec.torch_dtype}" if spec.dtype_bytes > 1 else "a smaller model"
    if largest == need.kv_cache_bytes:
        return Problem.of(
            "kv_cache_batch_size",
            spec.kv_cache_batch_size,
            f"the KV cache (max_length={spec.max_length}) needs {format_bytes(need.kv_cache_bytes)}",
            f"lower batch_size / kv_cache_batch_size or seq_len / max_length, or use {dtype} or attention_dtype",
        )
    if largest == need.weights_bytes:
        return Problem.of(
            "torch_dtype",
            spec.torch_dtype,
            f"the weights need {format_bytes(need.weights_bytes)}",
            f"use {dtype}, or a host with more memory",
        )
    return Problem.of(
        "max_context_length",
        spec.max_context_length,
        f"activations (batch_size={spec.ctx_batch_size}) need {format_bytes(need.activation_bytes)}",
        "lower batch_size or max_context_length (or enable_bucketing with smaller buckets)",
    )


def check_host_memory(need: HostNeed, spec: NeuronSpec, available_bytes: int | None) -> Result[HostNeed, ConfigError]:
    """`Success(need)` when it fits in `available_bytes` (or that is unknown, None).

    Returns:
        `Failure` naming the setting behind the largest part, with every figure of the plan and
        the memory available, when it does not fit.
    """
    if available_bytes is None or need.total_bytes <= available_bytes:
        return Success(need)
    problem = _culprit(need, spec)
    why = f"{problem.reason}; in all {need.render()}, above the {format_bytes(available_bytes)} this host has available"
    return Failure(ConfigError(problems=(attrs.evolve(problem, reason=why),)))

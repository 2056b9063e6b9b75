"""Assemble a Runtime: allocate the KV cache and bind one step program per sub-model and bucket.
Effects: allocates tensors.

The bucket tables come from the core planners; each `(phase, bucket)` gets the pure step
(`nxdi.core.programs.step`) with its static spec bound, unless the caller passes compiled programs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from returns.result import Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import buckets
from nxdi.core.programs import catalog, kv_cache
from nxdi.core.programs.step import StepSpec, step
from nxdi.effects.runtime import Program, Runtime


def step_spec_for(model: ModelSpec, spec: NeuronSpec) -> StepSpec:
    """The static part of every step program of `spec`."""
    ods = spec.on_device_sampling_config
    if ods is None:
        return StepSpec(model=model)
    return StepSpec(
        model=model,
        on_device_sampling=True,
        # dynamic sampling takes per-row parameters, so the program must be able to sample.
        do_sample=ods.do_sample or ods.dynamic,
        global_topk=ods.global_topk,
        output_logits=spec.output_logits,
    )


def bucket_lengths(spec: NeuronSpec) -> dict[Phase, tuple[int, ...]]:
    """The compiled sequence buckets per sub-model (the planners' tables, which `spec` passed)."""
    tables = {Phase.CONTEXT: buckets.context_table_for(spec), Phase.TOKEN: buckets.token_table_for(spec)}
    out = {}
    for phase, table in tables.items():
        assert isinstance(table, Success), f"a validated spec has valid bucket tables: {table}"
        out[phase] = table.unwrap().lengths
    return out


def eager_programs(program: catalog.Program, model: ModelSpec, spec: NeuronSpec) -> dict[tuple[Phase, int], Program]:
    """The pure step bound to its static spec, for every compiled bucket (no compilation)."""
    program = functools.partial(step, program.forward, spec=step_spec_for(model, spec))
    return {(phase, b): program for phase, lengths in bucket_lengths(spec).items() for b in lengths}


def build_runtime(
    model: ModelSpec,
    spec: NeuronSpec,
    program: catalog.Program,
    weights: Any,
    *,
    programs: Mapping[tuple[Phase, int], Program] | None = None,
    seed: int = 0,
) -> Runtime:
    """A runtime with a zero KV cache of `kv_cache_batch_size` rows and `max_length` slots."""
    cache = kv_cache.empty_cache(
        model,
        batch=spec.kv_cache_batch_size + spec.kv_cache_padding_size,
        length=spec.max_length,
        dtype=weight_ops.torch_dtype(spec.attention_dtype or spec.torch_dtype),
    )
    ods = spec.on_device_sampling_config
    return Runtime(
        weights=weights,
        cache=cache,
        programs=programs if programs is not None else eager_programs(program, model, spec),
        seed=seed,
        deterministic=ods is not None and ods.deterministic,
    )

"""The step programs in the backends' flat calling convention: requests to compile, runtime adapters.
Effects: traces and binds programs through a backend.

A step `(weights, cache, inputs, params, uniforms) -> (logits, tokens, cache)` becomes the flat
`fn(*weights, *cache, *inputs) -> (*outputs, *cache)` of `nxdi.effects.backends.base`, with one
`ProgramRequest` per sub-model and bucket; after loading, each bound program is wrapped back into
the Runtime's `Program` callable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import catalog, kv_cache
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepSpec, step
from nxdi.effects.artifacts import ProgramRequest
from nxdi.effects.backends.base import Backend, LoadedProgram, Signature
from nxdi.effects.engine import bucket_lengths, step_spec_for
from nxdi.effects.runtime import Program

INPUTS = ("input_ids", "position_ids", "last_index", "sampling_params", "uniforms")


def program_name(phase: Phase, bucket: int) -> str:
    """`context_encoding_128`, `token_generation_256`, ..."""
    return f"{phase.value}_{bucket}"


def bound_weights(tensors: Mapping[str, Tensor], model: ModelSpec) -> dict[str, Tensor]:
    """The weights a program takes: every nxdi weight once (a tied lm_head is the embedding)."""
    if model.tie_word_embeddings:
        return {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return dict(tensors)


def signature_for(weight_names: Sequence[str], model: ModelSpec, spec: StepSpec) -> Signature:
    cache = tuple(f"layers.{i}.{kv}" for i in range(model.num_layers) for kv in ("k", "v"))
    outputs = (
        ("logits", "tokens")
        if spec.on_device_sampling and spec.output_logits
        else (("tokens",) if spec.on_device_sampling else ("logits",))
    )
    return Signature(weights=tuple(weight_names), cache=cache, inputs=INPUTS, outputs=outputs)


class _FlatStep:
    """The step as a flat function of tensors (picklable parts only: what torch.export traces)."""

    def __init__(self, program: catalog.Program, weight_names: Sequence[str], spec: StepSpec) -> None:
        self.program, self.names, self.spec = program, tuple(weight_names), spec

    def __call__(self, *flat: Tensor) -> tuple[Tensor, ...]:
        w = len(self.names)
        c = 2 * self.spec.model.num_layers
        weights = self.program.weights(dict(zip(self.names, flat[:w], strict=True)), spec=self.spec.model)
        cache = KVCache.from_tensors(flat[w : w + c])
        ids, positions, last, params, uniforms = flat[w + c :]
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        logits, tokens, new = step(self.program.forward, weights, cache, x, params, uniforms, spec=self.spec)
        outputs = tuple(t for t in (logits, tokens) if t is not None)
        return (*outputs, *new.to_tensors())


def _example(
    weights: Mapping[str, Tensor], model: ModelSpec, spec: NeuronSpec, phase: Phase, bucket: int
) -> list[Tensor]:
    batch = spec.ctx_batch_size if phase is Phase.CONTEXT else spec.tkg_batch_size
    s = bucket if phase is Phase.CONTEXT else 1
    dtype = weight_ops.torch_dtype(spec.attention_dtype or spec.torch_dtype)
    cache = kv_cache.empty_cache(model, batch=batch, length=bucket, dtype=dtype)
    inputs = [
        torch.zeros(batch, s, dtype=torch.int64),
        torch.arange(s, dtype=torch.int64)[None, :].expand(batch, s).contiguous(),
        torch.full((batch,), s - 1, dtype=torch.int64),
        torch.ones(batch, 3, dtype=torch.float32),
        torch.full((batch,), 0.5, dtype=torch.float32),
    ]
    return [*weights.values(), *cache.to_tensors(), *inputs]


def program_requests(
    program: catalog.Program, model: ModelSpec, spec: NeuronSpec, weights: Mapping[str, Tensor]
) -> list[ProgramRequest]:
    """One request per sub-model and bucket; examples are built only if a program must be traced."""
    step_spec = step_spec_for(model, spec)
    names = tuple(weights)
    signature = signature_for(names, model, step_spec)
    flat = _FlatStep(program, names, step_spec)
    return [
        ProgramRequest(
            name=program_name(phase, bucket),
            fn=flat,
            signature=signature,
            example=lambda phase=phase, bucket=bucket: _example(weights, model, spec, phase, bucket),
        )
        for phase, lengths in bucket_lengths(spec).items()
        for bucket in lengths
    ]


def runtime_program(backend: Backend, loaded: LoadedProgram) -> Program:
    """A bound program as the Runtime calls it (the weights argument is already bound)."""
    outputs = loaded.program.signature.outputs

    def call(_weights: Any, cache: KVCache, x: StepInputs, params: Tensor, uniforms: Tensor) -> Any:
        inputs = (x.input_ids, x.position_ids, x.last_index, params, uniforms)
        outs, new = backend.run(loaded, cache.to_tensors(), inputs)
        named = dict(zip(outputs, outs, strict=True))
        return named.get("logits"), named.get("tokens"), KVCache.from_tensors(new)

    return call


def phase_and_bucket(name: str) -> tuple[Phase, int]:
    """The inverse of `program_name`."""
    stem, _, bucket = name.rpartition("_")
    return Phase(stem), int(bucket)

"""Which program runs a family, and whether a model is within that program's reach. Pure.

A family record names its program (`FamilyRecord.program`); this module maps the name to the
program's functions and checks the ModelSpec against what the program implements, listing every
feature it lacks. Adding a family that the decoder already covers touches nothing here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.families import runnable
from nxdi.core.families.record import FamilyRecord, ProgramKind
from nxdi.core.model_spec import ModelSpec, PositionKind
from nxdi.core.programs import decoder
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.weight_table import WeightTable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """A family's program: its weights table, how the weights value is built, and the forward pass."""

    record: FamilyRecord
    weights_from_slots: Callable[..., Any]
    """`weights_from_slots(slots, spec=...)`: the program's weights value from slot paths."""
    forward: Callable[..., tuple[Tensor, KVCache]]
    """`forward(weights, cache, inputs, *, spec) -> (logits, cache)`."""
    forward_outputs: Callable[..., tuple[Tensor, KVCache, Mapping[str, Tensor]]]
    """The same step also returning its extra outputs by name (what `nxdi.core.programs.step` runs)."""

    @property
    def table(self) -> WeightTable:
        assert self.record.weights is not None, "a runnable family has a weight table"
        return self.record.weights

    def weights(self, tensors: Mapping[str, Tensor], *, spec: ModelSpec) -> Any:
        """The weights value from tensors named as the weight table names them."""
        return self.weights_from_slots(self.table.slots(tensors, spec), spec=spec)


def _decoder_gaps(spec: ModelSpec) -> list[Problem]:
    """What the decoder program does not implement, one problem each."""
    rotary = spec.rotary_dim
    gaps = [
        (spec.position is PositionKind.ROPE and spec.rope is None, "rope", None, "RoPE with its parameters"),
        (spec.position is not PositionKind.ROPE and spec.rope is not None, "rope", "set", "RoPE or other positions"),
        (
            spec.position is PositionKind.ALIBI and spec.num_kv_heads != spec.num_attention_heads,
            "num_key_value_heads",
            spec.num_kv_heads,
            "ALiBi with one kv head per query head",
        ),
        (
            rotary is not None and (rotary > spec.head_dim or rotary % 2 == 1),
            "rotary_dim",
            rotary,
            f"an even rotary_dim up to head_dim={spec.head_dim}",
        ),
        (
            spec.shared_layer_norm and not spec.parallel_residual,
            "shared_layer_norm",
            True,
            "one norm for attention and MLP only with a parallel residual",
        ),
        (
            spec.parallel_residual and (spec.sandwich_norms or spec.post_layer_norm),
            "parallel_residual",
            True,
            "a parallel residual with norms before each block only",
        ),
        (spec.post_layer_norm and spec.sandwich_norms, "post_layer_norm", True, "post-norms or sandwich norms"),
        (spec.qk_norm and rotary is not None, "rotary_dim", rotary, "q/k norms with RoPE on every dim of a head"),
        (
            spec.attention_upcast and spec.position is PositionKind.ALIBI,
            "attention_upcast",
            True,
            "ALiBi in the activation dtype",
        ),
    ]
    return [
        Problem.of(field, value, f"is not supported by the decoder program (it implements {what})")
        for bad, field, value, what in gaps
        if bad
    ]


_PROGRAMS: Mapping[ProgramKind, tuple[Any, ...]] = {
    ProgramKind.DECODER: (decoder.weights_from_slots, decoder.forward, decoder.forward_outputs, _decoder_gaps),
}
"""Program kind -> (weights_from_slots, forward, forward_outputs, what it lacks for a spec)."""


def program_for(record: FamilyRecord, spec: ModelSpec) -> Result[Program, ConfigError]:
    """The program that runs `spec` (a model of family `record`).

    Returns:
        `Success(Program)`, or `Failure(ConfigError)` when the family has no program yet (naming the
        families that have one) or the spec uses features its program lacks (each one listed).
    """
    if record.program is None or record.weights is None:
        known = ", ".join(r.name for r in runnable())
        why = f"has no program on the engine yet (families that run: {known})"
        return Failure(ConfigError.of("model_type", spec.model_type, why))
    weights_from_slots, forward, forward_outputs, gaps = _PROGRAMS[record.program]
    problems = gaps(spec)
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    program = Program(
        record=record, weights_from_slots=weights_from_slots, forward=forward, forward_outputs=forward_outputs
    )
    return Success(program)

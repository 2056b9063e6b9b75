"""The programs of a fused-speculation model and which one a step runs. Pure.

A model with `enable_fused_speculation` compiles two kinds of program (`fused_keys`), each holding
the target and the draft:

- one context-encoding program per context bucket (batch `ctx_batch_size`), as any model;
- one fused program per token-generation bucket b (batch `tkg_batch_size`; the buckets follow the
  token-generation rule on max_length, as NxDI's fused speculation model). A fused step at position
  p writes p .. p+k-1 (k = speculation_length), so its program attends b + k cache slots: the key's
  `length` is b + k, and the cache holds max_length + k slots, the last k of them slack that no
  emitted token rests on (`nxdi.core.programs.fused_speculation`).

`fused_length(spec, position)` picks the program of a step whose rows sit at positions up to
`position`: the smallest bucket b > position, so b + k slots hold every write.
"""

from __future__ import annotations

from returns.result import Result

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ConfigError
from nxdi.core.planning import buckets
from nxdi.core.planning.buckets import BucketTable
from nxdi.core.planning.program_key import ProgramKey


def fused_table_for(spec: NeuronSpec) -> Result[BucketTable, ConfigError]:
    """The fused programs' buckets: the token-generation rule on max_length, batch tkg_batch_size."""
    return buckets.token_table_for(spec).map(
        lambda t: BucketTable(
            kind=Phase.FUSED_SPECULATION, lengths=t.lengths, batch_sizes=(spec.tkg_batch_size,), max_length=t.max_length
        )
    )


def cache_length(spec: NeuronSpec) -> int:
    """Slots of each cache row: max_length positions, then speculation_length slack slots."""
    return spec.max_length + spec.speculation_length


def fused_keys(spec: NeuronSpec) -> Result[tuple[ProgramKey, ...], ConfigError]:
    """Every program of the fused model, ordered: context encoding per context bucket, then one fused
    program per token-generation bucket b, of length b + speculation_length and one token per row."""
    k = spec.speculation_length

    def keys(context: BucketTable, fused: BucketTable) -> tuple[ProgramKey, ...]:
        ctx = [ProgramKey.context(n, b) for b in context.batch_sizes for n in context.lengths]
        step = [
            ProgramKey(phase=Phase.FUSED_SPECULATION, length=n + k, batch=b, tokens=1)
            for b in fused.batch_sizes
            for n in fused.lengths
        ]
        return tuple(sorted({*ctx, *step}))

    return buckets.context_table_for(spec).bind(lambda c: fused_table_for(spec).map(lambda f: keys(c, f)))


def fused_length(spec: NeuronSpec, position: int) -> Result[int, ConfigError]:
    """The length of the fused program for rows at positions up to `position` (< max_length):
    b + speculation_length for the smallest bucket b > position.

    Returns:
        The program length, or the ConfigError of a position past every bucket (field `input_length`).
    """
    return fused_table_for(spec).bind(
        lambda table: buckets.select_bucket(table, position + 1).map(lambda b: b + spec.speculation_length)
    )

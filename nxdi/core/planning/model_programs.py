"""Every program a model compiles, from its NeuronSpec alone. Pure.

The engine compiles exactly these keys and `nxdi plan` counts them, so the two cannot disagree:

- fused speculation (`enable_fused_speculation`, EAGLE included): `fused_programs.fused_keys`
  (context encoding and one fused program per token-generation bucket; no token-generation programs);
- the block KV layout: the block plan's keys (`block_programs.block_plan`);
- otherwise: one context-encoding program per context bucket, one token-generation program per
  (batch bucket, length bucket) unless `trace_tokengen_model=False` (a target that decodes only in
  speculation steps), and with `speculation_length` k one speculation program per length bucket
  scoring k tokens per row (Medusa: one tree program per tree bucket scoring
  `medusa_speculation_length` nodes).
"""

from __future__ import annotations

from returns.result import Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ConfigError
from nxdi.core.planning import block_programs, buckets, fused_programs
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.program_key import ProgramKey, program_keys


def keys_for(spec: NeuronSpec) -> Result[tuple[ProgramKey, ...], ConfigError]:
    """Every program of a model under `spec`, ordered (see the module rules).

    Returns:
        The keys, or the ConfigError of an invalid bucket table or tree.
    """
    if spec.enable_fused_speculation:
        return fused_programs.fused_keys(spec)
    return plain_keys(spec)


def _speculation_table(spec: NeuronSpec) -> Result[buckets.BucketTable | None, ConfigError]:
    """The speculation programs' table (`speculation_length` > 0; Medusa's tree steps), else None."""
    if spec.is_medusa:
        return medusa_plan.tree_table_for(spec)
    if spec.speculation_length <= 0:
        return Success(None)
    return buckets.speculation_table_for(spec)


def plain_keys(spec: NeuronSpec) -> Result[tuple[ProgramKey, ...], ConfigError]:
    """The programs of a model that is not fused (see the module rules): what one `EngineModel` compiles."""
    if spec.is_block_kv_layout:
        return block_programs.block_plan(spec).map(lambda plan: plan.keys())
    k = spec.medusa_speculation_length if spec.is_medusa else spec.speculation_length

    def keys(
        context: buckets.BucketTable, token: buckets.BucketTable, spec_table: buckets.BucketTable | None
    ) -> tuple[ProgramKey, ...]:
        found = program_keys(context, token)
        if not spec.trace_tokengen_model:
            found = tuple(key for key in found if key.phase is not Phase.TOKEN)
        if spec_table is None:
            return found
        more = [ProgramKey.speculation(n, b, k) for b in spec_table.batch_sizes for n in spec_table.lengths]
        return tuple(sorted({*found, *more}))

    return buckets.context_table_for(spec).bind(
        lambda c: buckets.token_table_for(spec).bind(lambda t: _speculation_table(spec).map(lambda s: keys(c, t, s)))
    )

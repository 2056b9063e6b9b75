"""Which block-KV programs a model compiles, and which one a call runs. Pure.

A block program (`nxdi.core.programs.block_kv`) computes S new tokens per row over a cached prefix
of P positions per segment, so its key is `ProgramKey(phase, length=S + P, batch, tokens=S)`.
The tables come from the bucket planners (`buckets`, `block_buckets`):

- plain block layout: context encoding `(S, 0)` for every context bucket (a prompt is computed
  whole), token generation `(1, T - 1)` for every token bucket T (positions 0..T-1 with the new one);
- prefix caching: the 2-D `(prefill, prefix)` context table and `(1, p)` token table;
- chunked prefill: one program kind for every call, `(chunk, P)` for every chunk bucket and every
  prefix length P of the token buckets (one row of `max_num_seqs` segments, each attending its own
  prefix; nxdi's second axis is the longest cached prefix, where the reference's kernel counts the
  KV tiles of all prefixes together).

A call's bucket is the smallest that fits its longest new part and longest prefix. Cached tokens
beyond the chosen prefix bucket are recomputed among the new tokens (the reference's rule), so the
prefix a row keeps is `min(computed, P)`.
"""

from __future__ import annotations

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.planning import block_buckets, buckets
from nxdi.core.planning.program_key import ProgramKey


@attrs.frozen(kw_only=True)
class BlockPlan:
    """A block-KV model's programs and how a call picks one."""

    context: tuple[tuple[int, int], ...]
    """`(tokens, prefix)` of the context programs (chunked prefill: of every program)."""
    token: tuple[int, ...]
    """Token-generation buckets T (one new token over T - 1 cached positions); empty in chunked prefill."""
    context_batch: int
    token_batch: int
    block_size: int
    segments: int
    """Segments per row: `max_num_seqs` in chunked prefill, else 1."""
    chunked: bool
    prefix_context: block_buckets.PrefixTable | None = None
    prefix_token: block_buckets.PrefixTable | None = None
    allow_input_truncation: bool = False

    def keys(self) -> tuple[ProgramKey, ...]:
        ctx = [
            ProgramKey(phase=Phase.CONTEXT, length=s + p, batch=self.context_batch, tokens=s) for s, p in self.context
        ]
        tkg = [ProgramKey.token(t, self.token_batch) for t in self.token]
        return tuple(sorted({*ctx, *tkg}))

    def blocks(self, key: ProgramKey) -> int:
        """NB: blocks per segment a program's prefix spans."""
        return -(-(key.length - key.tokens) // self.block_size)

    def select(self, phase: Phase, new: int, computed: int) -> Result[ProgramKey, ConfigError]:
        """The program for a call whose rows have at most `new` new tokens (chunked prefill: in all)
        and at most `computed` cached ones.

        Returns:
            The key, or a ConfigError naming what no compiled bucket holds.
        """
        if self.chunked:
            fits = [(s, p) for s, p in self.context if new <= s and computed <= p]
            if not fits:
                largest = max(self.context)
                why = f"{new} new tokens over a prefix of {computed} fit no chunked-prefill bucket (largest {largest})"
                return Failure(ConfigError.of("input_ids", new, why, "send fewer tokens per call"))
            s, p = min(fits)
            return Success(ProgramKey(phase=Phase.CONTEXT, length=s + p, batch=1, tokens=s))
        if phase is Phase.CONTEXT:
            if self.prefix_context is not None:
                picked = block_buckets.select_prefix_bucket(
                    self.prefix_context, new, computed, allow_input_truncation=self.allow_input_truncation
                )
                return picked.map(lambda sp: self._context(*sp))
            fits_ctx = [s for s, _ in self.context if new + computed <= s]
            if not fits_ctx:
                why = f"the prompt ({new + computed} tokens) exceeds the largest context bucket {self.context[-1][0]}"
                return Failure(ConfigError.of("input_ids", new + computed, why, "raise max_context_length"))
            return Success(self._context(min(fits_ctx), 0))
        if self.prefix_token is not None:
            picked = block_buckets.select_prefix_bucket(self.prefix_token, 1, computed)
            return picked.map(lambda ap: ProgramKey.token(ap[1], self.token_batch))
        fits_tkg = [t for t in self.token if computed + 1 <= t]
        if not fits_tkg:
            why = f"position {computed} is past the largest token bucket {self.token[-1]}"
            return Failure(ConfigError.of("position_ids", computed, why))
        return Success(ProgramKey.token(min(fits_tkg), self.token_batch))

    def _context(self, tokens: int, prefix: int) -> ProgramKey:
        return ProgramKey(phase=Phase.CONTEXT, length=tokens + prefix, batch=self.context_batch, tokens=tokens)


def block_plan(spec: NeuronSpec) -> Result[BlockPlan, ConfigError]:
    """The block programs of `spec` (which has `is_block_kv_layout`).

    Returns:
        The plan, or the bucket planners' ConfigError; also a Failure for chunked prefill without
        `max_num_seqs`.
    """
    context_table = buckets.context_table_for(spec)
    token_table = buckets.token_table_for(spec)
    tables = block_buckets.block_tables_for(spec)
    match context_table, token_table, tables:
        case Success(ctx), Success(tkg), Success(block):
            pass
        case _:
            problems: list[Problem] = []
            for r in (context_table, token_table, tables):
                if isinstance(r, Failure):
                    problems.extend(r.failure().problems)
            return Failure(ConfigError(problems=tuple(problems)))
    plain = BlockPlan(
        context=tuple((s, 0) for s in ctx.lengths),
        token=tkg.lengths,
        context_batch=spec.ctx_batch_size,
        token_batch=spec.tkg_batch_size,
        block_size=spec.pa_block_size,
        segments=1,
        chunked=False,
        allow_input_truncation=spec.allow_input_truncation,
    )
    if block is not None and block.chunked_prefill is not None:
        cp = spec.chunked_prefill_config
        assert cp is not None, "a chunked-prefill table comes from a chunked_prefill_config"
        if cp.max_num_seqs < 1:
            why = "must be >= 1 with the block KV engine: the most requests one chunked-prefill call holds"
            return Failure(ConfigError.of("chunked_prefill_config.max_num_seqs", cp.max_num_seqs, why))
        context = tuple((s, p) for s in block.chunked_prefill.chunks for p in tkg.lengths)
        return Success(attrs.evolve(plain, context=context, token=(), segments=cp.max_num_seqs, chunked=True))
    if block is not None and block.prefix_context is not None and block.prefix_token is not None:
        return Success(
            attrs.evolve(
                plain,
                context=block.prefix_context.buckets(),
                token=tuple(p for _, p in block.prefix_token.buckets()),
                prefix_context=block.prefix_context,
                prefix_token=block.prefix_token,
            )
        )
    return Success(plain)

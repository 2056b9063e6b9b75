"""Program keys: which compiled program a step runs, as one value. Pure.

A compiled program has static shapes, so it is identified by its sub-model and its shapes:

    ProgramKey(phase, length, batch, tokens)

- `length` (T): the cache positions the step attends, the bucket. In context encoding it is also
  the prompt width; in token generation the cache view.
- `batch` (B): rows of the program.
- `tokens` (S): tokens per row: the context bucket in context encoding (== length), 1 in token
  generation. A program that encodes new tokens over a cached prefix (block KV, prefix caching)
  has tokens < length, so keys of equal length and batch still differ.

Keys are ordered (phase in `Phase` declaration order, then length, batch, tokens), hashable and
frozen: the runtime's programs, the manifest's records and compile requests are keyed by them.

Names. Each program of a model has a readable name, unique within the model, used as its file stem
and in messages (`program_names`): `context_encoding_128`, `token_generation_256` for the
programs of a phase's default shape, with suffixes only where a key differs from it:

- `_t{tokens}` when tokens is not the phase's default (length in context encoding, else 1);
- `_b{batch}` when the model compiles several batch sizes for the phase (`token_generation_batches`)
  and this is not the largest one (the phase's compiled batch, as before batch buckets existed).

So a model without batch buckets keeps the names (and compile-cache keys) it had before keys
existed, and adding batch buckets leaves the full-batch programs' names unchanged. A name is
relative to the model's set of keys: the batch a phase compiles by default is not part of a key.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.planning.buckets import BucketTable

_PHASES = tuple(Phase)


def _phase_rank(phase: Phase) -> int:
    return _PHASES.index(phase)


@attrs.frozen(kw_only=True, order=True)
class ProgramKey:
    """One compiled program: its sub-model and its static shapes."""

    phase: Phase = attrs.field(validator=attrs.validators.instance_of(Phase), order=_phase_rank)
    length: int = attrs.field(validator=attrs.validators.gt(0))
    """T: cache positions the step attends (the bucket)."""
    batch: int = attrs.field(validator=attrs.validators.gt(0))
    """B: rows of the program."""
    tokens: int = attrs.field(validator=attrs.validators.gt(0))
    """S: tokens per row (the context bucket in context encoding, 1 in token generation)."""

    @classmethod
    def context(cls, length: int, batch: int) -> ProgramKey:
        """The context-encoding program of a `length`-token prompt bucket."""
        return cls(phase=Phase.CONTEXT, length=length, batch=batch, tokens=length)

    @classmethod
    def token(cls, length: int, batch: int) -> ProgramKey:
        """The token-generation program attending `length` cache positions, one new token per row."""
        return cls(phase=Phase.TOKEN, length=length, batch=batch, tokens=1)

    @classmethod
    def speculation(cls, length: int, batch: int, tokens: int) -> ProgramKey:
        """The speculation program attending `length` cache positions, scoring `tokens` per row
        (speculation_length: the last accepted token and the draft's proposals after it)."""
        return cls(phase=Phase.SPECULATION, length=length, batch=batch, tokens=tokens)

    @property
    def default_tokens(self) -> bool:
        """Whether `tokens` is the phase's usual count (the whole bucket in context encoding, the
        speculation length in speculation, one per model, else 1)."""
        return self.phase is Phase.SPECULATION or self.tokens == (self.length if self.phase is Phase.CONTEXT else 1)

    def name(self, *, default_batch: int | None = None) -> str:
        """`token_generation_256`, `token_generation_256_b2`, `context_encoding_256_t128`, ...: the
        phase and length, `_t{tokens}` unless `default_tokens`, `_b{batch}` unless `batch` is
        `default_batch` (None: no batch suffix). See `program_names` for a model's names."""
        out = f"{self.phase.value}_{self.length}"
        if not self.default_tokens:
            out += f"_t{self.tokens}"
        if default_batch is not None and self.batch != default_batch:
            out += f"_b{self.batch}"
        return out

    def describe(self) -> str:
        """For messages: `token_generation program (256 positions, batch 2, 1 token per row)`."""
        per_row = "1 token" if self.tokens == 1 else f"{self.tokens} tokens"
        return f"{self.phase.value} program ({self.length} positions, batch {self.batch}, {per_row} per row)"


def program_names(keys: Iterable[ProgramKey]) -> dict[ProgramKey, str]:
    """The name of every key of one model (see the module docstring): the largest batch of each
    phase is its default. Names are unique for distinct keys."""
    ordered = sorted(set(keys))
    largest: dict[Phase, int] = {}
    for k in ordered:
        largest[k.phase] = max(largest.get(k.phase, 0), k.batch)
    return {k: k.name(default_batch=largest[k.phase]) for k in ordered}


def program_keys(context: BucketTable, token: BucketTable) -> tuple[ProgramKey, ...]:
    """Every program a model compiles, ordered: one context-encoding program per context bucket
    (batch: the table's one batch size), one token-generation program per (batch size, length)
    pair of the token table (`BucketTable.buckets_2d`; one batch size without batch buckets)."""
    ctx = [ProgramKey.context(length, batch) for batch in context.batch_sizes for length in context.lengths]
    tkg = [ProgramKey.token(length, batch) for batch, length in token.buckets_2d()]
    return tuple(sorted({*ctx, *tkg}))

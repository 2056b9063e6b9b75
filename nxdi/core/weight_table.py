"""Weight tables: a family's checkpoint layout, declared once as data. Pure.

A family declares, for every weight its program takes, the *slot* it fills in the program's
weights value (`attn.qkv`), its nxdi name (`self_attn.Wqkv.weight`, the program layout), the
checkpoint tensors it is made from with their shapes in dimension letters, and the ModelSpec flag
it exists under. The table is the single source of the checkpoint mapping (`nxdi.core.weight_plan`
turns it into a plan of steps) and of the program's fields (`WeightTable.slots`).

A weight's sources are copied (one), concatenated along dim 0 (fused QKV: `Wqkv = [Q; K; V]`),
stacked along a new dim 0 (one source per expert, `experts.{x}.w1` for every expert x: [X, F, E]),
or split (one source holding every expert's rows one above the other, DBRX's `w1` [X*F, E]).

Dimension letters: E hidden (2E: twice that), F ffn, V vocab, P learned positions (offset rows
included), D head dim, Q = H*D (query heads times head dim), KV = K*D (kv heads times head dim),
QKV = Q + 2*KV (a fused projection), X experts, XF = X*F (every expert's rows), 1 a dimension of
size one (a scale).

A source may be stored in another layout than the program's weight: transposed (GPT-2's Conv1D,
`Source.transposed`) or with its rows in another order (`RowOrder`: a fused QKV stored head by
head, GPT-J's rotary pairs); the weight plan reads it through a Transpose or a Take.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping

import attrs

from nxdi.core.model_spec import ModelSpec

Shape = tuple[int, ...]

STATE_DICT_MODEL_PREFIX = "model."
"""NxDI's `_STATE_DICT_MODEL_PREFIX`: stripped from the start of checkpoint keys."""
NEW_STATE_DICT_MODEL_PREFIX = ""
"""NxDI's `_NEW_STATE_DICT_MODEL_PREFIX`: what replaces the stripped prefix."""
SCALE_SUFFIX = ".scale"
"""A quantized linear's scale sits at `<slot>.scale` in a program's slots."""


def scale_name(name: str) -> str:
    """The scale of a quantized weight: `a.b.weight` -> `a.b.scale` (NxD's key layout)."""
    return name.removesuffix("weight") + "scale"


_EXPERTS = ".mlp.experts."
_TKG_EXPERTS = ".mlp.experts_tkg."


def tkg_twin(name: str) -> str | None:
    """The name of an experts weight's token-generation copy, which a rank holds beside it when
    hybrid sharding lays the experts out differently for token generation (NxD's `mlp_op_tkg`):
    `layers.0.mlp.experts.up_proj.weight` -> `layers.0.mlp.experts_tkg.up_proj.weight`; None for a
    weight that is not an expert's."""
    return name.replace(_EXPERTS, _TKG_EXPERTS) if _EXPERTS in name else None


TKG_MLP_SLOT = "mlp_tkg"
"""Where a layer's token-generation experts sit in the slot paths (`layers.{i}.mlp_tkg.up`)."""


def dims(spec: ModelSpec) -> Mapping[str, int]:
    """The sizes the dimension letters of a table stand for."""
    return {
        "E": spec.hidden_size,
        "2E": 2 * spec.hidden_size,  # an EAGLE draft's fc input: [embedding; target hidden state]
        "F": spec.intermediate_size,
        "V": spec.vocab_size,
        "P": spec.max_position_embeddings + spec.position_offset,  # a learned position table's rows
        "D": spec.head_dim,
        "Q": spec.q_size,
        "KV": spec.kv_size,
        "QKV": spec.q_size + 2 * spec.kv_size,
        "X": spec.num_experts,
        "XF": spec.num_experts * spec.intermediate_size,
        "1": 1,
    }


class ExpertRows(enum.Enum):
    """How one [X*F, E] checkpoint tensor holds every expert (DBRX): expert x owns rows x*F .. x*F+F-1."""

    AS_IS = "as_is"
    """Each expert's [F, E] block is the program's weight: split into [X, F, E] (DBRX `w1`, `v1`)."""
    TRANSPOSED = "transposed"
    """Each expert's [F, E] block is the program's [E, F] weight transposed: split into [X, E, F] (DBRX `w2`)."""

    def split_shape(self, shape: Shape, experts: int) -> Shape:
        """The split shape of a [rows, E] tensor holding `experts` blocks of rows / experts rows."""
        rows, e = shape
        f = rows // experts
        return (experts, f, e) if self is ExpertRows.AS_IS else (experts, e, f)


class RowOrder(enum.Enum):
    """How a checkpoint tensor orders the rows (dim 0) of the program's weight, when not alike."""

    PER_HEAD_QKV = "per_head_qkv"
    """A fused QKV stored head by head, `[H, 3, D]` (GPT-NeoX, BLOOM): the program's `[Q; K; V]`
    row (part p, head h, dim d) is stored row `(h * 3 + p) * D + d`. Needs as many kv heads as heads."""
    ROTARY_PAIRS = "rotary_pairs"
    """A q or k projection whose RoPE rotates neighbouring dims (GPT-J's `rotate_every_two`): within
    each head, the first `rotary_dims` rows are put evens first, then odds, which turns its rotation
    into the program's rotate-half one; q.k is unchanged, as q and k are permuted alike."""

    def indices(self, spec: ModelSpec, rows: int) -> tuple[int, ...]:
        """The stored row of every program row of a source of `rows` rows, in program order."""
        d = spec.head_dim
        if self is RowOrder.PER_HEAD_QKV:
            h = rows // (3 * d)
            return tuple((head * 3 + p) * d + i for p in range(3) for head in range(h) for i in range(d))
        r = spec.rotary_dims
        within = (*range(0, r, 2), *range(1, r, 2), *range(r, d))
        return tuple(head * d + i for head in range(rows // d) for i in within)


@attrs.frozen(kw_only=True)
class Source:
    """One checkpoint tensor a weight is made from."""

    name: str
    """Its renamed checkpoint key (relative to the layer prefix for layer weights)."""
    shape: tuple[str, ...]
    """Its shape in dimension letters, e.g. `("Q", "E")`, as stored."""
    rows: RowOrder | None = None
    """How it orders the program's rows, when not as the program does (None: alike)."""
    transposed: bool = False
    """Stored `[in, out]` (GPT-2's Conv1D), the program's `[out, in]` transposed; 2-D only."""


@attrs.frozen(kw_only=True)
class Weight:
    """One weight a program takes: where it goes and what it is made of."""

    slot: str
    """The field path in the program's weights value, e.g. `attn.qkv` or `embed`."""
    name: str
    """The nxdi name (program layout), relative to the layer prefix for layer weights."""
    sources: tuple[Source, ...]
    """One source (copied) or several (concatenated along dim 0)."""
    when: str | None = None
    """The ModelSpec flag it exists under (`qkv_bias`, ...); None: always."""
    linear: bool = False
    """A linear layer's [out, in] weight: what `quantized=True` stores as int8/fp8 values plus scales."""
    experts: bool = False
    """One source per expert: its one source's name has an `{x}` field, filled with every expert
    index 0..X-1, and the X tensors are stacked along a new dim 0."""
    expert_rows: ExpertRows | None = None
    """One [X*F, E] source holding every expert's rows, split into [X, ...] (None: not an experts weight)."""

    def exists(self, spec: ModelSpec) -> bool:
        return self.when is None or bool(getattr(spec, self.when))

    def source_names(self, spec: ModelSpec, prefix: str = "") -> tuple[str, ...]:
        """The checkpoint names of its sources (every expert's, for an experts weight)."""
        if self.experts:
            return tuple(prefix + self.sources[0].name.format(x=x) for x in range(spec.num_experts))
        return tuple(prefix + s.name for s in self.sources)

    def source_shapes(self, spec: ModelSpec) -> tuple[Shape, ...]:
        """The sources' shapes in sizes, as stored (one per expert for an experts weight)."""
        sizes = dims(spec)
        shapes = tuple(tuple(sizes[d] for d in s.shape) for s in self.sources)
        return shapes * spec.num_experts if self.experts else shapes

    @property
    def transposed(self) -> bool:
        """Its (one) source is stored transposed (`Source.transposed`)."""
        return any(s.transposed for s in self.sources)

    def shape(self, spec: ModelSpec) -> Shape:
        """The produced shape: the source's, the sources' concatenated along dim 0, stacked, or split."""
        shapes = self.source_shapes(spec)
        if self.transposed:  # one source (the weight plan refuses more)
            shapes = tuple(s[::-1] for s in shapes)
        if self.experts:
            return (len(shapes), *shapes[0])
        if self.expert_rows is not None:
            return self.expert_rows.split_shape(shapes[0], spec.num_experts)
        return (sum(s[0] for s in shapes), *shapes[0][1:])


def copy(
    slot: str,
    name: str,
    shape: tuple[str, ...],
    *,
    source: str | None = None,
    when: str | None = None,
    linear: bool = False,
    rows: RowOrder | None = None,
    transposed: bool = False,
) -> Weight:
    """A weight copied from one checkpoint tensor: `source`, or the tensor of the same name; `shape`
    is the stored one (`transposed`: the program's reversed), `rows` its row order if not the program's."""
    parts = (Source(name=name if source is None else source, shape=shape, rows=rows, transposed=transposed),)
    return Weight(slot=slot, name=name, sources=parts, when=when, linear=linear)


def stacked(slot: str, name: str, source: str, shape: tuple[str, ...]) -> Weight:
    """An experts weight: `source` (with an `{x}` field) of every expert, stacked into [X, *shape]."""
    return Weight(slot=slot, name=name, sources=(Source(name=source, shape=shape),), experts=True)


def split(slot: str, name: str, source: str, rows: ExpertRows) -> Weight:
    """An experts weight stored as one [X*F, E] tensor `source`, split per `rows` into [X, F, E] or [X, E, F]."""
    return Weight(slot=slot, name=name, sources=(Source(name=source, shape=("XF", "E")),), expert_rows=rows)


def fused(
    slot: str, name: str, *sources: tuple[str, tuple[str, ...]], when: str | None = None, linear: bool = False
) -> Weight:
    """A weight concatenated along dim 0 from several checkpoint tensors, given as (name, shape)."""
    parts = tuple(Source(name=n, shape=s) for n, s in sources)
    return Weight(slot=slot, name=name, sources=parts, when=when, linear=linear)


@attrs.frozen(kw_only=True)
class Entry:
    """One weight of a model, placed: its full nxdi name, slot path and checkpoint-key prefix."""

    name: str
    """The nxdi name with its layer prefix, e.g. `layers.0.self_attn.Wqkv.weight`."""
    slot: str
    """The slot path, e.g. `layers.0.attn.qkv`."""
    source_prefix: str
    """What goes before its sources' (renamed) checkpoint keys: `""`, or the checkpoint's layer prefix."""
    weight: Weight


Layout = tuple[tuple[str, str], ...]
"""(stored key prefix, the prefix the model's own checkpoints give those keys) pairs."""


@attrs.frozen(kw_only=True)
class Wrapper:
    """A checkpoint that holds the table's model inside a larger model: Gemma 3's multimodal
    checkpoints keep its language model beside a vision tower and a projector.

    Its language model's keys are mapped to the keys the model's own checkpoints have (legacy
    `language_model.model.x` -> `model.x`) before the usual renaming, so the table reads both; the
    prefixes in `skipped` (the vision tower, the projector) are passed over, and every other key is
    checked as in any checkpoint (unexpected unless the plan reads it).
    """

    model_type: str
    """The Hugging Face `model_type` of the wrapping config (`gemma3`): a ModelSpec of that
    model_type is read through this wrapper."""
    layouts: tuple[Layout, ...]
    """The layouts the language model's keys may have, each a set of prefix pairs; the first is
    the one missing keys are named in when the checkpoint shows none of them."""
    skipped: tuple[str, ...]
    """Prefixes of stored keys that belong to the other parts of the wrapping model, not read."""

    def skips(self, key: str) -> bool:
        """True for a stored key of the wrapping model's other parts (`vision_tower.`...)."""
        return key.startswith(self.skipped)

    def unwrap(self, key: str) -> str:
        """Stored key `key` as the model's own checkpoints store it (unchanged when no prefix of the
        layouts matches it): `language_model.model.layers.0.x` -> `model.layers.0.x`."""
        for outer, inner in (pair for layout in self.layouts for pair in layout):
            if key.startswith(outer):
                return inner + key[len(outer) :]
        return key

    def wrap(self, key: str, stored: Iterable[str] = ()) -> str:
        """The stored form of `key` (a key of the model's own checkpoints) in the layout whose prefixes
        the `stored` keys show, else the first layout: what a missing key is named."""
        stored = tuple(stored)
        used = [lo for lo in self.layouts if any(k.startswith(o) for k in stored for o, _ in lo)]
        for outer, inner in (used or list(self.layouts))[0]:
            if key.startswith(inner):
                return outer + key[len(inner) :]
        return key


@attrs.frozen(kw_only=True)
class WeightTable:
    """A family's checkpoint layout, in binding order: weights before the layers, each layer's, and after."""

    before: tuple[Weight, ...]
    """Weights the layers read from (the embedding)."""
    layer: tuple[Weight, ...]
    """Weights of each layer, named under `layer_prefix`."""
    after: tuple[Weight, ...]
    """Weights applied after the layers (final norm, lm_head)."""
    tied: tuple[str, str] = ("lm_head", "embed")
    """(slot, slot it aliases) when the ModelSpec ties its word embeddings."""
    layer_prefix: str = "layers.{i}."
    """The layer prefix of nxdi names (the program layout: the sharding plan's names)."""
    source_layer_prefix: str | None = None
    """The checkpoint's layer prefix after renaming, when it differs from `layer_prefix` (DBRX: `blocks.{i}.`)."""
    model_prefix: str = STATE_DICT_MODEL_PREFIX
    """The base model's key prefix in the family's Hugging Face checkpoints (DBRX: `transformer.`):
    the default `_STATE_DICT_MODEL_PREFIX` of its causal LM class."""
    unprefixed: tuple[str, ...] = ("lm_head.",)
    """nxdi names Hugging Face stores outside the base model, so without the model prefix."""
    wrappers: tuple[Wrapper, ...] = ()
    """Checkpoints of larger models that hold this one (Gemma 3's multimodal ones), by model_type."""

    def wrapper_for(self, model_type: str) -> Wrapper | None:
        """The wrapper a ModelSpec of `model_type` reads its checkpoint through (None: the model's own layout)."""
        return next((w for w in self.wrappers if w.model_type == model_type), None)

    def placed(self, spec: ModelSpec) -> Iterator[Entry]:
        """Every weight `spec` has, in binding order, with its full name, slot path and source prefix.

        Layer weights get the layer prefix in their name and `layers.{i}.` in their slot path.
        """
        yield from (Entry(name=w.name, slot=w.slot, source_prefix="", weight=w) for w in self.before if w.exists(spec))
        for i in range(spec.num_layers):
            prefix = self.layer_prefix.format(i=i)
            source = prefix if self.source_layer_prefix is None else self.source_layer_prefix.format(i=i)
            for w in self.layer:
                if w.exists(spec):
                    yield Entry(name=prefix + w.name, slot=f"layers.{i}.{w.slot}", source_prefix=source, weight=w)
        yield from (Entry(name=w.name, slot=w.slot, source_prefix="", weight=w) for w in self.after if w.exists(spec))

    def entries(self, spec: ModelSpec) -> Iterator[tuple[str, str, Weight]]:
        """(nxdi name, slot path, weight) of every weight `spec` has, in binding order."""
        return ((e.name, e.slot, e.weight) for e in self.placed(spec))

    def shapes(self, spec: ModelSpec) -> tuple[tuple[str, Shape], ...]:
        """Names and shapes of the weights the program takes, in binding order."""
        return tuple((name, w.shape(spec)) for name, _, w in self.entries(spec))

    def names(self, spec: ModelSpec) -> tuple[str, ...]:
        """The names of `shapes`, in binding order."""
        return tuple(name for name, _, _ in self.entries(spec))

    def linear_sources(self, spec: ModelSpec) -> dict[str, Source]:
        """Renamed checkpoint key -> source, for every source of a linear weight (what a quantized
        checkpoint stores as values plus a scale), in binding order."""
        return {e.source_prefix + s.name: s for e in self.placed(spec) if e.weight.linear for s in e.weight.sources}

    def tied_sources(self, spec: ModelSpec) -> tuple[str, str] | None:
        """(renamed key of the tied weight's source, renamed key of the source it aliases) when `spec`
        ties its word embeddings (`("lm_head.weight", "embed_tokens.weight")` for Llama), else None."""
        if not spec.tie_word_embeddings:
            return None
        by_slot = {e.slot: e for e in self.placed(spec)}
        slot, target = self.tied
        if slot not in by_slot or target not in by_slot:
            return None
        keys = [by_slot[s].weight.source_names(spec, by_slot[s].source_prefix)[0] for s in (slot, target)]
        return keys[0], keys[1]

    def slots(self, tensors: Mapping[str, object], spec: ModelSpec) -> dict[str, object]:
        """Slot path -> value for the named values given (a tied slot missing from `tensors` is aliased).
        A quantized linear's scale (`scale_name(name)`) goes to `<slot>.scale`."""
        out = {slot: tensors[name] for name, slot, _ in self.entries(spec) if name in tensors}
        out |= {  # hybrid sharding: the token-generation experts beside the layer's own
            slot.replace(".mlp.", f".{TKG_MLP_SLOT}.", 1): tensors[twin]
            for name, slot, _ in self.entries(spec)
            if (twin := tkg_twin(name)) is not None and twin in tensors
        }
        out |= {
            slot + SCALE_SUFFIX: tensors[scale_name(n)] for n, slot, _ in self.entries(spec) if scale_name(n) in tensors
        }
        slot, target = self.tied
        if spec.tie_word_embeddings and slot not in out and target in out:
            out[slot] = out[target]
        return out

"""Weight tables and weight plans: how a Hugging Face checkpoint becomes a program's weights. Pure.

Theory of operation:
1. Table. A family declares its checkpoint layout once, as a `WeightTable` in its record: for every
   weight its program takes, the *slot* it fills in the program's weights value (`attn.qkv`), its
   nxdi name (`self_attn.Wqkv.weight`, the program layout), the checkpoint tensors it is made from
   with their shapes in dimension letters, and the ModelSpec flag it exists under. The table is the
   single source of the checkpoint mapping (this module) and of the program's fields
   (`WeightTable.slots`).
2. Rename. Every checkpoint key is renamed once: a leading model prefix (`"model."`) becomes the new
   prefix (`""`), and a trailing `.weight_scale` becomes `.scale`.
3. Steps. Each weight comes from one `WeightStep`: its sources are copied (one source), concatenated
   along dim 0 (fused QKV: `Wqkv = [Q; K; V]`), stacked along a new dim 0 (a mixture of experts'
   per-expert tensors, `experts.{x}.w1` for every expert x: [X, F, E]), or aliased to an earlier step (tied embeddings: the
   lm_head *is* the embedding, stored once), then passed through the step's transforms (a float cast
   today; GQA head padding and tensor-parallel slices join `Transform`).
4. Check. `check_checkpoint` compares a checkpoint's keys and shapes with the plan and reports every
   missing, unexpected, colliding and wrongly shaped key at once.

Dimension letters in tables: E hidden, F ffn, V vocab, D head dim, Q = H*D (query heads times
head dim), KV = K*D (kv heads times head dim), X experts, 1 a dimension of size one (a scale).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import CheckpointError, ConfigError, Problem
from nxdi.core.model_spec import ModelSpec

Shape = tuple[int, ...]

STATE_DICT_MODEL_PREFIX = "model."
"""NxDI's `_STATE_DICT_MODEL_PREFIX`: stripped from the start of checkpoint keys."""
NEW_STATE_DICT_MODEL_PREFIX = ""
"""NxDI's `_NEW_STATE_DICT_MODEL_PREFIX`: what replaces the stripped prefix."""
IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
"""Checkpoint keys ending so are derived buffers some old checkpoints carry; they are skipped."""
CAST_TYPES = ("config", "as-declared")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
SCALE_SUFFIX = ".scale"
"""A quantized linear's scale sits at `<slot>.scale` in a program's slots."""
QUANT_TYPES = ("per_tensor_symmetric", "per_channel_symmetric", "blockwise_symmetric")


def scale_name(name: str) -> str:
    """The scale of a quantized weight: `a.b.weight` -> `a.b.scale` (NxD's key layout)."""
    return name.removesuffix("weight") + "scale"


def module_of(name: str) -> str:
    """`layers.0.mlp.up_proj.weight` -> `layers.0.mlp.up_proj`: what `modules_to_not_convert` matches."""
    return name.removesuffix(".weight")


def kept_in_float(name: str, modules_to_not_convert: Iterable[str] | None) -> bool:
    """True when an entry of `modules_to_not_convert` is a substring of the module path of weight
    key `name` (the reference's matching: "layers.1" also matches "layers.10...")."""
    return any(pattern in module_of(name) for pattern in modules_to_not_convert or ())


@attrs.frozen(kw_only=True)
class WeightQuant:
    """How a quantized checkpoint stores its linear weights (`NeuronConfig(quantized=True, ...)`)."""

    type: str = attrs.field(default="per_tensor_symmetric", validator=attrs.validators.in_(QUANT_TYPES))
    """`quantization_type`."""
    dtype: str = "int8"
    """`quantization_dtype` of the stored values."""
    block_axis: tuple[int, ...] = ()
    block_size: tuple[int, ...] = ()
    """Blockwise only: block length along each of `block_axis`."""
    skip: tuple[str, ...] = ()
    """`modules_to_not_convert`: substrings of module paths kept in float."""
    scale_dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(FLOAT_DTYPES))
    """What the program holds scales in (`quantization_scale_dtype`), whatever the checkpoint stores."""

    def excludes(self, name: str) -> bool:
        """True when `modules_to_not_convert` keeps the linear `name` (a `.weight` key) in float."""
        return kept_in_float(name, self.skip)

    def block(self) -> tuple[int, int]:
        """(rows, columns) per scale block of a [out, in] weight; 1 for an axis not blocked."""
        sizes = [1, 1]
        for axis, size in zip(self.block_axis, self.block_size, strict=True):
            sizes[axis % 2] = size
        return sizes[0], sizes[1]

    def scale_shape(self, shape: Shape, name: str) -> Result[Shape, Problem]:
        """The stored scale shape of a [out, in] weight: [1], [out, 1] or the block grid."""
        if self.type == "per_tensor_symmetric":
            return Success((1,))
        if self.type == "per_channel_symmetric":
            return Success((shape[0], 1))
        rows, cols = self.block()
        if shape[0] % rows or shape[1] % cols:
            why = f"has shape {shape}, which blocks of {rows} x {cols} do not tile"
            return Failure(Problem.of(name, shape, why, "choose a quantization_block_size that divides it"))
        return Success((shape[0] // rows, shape[1] // cols))


def dims(spec: ModelSpec) -> Mapping[str, int]:
    """The sizes the dimension letters of a table stand for."""
    return {
        "E": spec.hidden_size,
        "F": spec.intermediate_size,
        "V": spec.vocab_size,
        "D": spec.head_dim,
        "Q": spec.q_size,
        "KV": spec.kv_size,
        "X": spec.num_experts,
        "1": 1,
    }


@attrs.frozen(kw_only=True)
class Source:
    """One checkpoint tensor a weight is made from."""

    name: str
    """Its renamed checkpoint key (relative to the layer prefix for layer weights)."""
    shape: tuple[str, ...]
    """Its shape in dimension letters, e.g. `("Q", "E")`."""


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

    def exists(self, spec: ModelSpec) -> bool:
        return self.when is None or bool(getattr(spec, self.when))

    def source_names(self, spec: ModelSpec, prefix: str = "") -> tuple[str, ...]:
        """The checkpoint names of its sources (every expert's, for an experts weight)."""
        if self.experts:
            return tuple(prefix + self.sources[0].name.format(x=x) for x in range(spec.num_experts))
        return tuple(prefix + s.name for s in self.sources)

    def source_shapes(self, spec: ModelSpec) -> tuple[Shape, ...]:
        """The sources' shapes in sizes (one per expert for an experts weight)."""
        sizes = dims(spec)
        shapes = tuple(tuple(sizes[d] for d in s.shape) for s in self.sources)
        return shapes * spec.num_experts if self.experts else shapes

    def shape(self, spec: ModelSpec) -> Shape:
        """The produced shape: the source's, the sources' concatenated along dim 0, or stacked."""
        shapes = self.source_shapes(spec)
        if self.experts:
            return (len(shapes), *shapes[0])
        return (sum(s[0] for s in shapes), *shapes[0][1:])


def copy(slot: str, name: str, shape: tuple[str, ...], *, when: str | None = None, linear: bool = False) -> Weight:
    """A weight copied from the checkpoint tensor of the same name."""
    return Weight(slot=slot, name=name, sources=(Source(name=name, shape=shape),), when=when, linear=linear)


def stacked(slot: str, name: str, source: str, shape: tuple[str, ...]) -> Weight:
    """An experts weight: `source` (with an `{x}` field) of every expert, stacked into [X, *shape]."""
    return Weight(slot=slot, name=name, sources=(Source(name=source, shape=shape),), experts=True)


def fused(
    slot: str, name: str, *sources: tuple[str, tuple[str, ...]], when: str | None = None, linear: bool = False
) -> Weight:
    """A weight concatenated along dim 0 from several checkpoint tensors, given as (name, shape)."""
    parts = tuple(Source(name=n, shape=s) for n, s in sources)
    return Weight(slot=slot, name=name, sources=parts, when=when, linear=linear)


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
    unprefixed: tuple[str, ...] = ("lm_head.",)
    """nxdi names Hugging Face stores outside the base model, so without the model prefix."""

    def entries(self, spec: ModelSpec) -> Iterator[tuple[str, str, Weight]]:
        """(nxdi name, slot path, weight) of every weight `spec` has, in binding order.

        Layer weights get the layer prefix in their name and `layers.{i}.` in their slot path.
        """
        yield from ((w.name, w.slot, w) for w in self.before if w.exists(spec))
        for i in range(spec.num_layers):
            prefix = self.layer_prefix.format(i=i)
            yield from ((prefix + w.name, f"layers.{i}.{w.slot}", w) for w in self.layer if w.exists(spec))
        yield from ((w.name, w.slot, w) for w in self.after if w.exists(spec))

    def shapes(self, spec: ModelSpec) -> tuple[tuple[str, Shape], ...]:
        """Names and shapes of the weights the program takes, in binding order."""
        return tuple((name, w.shape(spec)) for name, _, w in self.entries(spec))

    def names(self, spec: ModelSpec) -> tuple[str, ...]:
        """The names of `shapes`, in binding order."""
        return tuple(name for name, _, _ in self.entries(spec))

    def slots(self, tensors: Mapping[str, object], spec: ModelSpec) -> dict[str, object]:
        """Slot path -> value for the named values given (a tied slot missing from `tensors` is aliased).
        A quantized linear's scale (`scale_name(name)`) goes to `<slot>.scale`."""
        out = {slot: tensors[name] for name, slot, _ in self.entries(spec) if name in tensors}
        out |= {
            slot + SCALE_SUFFIX: tensors[scale_name(n)] for n, slot, _ in self.entries(spec) if scale_name(n) in tensors
        }
        slot, target = self.tied
        if spec.tie_word_embeddings and slot not in out and target in out:
            out[slot] = out[target]
        return out


class Combine(enum.Enum):
    """How a step turns its source tensors into one weight."""

    COPY = "copy"
    """One source, unchanged."""
    CONCAT = "concat"
    """Several sources concatenated along dim 0 (fused QKV)."""
    STACK = "stack"
    """Several sources of one shape stacked along a new dim 0 (one per expert)."""
    ALIAS = "alias"
    """The very tensor an earlier step produced (tied embeddings); never copied."""


@attrs.frozen(kw_only=True)
class Rows:
    """Flatten to one dimension (a quantized linear's scale: one value per output row)."""

    def out_shape(self, shape: Shape) -> Shape:
        n = 1
        for d in shape:
            n *= d
        return (n,)


@attrs.frozen(kw_only=True)
class CastFloat:
    """Cast floating-point tensors (float8 excepted) to `dtype`; integer tensors pass unchanged."""

    dtype: str = attrs.field(validator=attrs.validators.in_(FLOAT_DTYPES))

    def out_shape(self, shape: Shape) -> Shape:
        return shape


Transform = CastFloat | Rows
"""The transforms a step applies to its combined weight, in order."""


def _indices(values: Iterable[int | None]) -> tuple[int | None, ...]:
    return tuple(values)  # a typed converter: mypy cannot see element types through a bare `tuple`


@attrs.frozen(kw_only=True)
class Take:
    """A rank's slice of one source: these indices along `dim`, in order; None stands for a zero row
    (padding). GQA head replication and padding, and the rank's share, are all one Take."""

    dim: int = attrs.field(validator=attrs.validators.ge(0))
    indices: tuple[int | None, ...] = attrs.field(converter=_indices)

    def bounds(self) -> tuple[int, int] | None:
        """The contiguous range of source indices it reads (None when it reads none: all padding)."""
        real = [i for i in self.indices if i is not None]
        return (min(real), max(real) + 1) if real else None

    def out_shape(self, shape: Shape) -> Shape:
        return tuple(len(self.indices) if d == self.dim else n for d, n in enumerate(shape))


@attrs.frozen(kw_only=True)
class WeightStep:
    """How one nxdi weight is made from renamed checkpoint keys."""

    name: str
    """The nxdi name, e.g. `layers.0.self_attn.Wqkv.weight`."""
    sources: tuple[str, ...]
    """Renamed checkpoint keys read (for ALIAS: the name of the earlier step)."""
    source_shapes: tuple[Shape, ...]
    """Expected shape of each source, in order."""
    combine: Combine = Combine.COPY
    takes: tuple[Take | None, ...] = ()
    """Per source, the slice of it this rank holds (empty, or None for a source: all of it)."""
    transforms: tuple[Transform, ...] = ()
    quantized: bool = False
    """Its sources are stored quantized (int8/fp8 values, read as stored; `scale_name(name)` holds the scales)."""

    def take(self, i: int) -> Take | None:
        """The slice of source `i` this step reads (None: all of it)."""
        return self.takes[i] if self.takes else None

    def source_items(self) -> Iterator[tuple[str, Shape]]:
        """(renamed checkpoint key, shape) of every source."""
        return zip(self.sources, self.source_shapes, strict=True)

    @property
    def shape(self) -> Shape:
        """Shape of the produced weight."""
        taken = [tk.out_shape(s) if (tk := self.take(i)) else s for i, s in enumerate(self.source_shapes)]
        if self.combine is Combine.CONCAT:
            shape = (sum(s[0] for s in taken), *taken[0][1:])
        elif self.combine is Combine.STACK:
            shape = (len(taken), *taken[0])
        else:
            shape = taken[0]
        for t in self.transforms:
            shape = t.out_shape(shape)
        return shape


@attrs.frozen(kw_only=True)
class WeightPlan:
    """Every step that turns a checkpoint into the weights of one program."""

    steps: tuple[WeightStep, ...]
    model_prefix: str = STATE_DICT_MODEL_PREFIX
    new_prefix: str = NEW_STATE_DICT_MODEL_PREFIX
    unprefixed: tuple[str, ...] = ("lm_head.",)
    """nxdi names stored outside the base model (no model prefix in the checkpoint)."""
    optional: frozenset[str] = frozenset()
    """Renamed keys that may be present and are not used (an explicit `lm_head.weight` when tied)."""
    quant: WeightQuant | None = None
    """How its quantized steps are stored (None: a float checkpoint)."""

    def names(self) -> tuple[str, ...]:
        """The weights produced, in order."""
        return tuple(s.name for s in self.steps)

    def rename(self, key: str) -> str:
        """The renamed form of checkpoint key `key`."""
        return rename_key(key, model_prefix=self.model_prefix, new_prefix=self.new_prefix)

    def read_keys(self) -> frozenset[str]:
        """Renamed checkpoint keys the plan reads."""
        return frozenset(self.source_shapes())

    def source_shapes(self) -> dict[str, Shape]:
        """Renamed checkpoint key -> expected shape, for every tensor the plan reads."""
        return {k: s for step in self.steps if step.combine is not Combine.ALIAS for k, s in step.source_items()}

    def stored_key(self, name: str) -> str:
        """The key a renamed checkpoint key has in a prefixed (`model.`...) Hugging Face checkpoint."""
        return _stored_key(self, name, prefixed=True)


def rename_key(key: str, *, model_prefix: str = STATE_DICT_MODEL_PREFIX, new_prefix: str = "") -> str:
    """NxDI's key rewrite: a leading `model_prefix` becomes `new_prefix`; `.weight_scale` becomes `.scale`."""
    if model_prefix and key.startswith(model_prefix):
        key = new_prefix + key[len(model_prefix) :]
    if key.endswith(".weight_scale"):
        key = key[: -len(".weight_scale")] + ".scale"
    return key


def _step(name: str, weight: Weight, *, prefix: str, spec: ModelSpec, casts: tuple[Transform, ...]) -> WeightStep:
    """The step for one weight (`prefix` is its layer prefix); names ending in `scale` keep their dtype."""
    combine = Combine.STACK if weight.experts else Combine.CONCAT if len(weight.sources) > 1 else Combine.COPY
    return WeightStep(
        name=name,
        sources=weight.source_names(spec, prefix),
        source_shapes=weight.source_shapes(spec),
        combine=combine,
        transforms=() if name.endswith("scale") else casts,
    )


def _quantized_steps(
    name: str, weight: Weight, *, prefix: str, spec: ModelSpec, quant: WeightQuant, problems: list[Problem]
) -> tuple[WeightStep, ...]:
    """The values step and the scale step of a quantized linear; () when it stays in float.

    Scales are read as stored and cast to `quant.scale_dtype`; per-tensor and per-channel scales become one value
    per output row (`Rows`; a per-tensor scale is repeated over its source's rows by a Take), so a
    fused weight whose sources have different per-tensor scales is still one weight.
    """
    sources = weight.source_names(spec, prefix)
    kept = [s for s in sources if quant.excludes(s)]
    if len(kept) == len(sources):
        return ()
    if kept:
        why = f"keeps {kept} in float but not the rest of {list(sources)}, which nxdi fuses into {name}"
        problems.append(Problem.of("modules_to_not_convert", list(quant.skip), why, "list all of them or none"))
        return ()
    shapes = weight.source_shapes(spec)
    scale_shapes = []
    for source, shape in zip(sources, shapes, strict=True):
        match quant.scale_shape(shape, source):
            case Success(scale_shape):
                scale_shapes.append(scale_shape)
            case Failure(problem):
                problems.append(problem)
    if len(scale_shapes) != len(sources):
        return ()
    combine = Combine.CONCAT if len(sources) > 1 else Combine.COPY
    blockwise = quant.type == "blockwise_symmetric"
    takes = tuple(Take(dim=0, indices=(0,) * s[0]) for s in shapes) if quant.type == "per_tensor_symmetric" else ()
    rows: tuple[Transform, ...] = () if blockwise else (Rows(),)
    return (
        WeightStep(name=name, sources=sources, source_shapes=shapes, combine=combine, quantized=True),
        WeightStep(
            name=scale_name(name),
            sources=tuple(scale_name(s) for s in sources),
            source_shapes=tuple(scale_shapes),
            combine=combine,
            takes=takes,
            transforms=(*rows, CastFloat(dtype=quant.scale_dtype)),
        ),
    )


def weight_plan_for(
    table: WeightTable,
    spec: ModelSpec,
    *,
    cast_type: str = "config",
    torch_dtype: str = "float32",
    model_prefix: str = STATE_DICT_MODEL_PREFIX,
    new_prefix: str = NEW_STATE_DICT_MODEL_PREFIX,
    quant: WeightQuant | None = None,
) -> Result[WeightPlan, ConfigError]:
    """The plan that reads a Hugging Face checkpoint of `spec` into the weights of `table`'s program.

    Args:
        table: the family's weight table (`FamilyRecord.weights`).
        spec: the architecture.
        cast_type: `"config"` casts floating weights (except names ending `scale`) to `torch_dtype`;
            `"as-declared"` keeps the checkpoint's dtypes.
        torch_dtype: the compute dtype name (`"bfloat16"`, ...).
        model_prefix, new_prefix: NxDI's `_STATE_DICT_MODEL_PREFIX` / `_NEW_STATE_DICT_MODEL_PREFIX`.
        quant: read the table's linear weights quantized (values as stored plus `scale_name` scales),
            except those `quant.skip` keeps in float; a quantized lm_head is read, not tied.

    Returns:
        `Success(WeightPlan)`, or `Failure(ConfigError)` naming every problem: an unknown `cast_type`,
        a `torch_dtype` the cast cannot produce, blocks that do not tile a weight, or
        modules_to_not_convert keeping only part of a fused weight in float.
    """
    problems: list[Problem] = []
    if cast_type not in CAST_TYPES:
        problems.append(Problem.of("cast_type", cast_type, "must be one of config, as-declared"))
    if cast_type == "config" and torch_dtype not in FLOAT_DTYPES:
        problems.append(Problem.of("torch_dtype", torch_dtype, f"cannot be a weight cast target ({FLOAT_DTYPES})"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    casts: tuple[Transform, ...] = (CastFloat(dtype=torch_dtype),) if cast_type == "config" else ()
    by_slot = {slot: name for name, slot, _ in table.entries(spec)}
    tied_slot, target = table.tied
    steps: list[WeightStep] = []
    untied: set[str] = set()
    for name, slot, weight in table.entries(spec):
        prefix = name[: len(name) - len(weight.name)]
        if quant is not None and weight.linear:
            quantized = _quantized_steps(name, weight, prefix=prefix, spec=spec, quant=quant, problems=problems)
            if quantized:
                steps.extend(quantized)
                untied.add(slot)
                continue
        if spec.tie_word_embeddings and slot == tied_slot:
            shape = weight.shape(spec)
            steps.append(
                WeightStep(name=name, sources=(by_slot[target],), source_shapes=(shape,), combine=Combine.ALIAS)
            )
            continue
        steps.append(_step(name, weight, prefix=prefix, spec=spec, casts=casts))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    tied = spec.tie_word_embeddings and tied_slot not in untied
    return Success(
        WeightPlan(
            steps=tuple(steps),
            model_prefix=model_prefix,
            new_prefix=new_prefix,
            unprefixed=table.unprefixed,
            optional=frozenset({by_slot[tied_slot]}) if tied else frozenset(),
            quant=quant,
        )
    )


def _renamed(plan: WeightPlan, keys: Mapping[str, Shape]) -> tuple[dict[str, str], list[Problem]]:
    """Map renamed keys to checkpoint keys, reporting keys that collide after renaming."""
    out: dict[str, str] = {}
    problems: list[Problem] = []
    for key in keys:
        new = plan.rename(key)
        if new in out:
            problems.append(Problem.of(key, new, f"renames to the same name as {out[new]!r}", "remove one of them"))
        else:
            out[new] = key
    return out, problems


def _stored_key(plan: WeightPlan, name: str, *, prefixed: bool) -> str:
    """The checkpoint key a missing weight would have had (lm_head sits outside the base model)."""
    bare = not prefixed or name.startswith(plan.unprefixed) or not name.startswith(plan.new_prefix)
    return name if bare else plan.model_prefix + name[len(plan.new_prefix) :]


def check_checkpoint(plan: WeightPlan, shapes: Mapping[str, Shape]) -> Result[Mapping[str, str], CheckpointError]:
    """Compare a checkpoint's keys and shapes with `plan`.

    Args:
        plan: the weight plan.
        shapes: every checkpoint key (as stored) with its shape.

    Returns:
        `Success(mapping)` from each renamed key the plan reads to its checkpoint key, or
        `Failure(CheckpointError)` listing every missing key, unexpected key, wrongly shaped key and
        pair of keys that collide after renaming.
    """
    names, problems = _renamed(plan, shapes)
    prefixed = bool(plan.model_prefix) and any(k.startswith(plan.model_prefix) for k in shapes)
    expected = plan.source_shapes()
    for name, shape in expected.items():
        if name not in names:
            key = _stored_key(plan, name, prefixed=prefixed)
            problems.append(Problem.missing(key, f"the checkpoint lacks nxdi weight {name!r}"))
        # NxD's fp8 per-tensor saver writes a 0-d scale where its loader (and this plan) expect [1].
        elif (got := tuple(shapes[names[name]])) != tuple(shape) and not (got == () and tuple(shape) == (1,)):
            problems.append(Problem.of(names[name], got, f"has shape {got}, expected {shape}", "check config.json"))
    for name, key in names.items():
        if name not in expected and name not in plan.optional and not name.endswith(IGNORED_SUFFIXES):
            why, fix = "is not a weight of this model", "check model_type and num_hidden_layers in config.json"
            problems.append(Problem.of(key, tuple(shapes[key]), why, fix))
    if problems:
        return Failure(CheckpointError(problems=tuple(problems)))
    return Success({n: names[n] for n in expected})

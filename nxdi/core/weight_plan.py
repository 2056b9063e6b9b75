"""Weight plans: how a Hugging Face checkpoint becomes a program's weights. Pure.

Theory of operation:
1. Table. A family declares its checkpoint layout once, as a `WeightTable` in its record
   (`nxdi.core.weight_table`): the single source of the checkpoint mapping (this module) and of
   the program's fields.
2. Rename. Every checkpoint key is renamed once: a leading model prefix (`"model."`, the table's
   `model_prefix` by default: DBRX's is `"transformer."`) becomes the new prefix (`""`), and a
   trailing `.weight_scale` becomes `.scale`. In the checkpoint of a larger model that holds this
   one (a multimodal Gemma 3: the table's `Wrapper`), the language model's keys are first mapped
   to the keys of the model's own checkpoints, and its other parts (the vision tower) are skipped.
3. Steps. Each weight comes from one `WeightStep`: its sources are copied (one source), concatenated
   along dim 0 (fused QKV: `Wqkv = [Q; K; V]`), stacked along a new dim 0 (a mixture of experts'
   per-expert tensors, `experts.{x}.w1` for every expert x: [X, F, E]), or aliased to an earlier
   step (tied embeddings: the lm_head *is* the embedding, stored once), then passed through the
   step's transforms, in order: splitting one [X*F, E] tensor into its experts (`SplitExperts`,
   DBRX), flattening scales (`Rows`), a float cast (`CastFloat`).
4. Check. `check_checkpoint` compares a checkpoint's keys and shapes with the plan and reports every
   missing, unexpected, colliding and wrongly shaped key at once, each named by its checkpoint key.

Length: ~520 lines, because the plan's value types, its construction (quantized steps included)
and the checkpoint check read the same step shapes; splitting them would scatter one rule set.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping

import attrs
from returns.result import Failure, Result, Success

from nxdi.core import eagle_layout
from nxdi.core.config.neuron_spec import SCALE_DTYPES, NeuronSpec
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.errors import CheckpointError, ConfigError, Problem
from nxdi.core.model_spec import ModelSpec
from nxdi.core.weight_table import (
    NEW_STATE_DICT_MODEL_PREFIX,
    STATE_DICT_MODEL_PREFIX,
    ExpertRows,
    Shape,
    Weight,
    WeightTable,
    Wrapper,
    scale_name,
)

IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    ".attn.bias",  # GPT-2's and GPT-J's causal-mask buffers in their hub checkpoints
    ".attn.masked_bias",
    ".attention.bias",  # GPT-NeoX's (Pythia's) likewise
    ".attention.masked_bias",
)
"""Checkpoint keys ending so (and read by no step) are derived buffers some old checkpoints carry; they are skipped."""
CAST_TYPES = ("config", "as-declared")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
QUANT_TYPES = ("per_tensor_symmetric", "per_channel_symmetric", "blockwise_symmetric")


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
        """(rows, columns) per scale block of a [out, in] weight; 1 for an axis not blocked. An axis
        without a size, or not one of a [out, in] weight's, is ignored: such settings are refused
        before loading (`cpu_support`), and the planner (`nxdi plan`) still plans for them."""
        sizes = [1, 1]
        for axis, size in zip(self.block_axis, self.block_size, strict=False):
            if axis in (-2, -1, 0, 1):
                sizes[axis % 2] = size
        return sizes[0], sizes[1]

    def scale_block(self) -> tuple[int, int] | None:
        """`block()` when the scales are a block grid (blockwise), None when there is one per row."""
        return self.block() if self.type == "blockwise_symmetric" else None

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


def weight_quant(spec: NeuronSpec) -> WeightQuant | None:
    """How the quantized checkpoint stores the linear weights; None unless `spec.quantized`."""
    if not spec.quantized:
        return None
    return WeightQuant(
        type=spec.quantization_type,
        dtype=spec.quantization_dtype,
        block_axis=spec.quantization_block_axis or (),
        block_size=spec.quantization_block_size or (),
        skip=spec.modules_to_not_convert or (),
        scale_dtype=SCALE_DTYPES[spec.quantization_scale_dtype],
    )


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


@attrs.frozen(kw_only=True)
class SplitExperts:
    """A [X*F, E] tensor holding `experts` blocks of rows (DBRX's fused experts) as [X, F, E], or,
    `rows` TRANSPOSED, [X, E, F]. F is whatever the rows give: a rank's share of every expert too."""

    experts: int = attrs.field(validator=attrs.validators.gt(0))
    rows: ExpertRows

    def out_shape(self, shape: Shape) -> Shape:
        return self.rows.split_shape(shape, self.experts)


@attrs.frozen(kw_only=True)
class Transpose:
    """A 2-D tensor stored `[in, out]` (GPT-2's Conv1D) as the program's `[out, in]`."""

    def out_shape(self, shape: Shape) -> Shape:
        return shape[::-1]


Transform = SplitExperts | Rows | CastFloat | Transpose
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


def transposes(step: WeightStep) -> bool:
    """True when `step` reads its source stored `[in, out]` (a Transpose among its transforms)."""
    return any(isinstance(t, Transpose) for t in step.transforms)


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
    wrapper: Wrapper | None = None
    """The larger model whose checkpoint holds this one (a multimodal Gemma 3's), or None."""
    eagle_draft: EagleDraft | None = None
    """The EAGLE draft layout it reads (`nxdi.core.eagle_layout`), or None for any other model."""

    def names(self) -> tuple[str, ...]:
        """The weights produced, in order."""
        return tuple(s.name for s in self.steps)

    def rename(self, key: str) -> str:
        """The renamed form of checkpoint key `key` (unwrapped first, in a wrapping model's checkpoint)."""
        key = key if self.wrapper is None else self.wrapper.unwrap(key)
        return rename_key(key, model_prefix=self.model_prefix, new_prefix=self.new_prefix)

    def skips(self, key: str) -> bool:
        """True for a checkpoint key of a wrapping model's other parts (a vision tower), never read."""
        return self.wrapper is not None and self.wrapper.skips(key)

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
    """The step for one weight (`prefix` goes before its sources' keys); names ending in `scale` keep their dtype."""
    combine = Combine.STACK if weight.experts else Combine.CONCAT if len(weight.sources) > 1 else Combine.COPY
    rows = weight.expert_rows
    split: tuple[Transform, ...] = () if rows is None else (SplitExperts(experts=spec.num_experts, rows=rows),)
    if weight.transposed:  # a Conv1D weight: one source, its rows in order (a RowOrder would index its columns)
        assert len(weight.sources) == 1 and weight.sources[0].rows is None, f"{name}: one plain transposed source"
        split += (Transpose(),)
    shapes = weight.source_shapes(spec)
    # A source ordering its rows otherwise is read through a Take putting them in the program's order
    # (which a rank's Take composes with, `rank_weights`).
    takes = tuple(
        None if src.rows is None else Take(dim=0, indices=src.rows.indices(spec, shape[0]))
        for src, shape in zip(weight.sources, shapes, strict=False)  # an experts weight repeats its one source
    )
    return WeightStep(
        name=name,
        sources=weight.source_names(spec, prefix),
        source_shapes=shapes,
        combine=combine,
        takes=takes if any(takes) else (),
        transforms=split + (() if name.endswith("scale") else casts),
    )


def _quantized_steps(
    name: str, weight: Weight, *, prefix: str, spec: ModelSpec, quant: WeightQuant, problems: list[Problem]
) -> tuple[WeightStep, ...]:
    """The values step and the scale step of a quantized linear; () when it stays in float.

    The values are read as stored, through the weight's own layout steps (a Transpose, a Take
    putting rows in the program's order). Scales are those of the program's [out, in] weight
    (`nxdi.core.host.quant.layout`), read as stored and cast to `quant.scale_dtype`; per-tensor and
    per-channel scales become one value per output row (`Rows`; a per-tensor scale is repeated over
    its source's rows by a Take, a per-row one reordered as its rows are), so a fused weight whose
    sources have different per-tensor scales is still one weight.
    """
    sources = weight.source_names(spec, prefix)
    kept = [s for s in sources if quant.excludes(s)]
    if len(kept) == len(sources):
        return ()
    if kept:
        why = f"keeps {kept} in float but not the rest of {list(sources)}, which nxdi fuses into {name}"
        problems.append(Problem.of("modules_to_not_convert", list(quant.skip), why, "list all of them or none"))
        return ()
    shapes = [s[::-1] if weight.transposed else s for s in weight.source_shapes(spec)]  # [out, in] each
    scale_shapes = []
    for source, shape in zip(sources, shapes, strict=True):
        match quant.scale_shape(shape, source):
            case Success(scale_shape):
                scale_shapes.append(scale_shape)
            case Failure(problem):
                problems.append(problem)
    reordered = [s.name for s in weight.sources if s.rows is not None]
    block = quant.scale_block()
    if reordered and block is not None and block[0] != 1:
        why = f"blocks rows, but {reordered} store their rows in another order than nxdi's {name}"
        fix = "block along the input axis only (quantization_block_axis=[1])"
        problems.append(Problem.of("quantization_block_axis", list(quant.block_axis), why, fix))
        return ()
    if len(scale_shapes) != len(sources):
        return ()
    values = attrs.evolve(_step(name, weight, prefix=prefix, spec=spec, casts=()), quantized=True)
    if quant.type == "per_tensor_symmetric":
        takes: tuple[Take | None, ...] = tuple(Take(dim=0, indices=(0,) * s[0]) for s in shapes)
    else:  # one scale row per stored row (a block grid's rows are rows when blocks span one row)
        takes = tuple(values.take(i) for i in range(len(sources)))
    rows: tuple[Transform, ...] = () if block is not None else (Rows(),)
    return (
        values,
        WeightStep(
            name=scale_name(name),
            sources=tuple(scale_name(s) for s in sources),
            source_shapes=tuple(scale_shapes),
            combine=Combine.CONCAT if len(sources) > 1 else Combine.COPY,
            takes=takes if any(takes) else (),
            transforms=(*rows, CastFloat(dtype=quant.scale_dtype)),
        ),
    )


def weight_plan_for(
    table: WeightTable,
    spec: ModelSpec,
    *,
    cast_type: str = "config",
    torch_dtype: str = "float32",
    model_prefix: str | None = None,
    new_prefix: str = NEW_STATE_DICT_MODEL_PREFIX,
    quant: WeightQuant | None = None,
    eagle_draft: EagleDraft | None = None,
) -> Result[WeightPlan, ConfigError]:
    """The plan that reads a Hugging Face checkpoint of `spec` into the weights of `table`'s program.

    Args:
        table: the family's weight table (`FamilyRecord.weights`).
        spec: the architecture.
        cast_type: `"config"` casts floating weights (except names ending `scale`) to `torch_dtype`;
            `"as-declared"` keeps the checkpoint's dtypes.
        torch_dtype: the compute dtype name (`"bfloat16"`, ...).
        model_prefix, new_prefix: NxDI's `_STATE_DICT_MODEL_PREFIX` / `_NEW_STATE_DICT_MODEL_PREFIX`
            (`model_prefix` None: the table's, `"model."` for most families).
        quant: read the table's linear weights quantized (values as stored plus `scale_name` scales),
            except those `quant.skip` keeps in float; a quantized lm_head is read, not tied.
        eagle_draft: read an EAGLE draft's checkpoint (`table` changed by `EagleDraft.table`).

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
    table = table if eagle_draft is None else eagle_draft.table(table)
    by_slot = {e.slot: e for e in table.placed(spec)}
    tied_slot, target = table.tied
    steps: list[WeightStep] = []
    untied: set[str] = set()
    for entry in table.placed(spec):
        name, slot, weight, prefix = entry.name, entry.slot, entry.weight, entry.source_prefix
        if quant is not None and weight.linear:
            quantized = _quantized_steps(name, weight, prefix=prefix, spec=spec, quant=quant, problems=problems)
            if quantized:
                steps.extend(quantized)
                untied.add(slot)
                continue
        if spec.tie_word_embeddings and slot == tied_slot:
            shape = weight.shape(spec)
            aliased = (by_slot[target].name,)
            steps.append(WeightStep(name=name, sources=aliased, source_shapes=(shape,), combine=Combine.ALIAS))
            continue
        steps.append(_step(name, weight, prefix=prefix, spec=spec, casts=casts))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    # A tied checkpoint may still carry the tied weight's own tensor (an explicit lm_head), unused.
    tied = by_slot.get(tied_slot) if spec.tie_word_embeddings and tied_slot not in untied else None
    return Success(
        WeightPlan(
            steps=tuple(steps),
            model_prefix=table.model_prefix if model_prefix is None else model_prefix,
            new_prefix=new_prefix,
            unprefixed=table.unprefixed,
            optional=frozenset(tied.weight.source_names(spec, tied.source_prefix)) if tied else frozenset(),
            quant=quant,
            wrapper=table.wrapper_for(spec.model_type),
            eagle_draft=eagle_draft,
        )
    )


def _renamed(plan: WeightPlan, keys: Mapping[str, Shape]) -> tuple[dict[str, str], list[Problem]]:
    """Map renamed keys to checkpoint keys (a wrapping model's other parts left out), reporting keys
    that collide after renaming."""
    out: dict[str, str] = {}
    problems: list[Problem] = []
    for key in keys:
        if plan.skips(key):
            continue
        new = plan.rename(key)
        if new in out:
            problems.append(Problem.of(key, new, f"renames to the same name as {out[new]!r}", "remove one of them"))
        else:
            out[new] = key
    return out, problems


def _stored_key(plan: WeightPlan, name: str, *, prefixed: bool, keys: Iterable[str] = ()) -> str:
    """The checkpoint key a missing weight would have had (lm_head sits outside the base model; a
    wrapping model's checkpoint nests both, in the layout its `keys` show)."""
    prefixed = prefixed or plan.wrapper is not None
    bare = not prefixed or name.startswith(plan.unprefixed) or not name.startswith(plan.new_prefix)
    key = name if bare else plan.model_prefix + name[len(plan.new_prefix) :]
    return key if plan.wrapper is None else plan.wrapper.wrap(key, keys)


def check_checkpoint(plan: WeightPlan, shapes: Mapping[str, Shape]) -> Result[Mapping[str, str], CheckpointError]:
    """Compare a checkpoint's keys and shapes with `plan`.

    Args:
        plan: the weight plan.
        shapes: every checkpoint key (as stored) with its shape.

    Returns:
        `Success(mapping)` from each renamed key the plan reads to its checkpoint key, or
        `Failure(CheckpointError)` listing every missing key, unexpected key, wrongly shaped key and
        pair of keys that collide after renaming. Keys of a wrapping model's other parts (a
        multimodal Gemma 3's vision tower and projector: `WeightPlan.wrapper`) are not expected and
        not reported; every other key the plan does not read is.
    """
    names, problems = _renamed(plan, shapes)
    prefixed = bool(plan.model_prefix) and any(k.startswith(plan.model_prefix) for k in shapes)
    expected = plan.source_shapes()
    for name, shape in expected.items():
        if name not in names:
            key = _stored_key(plan, name, prefixed=prefixed, keys=shapes)
            problems.append(Problem.missing(key, f"the checkpoint lacks nxdi weight {name!r}"))
        # NxD's fp8 per-tensor saver writes a 0-d scale where its loader (and this plan) expect [1].
        elif (got := tuple(shapes[names[name]])) != tuple(shape) and not (got == () and tuple(shape) == (1,)):
            problems.append(Problem.of(names[name], got, f"has shape {got}, expected {shape}", "check config.json"))
    for name, key in names.items():
        if name not in expected and name not in plan.optional and not name.endswith(IGNORED_SUFFIXES):
            why, fix = "is not a weight of this model", "check model_type and num_hidden_layers in config.json"
            problems.append(Problem.of(key, tuple(shapes[key]), why, fix))
    if problems and plan.eagle_draft is not None:
        problems = list(eagle_layout.explain(problems, plan.rename))
    if problems:
        return Failure(CheckpointError(problems=tuple(problems)))
    return Success({n: names[n] for n in expected})

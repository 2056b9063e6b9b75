"""Weight plans: how a Hugging Face checkpoint becomes nxdi's named weights. Pure.

Theory of operation:
1. Rename. Every checkpoint key is renamed once: a leading model prefix (`_STATE_DICT_MODEL_PREFIX`,
   `"model."`) becomes the new prefix (`""`), and a trailing `.weight_scale` becomes `.scale`.
2. Steps. Each nxdi weight comes from one `WeightStep`: its renamed source keys are copied (one
   source), concatenated along dim 0 (fused QKV: `Wqkv = [Q; K; V]`), or aliased to the output of an
   earlier step (tied embeddings: `lm_head` *is* `embed_tokens`, stored once), and then passed
   through the step's transforms in order (a float cast today; GQA head replication/padding and
   tensor-parallel slices from the sharding plan later, as further `Transform` variants).
3. Check. `check_checkpoint` compares a checkpoint's keys and shapes with the plan and reports
   every missing, unexpected, colliding and wrongly shaped key at once.

The plan is data: `nxdi.core.host.weight_ops` applies a step to tensors, `nxdi.effects.weight_loader` streams a
checkpoint through a plan. The programs in `nxdi.core.programs` take exactly `weight_names(...)`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import CheckpointError, ConfigError, Problem
from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind

Shape = tuple[int, ...]

STATE_DICT_MODEL_PREFIX = "model."
"""NxDI's `_STATE_DICT_MODEL_PREFIX`: stripped from the start of checkpoint keys."""
NEW_STATE_DICT_MODEL_PREFIX = ""
"""NxDI's `_NEW_STATE_DICT_MODEL_PREFIX`: what replaces the stripped prefix."""
UNPREFIXED: tuple[str, ...] = ("lm_head.",)
"""nxdi names Hugging Face stores outside the base model, so without the model prefix."""
IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
"""Checkpoint keys ending so are derived buffers some old checkpoints carry; they are skipped."""
DENSE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""model_types whose checkpoints the dense decoder program reads."""
CAST_TYPES = ("config", "as-declared")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class Combine(enum.Enum):
    """How a step turns its source tensors into one weight."""

    COPY = "copy"
    """One source, unchanged."""
    CONCAT = "concat"
    """Several sources concatenated along dim 0 (fused QKV)."""
    ALIAS = "alias"
    """The very tensor an earlier step produced (tied embeddings); never copied."""


@attrs.frozen(kw_only=True)
class CastFloat:
    """Cast floating-point tensors (float8 excepted) to `dtype`; integer tensors pass unchanged."""

    dtype: str = attrs.field(validator=attrs.validators.in_(FLOAT_DTYPES))

    def out_shape(self, shape: Shape) -> Shape:
        return shape


Transform = CastFloat
"""The transforms a step may apply, in order. GQA replication/padding and TP slicing join this union."""


@attrs.frozen(kw_only=True)
class WeightStep:
    """How one nxdi weight is made from renamed checkpoint keys."""

    name: str
    """The nxdi weight name, e.g. `layers.0.self_attn.Wqkv.weight`."""
    sources: tuple[str, ...]
    """Renamed checkpoint keys read (for ALIAS: the name of the earlier step)."""
    source_shapes: tuple[Shape, ...]
    """Expected shape of each source, in order."""
    combine: Combine = Combine.COPY
    transforms: tuple[Transform, ...] = ()

    @property
    def shape(self) -> Shape:
        """Shape of the produced weight."""
        first = self.source_shapes[0]
        shape = (sum(s[0] for s in self.source_shapes), *first[1:]) if self.combine is Combine.CONCAT else first
        for t in self.transforms:
            shape = t.out_shape(shape)
        return shape


@attrs.frozen(kw_only=True)
class WeightPlan:
    """Every step that turns a checkpoint into the weights of one program."""

    steps: tuple[WeightStep, ...]
    model_prefix: str = STATE_DICT_MODEL_PREFIX
    new_prefix: str = NEW_STATE_DICT_MODEL_PREFIX
    optional: frozenset[str] = frozenset()
    """Renamed keys that may be present and are not used (an explicit `lm_head.weight` when tied)."""

    def names(self) -> tuple[str, ...]:
        """The weights produced, in order."""
        return tuple(s.name for s in self.steps)

    def rename(self, key: str) -> str:
        """The renamed form of checkpoint key `key`."""
        return rename_key(key, model_prefix=self.model_prefix, new_prefix=self.new_prefix)

    def read_keys(self) -> frozenset[str]:
        """Renamed checkpoint keys the plan reads."""
        return frozenset(k for s in self.steps if s.combine is not Combine.ALIAS for k in s.sources)


def rename_key(key: str, *, model_prefix: str = STATE_DICT_MODEL_PREFIX, new_prefix: str = "") -> str:
    """NxDI's key rewrite: a leading `model_prefix` becomes `new_prefix`; `.weight_scale` becomes `.scale`."""
    if model_prefix and key.startswith(model_prefix):
        key = new_prefix + key[len(model_prefix) :]
    if key.endswith(".weight_scale"):
        key = key[: -len(".weight_scale")] + ".scale"
    return key


def qkv_sizes(spec: ModelSpec) -> tuple[int, int, int]:
    """Rows of Q, K and V inside a fused `Wqkv` (H*D, K*D, K*D)."""
    return spec.q_size, spec.kv_size, spec.kv_size


def _attention_weights(spec: ModelSpec, p: str, *, fused_qkv: bool) -> list[tuple[str, Shape]]:
    e, (q, k, v) = spec.hidden_size, qkv_sizes(spec)
    out: list[tuple[str, Shape]] = []
    if fused_qkv:
        out.append((f"{p}self_attn.Wqkv.weight", (q + k + v, e)))
        if spec.qkv_bias:
            out.append((f"{p}self_attn.Wqkv.bias", (q + k + v,)))
    else:
        out += [(f"{p}self_attn.{n}_proj.weight", (r, e)) for n, r in (("q", q), ("k", k), ("v", v))]
        if spec.qkv_bias:
            out += [(f"{p}self_attn.{n}_proj.bias", (r,)) for n, r in (("q", q), ("k", k), ("v", v))]
    out.append((f"{p}self_attn.o_proj.weight", (e, q)))
    if spec.o_bias:
        out.append((f"{p}self_attn.o_proj.bias", (e,)))
    if spec.qk_norm:
        out += [(f"{p}self_attn.q_norm.weight", (spec.head_dim,)), (f"{p}self_attn.k_norm.weight", (spec.head_dim,))]
    return out


def _layer_weights(spec: ModelSpec, i: int, *, fused_qkv: bool) -> list[tuple[str, Shape]]:
    e, f, p = spec.hidden_size, spec.intermediate_size, f"layers.{i}."
    out = [(f"{p}input_layernorm.weight", (e,)), *_attention_weights(spec, p, fused_qkv=fused_qkv)]
    out.append((f"{p}post_attention_layernorm.weight", (e,)))
    out += [
        (f"{p}mlp.gate_proj.weight", (f, e)),
        (f"{p}mlp.up_proj.weight", (f, e)),
        (f"{p}mlp.down_proj.weight", (e, f)),
    ]
    if spec.mlp_bias:
        out += [(f"{p}mlp.gate_proj.bias", (f,)), (f"{p}mlp.up_proj.bias", (f,)), (f"{p}mlp.down_proj.bias", (e,))]
    return out


def weight_shapes(spec: ModelSpec, *, fused_qkv: bool = False) -> tuple[tuple[str, Shape], ...]:
    """Names and shapes of the weights the dense decoder program takes, in binding order.

    `embed_tokens.weight [V, E]`, then per layer norms, attention (`Wqkv` when `fused_qkv`, else
    `q_proj/k_proj/v_proj`; biases and q/k norms when the spec has them) and MLP, then
    `norm.weight [E]` and `lm_head.weight [V, E]` (the embedding itself when tied).
    """
    v, e = spec.vocab_size, spec.hidden_size
    out: list[tuple[str, Shape]] = [("embed_tokens.weight", (v, e))]
    for i in range(spec.num_layers):
        out += _layer_weights(spec, i, fused_qkv=fused_qkv)
    out += [("norm.weight", (e,)), ("lm_head.weight", (v, e))]
    return tuple(out)


def weight_names(spec: ModelSpec, *, fused_qkv: bool = False) -> tuple[str, ...]:
    """The names of `weight_shapes`, in binding order."""
    return tuple(n for n, _ in weight_shapes(spec, fused_qkv=fused_qkv))


def _check_family(spec: ModelSpec) -> list[Problem]:
    if spec.model_type not in DENSE_FAMILIES:
        known = ", ".join(sorted(DENSE_FAMILIES))
        return [Problem.of("model_type", spec.model_type, f"has no weight plan yet (supported: {known})")]
    if spec.is_moe or spec.norm is not NormKind.RMS or spec.position is not PositionKind.ROPE or not spec.gated_mlp:
        return [Problem.of("model_type", spec.model_type, "is not a dense RMSNorm/RoPE/gated-MLP decoder")]
    return []


def weight_step(
    name: str, shape: Shape, *, spec: ModelSpec, fused_qkv: bool, casts: tuple[Transform, ...]
) -> WeightStep:
    """The step for one nxdi weight: a copy, a Q/K/V concatenation, or the tied alias of the embedding.

    `casts` apply to every weight except names ending in `scale` (quantization scales keep their dtype).
    """
    ts = () if name.endswith("scale") else casts
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return WeightStep(name=name, sources=("embed_tokens.weight",), source_shapes=(shape,), combine=Combine.ALIAS)
    if fused_qkv and ".self_attn.Wqkv." in name:
        parts = tuple(name.replace("Wqkv", f"{n}_proj") for n in "qkv")
        shapes = tuple((r, *shape[1:]) for r in qkv_sizes(spec))
        return WeightStep(name=name, sources=parts, source_shapes=shapes, combine=Combine.CONCAT, transforms=ts)
    return WeightStep(name=name, sources=(name,), source_shapes=(shape,), transforms=ts)


def weight_plan_for(
    spec: ModelSpec,
    *,
    fused_qkv: bool = False,
    cast_type: str = "config",
    torch_dtype: str = "float32",
    model_prefix: str = STATE_DICT_MODEL_PREFIX,
    new_prefix: str = NEW_STATE_DICT_MODEL_PREFIX,
) -> Result[WeightPlan, ConfigError]:
    """The plan that reads a Hugging Face checkpoint of `spec` into nxdi weights.

    Args:
        spec: the architecture (llama, mistral, qwen2 or qwen3).
        fused_qkv: produce `Wqkv = cat([q, k, v], 0)` (and its bias) instead of separate projections.
        cast_type: `"config"` casts floating weights (except names ending `scale`) to `torch_dtype`;
            `"as-declared"` keeps the checkpoint's dtypes.
        torch_dtype: the compute dtype name (`"bfloat16"`, ...).
        model_prefix, new_prefix: NxDI's `_STATE_DICT_MODEL_PREFIX` / `_NEW_STATE_DICT_MODEL_PREFIX`.

    Returns:
        `Success(WeightPlan)`, or `Failure(ConfigError)` naming every problem: an unsupported family,
        an unknown `cast_type`, or a `torch_dtype` the cast cannot produce.
    """
    problems = _check_family(spec)
    if cast_type not in CAST_TYPES:
        problems.append(Problem.of("cast_type", cast_type, "must be one of config, as-declared"))
    if cast_type == "config" and torch_dtype not in FLOAT_DTYPES:
        problems.append(Problem.of("torch_dtype", torch_dtype, f"cannot be a weight cast target ({FLOAT_DTYPES})"))
    if problems:
        return Failure(ConfigError(problems=tuple(problems)))
    casts: tuple[Transform, ...] = (CastFloat(dtype=torch_dtype),) if cast_type == "config" else ()
    steps = tuple(
        weight_step(n, s, spec=spec, fused_qkv=fused_qkv, casts=casts)
        for n, s in weight_shapes(spec, fused_qkv=fused_qkv)
    )
    optional = frozenset({"lm_head.weight"}) if spec.tie_word_embeddings else frozenset()
    return Success(WeightPlan(steps=steps, model_prefix=model_prefix, new_prefix=new_prefix, optional=optional))


def weight_plan_for_spec(neuron: NeuronSpec, model: ModelSpec) -> Result[WeightPlan, ConfigError]:
    """`weight_plan_for` with `fused_qkv`, `cast_type` and `torch_dtype` read from a `NeuronSpec`."""
    return weight_plan_for(
        model, fused_qkv=neuron.fused_qkv, cast_type=neuron.cast_type, torch_dtype=neuron.torch_dtype
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
    bare = not prefixed or name.startswith(UNPREFIXED) or not name.startswith(plan.new_prefix)
    return name if bare else plan.model_prefix + name[len(plan.new_prefix) :]


def _expected_sources(plan: WeightPlan) -> dict[str, Shape]:
    expected: dict[str, Shape] = {}
    for step in plan.steps:
        if step.combine is not Combine.ALIAS:
            expected.update(zip(step.sources, step.source_shapes, strict=True))
    return expected


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
    expected = _expected_sources(plan)
    for name, shape in expected.items():
        if name not in names:
            key = _stored_key(plan, name, prefixed=prefixed)
            problems.append(Problem.missing(key, f"the checkpoint lacks nxdi weight {name!r}"))
        elif (got := tuple(shapes[names[name]])) != tuple(shape):
            problems.append(Problem.of(names[name], got, f"has shape {got}, expected {shape}", "check config.json"))
    for name, key in names.items():
        if name not in expected and name not in plan.optional and not name.endswith(IGNORED_SUFFIXES):
            why, fix = "is not a weight of this model", "check model_type and num_hidden_layers in config.json"
            problems.append(Problem.of(key, tuple(shapes[key]), why, fix))
    if problems:
        return Failure(CheckpointError(problems=tuple(problems)))
    return Success({n: names[n] for n in expected})

"""Properties of weight plans: renames, fused QKV round trips, tied weights, casts, and checkpoint checks."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core import weight_plan as weights
from nxdi.core import weight_table
from nxdi.core.families.llama import LLAMA_WEIGHTS
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.testing.strategies.decoders import (
    checkpoint_shapes,
    dense_specs,
    moe_specs,
    plan_of,
    program_of,
    random_state_dict,
)
from nxdi.testing.strategies.hf_configs import model_specs

DENSE = ("llama", "mistral", "qwen2", "qwen3")
SEEDS = st.integers(0, 2**31 - 1)


@given(st.text(alphabet="model.xyz_0123", max_size=30))
def test_rename_strips_only_a_leading_prefix_and_renames_weight_scale(key: str) -> None:
    new = weights.rename_key(key)
    body = key[len("model.") :] if key.startswith("model.") else key
    expected = body[: -len(".weight_scale")] + ".scale" if body.endswith(".weight_scale") else body
    assert new == expected
    assert weights.rename_key(key, model_prefix="") == (key[:-13] + ".scale" if key.endswith(".weight_scale") else key)


@given(model_specs(DENSE), st.sampled_from(["config", "as-declared"]))
def test_a_well_formed_checkpoint_passes_and_every_source_is_read(spec: ModelSpec, cast: str) -> None:
    plan = plan_of(spec, cast_type=cast, torch_dtype="bfloat16")
    shapes = checkpoint_shapes(spec)
    match weights.check_checkpoint(plan, shapes):
        case Success(keys):
            assert set(keys) == set(plan.read_keys())
            assert all(keys[n] in shapes for n in keys)
        case Failure(err):
            raise AssertionError(err.render())
    assert plan.names() == LLAMA_WEIGHTS.names(spec)
    assert all(s.shape == shape for s, (_, shape) in zip(plan.steps, LLAMA_WEIGHTS.shapes(spec), strict=True))


@settings(max_examples=50)
@given(model_specs(DENSE), st.data())
def test_every_missing_unexpected_and_misshaped_key_is_reported_at_once(spec: ModelSpec, data: st.DataObject) -> None:
    plan = plan_of(spec)
    shapes = checkpoint_shapes(spec)
    keys = sorted(shapes)
    missing = set(data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True), label="missing"))
    rest = [k for k in keys if k not in missing]
    misshaped = set(data.draw(st.lists(st.sampled_from(rest), max_size=3, unique=True), label="misshaped"))
    extra = set(
        data.draw(st.lists(st.sampled_from(["model.layers.99.foo.weight", "bar", "lm_head.bias"]), unique=True))
    )
    bad = {k: s for k, s in shapes.items() if k not in missing}
    bad |= {k: (*shapes[k], 2) for k in misshaped} | dict.fromkeys(extra, (3,))
    bad["model.layers.0.self_attn.rotary_emb.inv_freq"] = (4,)  # derived buffers are skipped, never reported
    result = weights.check_checkpoint(plan, bad)
    if not (missing or misshaped or extra):
        assert isinstance(result, Success)
        return
    assert isinstance(result, Failure)
    assert result.failure().fields() == missing | misshaped | extra


@given(model_specs(DENSE))
def test_colliding_keys_after_renaming_are_reported(spec: ModelSpec) -> None:
    plan = plan_of(spec)
    shapes = checkpoint_shapes(spec) | {"norm.weight": (spec.hidden_size,)}  # also "model.norm.weight"
    result = weights.check_checkpoint(plan, shapes)
    assert isinstance(result, Failure) and "norm.weight" in result.failure().fields()


def test_bad_cast_settings_are_config_errors() -> None:
    spec = ModelSpec(
        model_type="llama",
        hidden_size=8,
        num_attention_heads=2,
        num_kv_heads=2,
        head_dim=4,
        num_layers=1,
        vocab_size=8,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    result = weights.weight_plan_for(LLAMA_WEIGHTS, spec, cast_type="fp8", torch_dtype="float8_e4m3fn")
    assert isinstance(result, Failure) and result.failure().fields() == {"cast_type"}
    bad_dtype = weights.weight_plan_for(LLAMA_WEIGHTS, spec, cast_type="config", torch_dtype="float8_e4m3fn")
    assert isinstance(bad_dtype, Failure) and bad_dtype.failure().fields() == {"torch_dtype"}


@settings(deadline=None, max_examples=20)
@given(dense_specs(), SEEDS, st.sampled_from(["float32", "bfloat16", "float16"]))
def test_convert_fuses_ties_and_casts_without_touching_the_input(spec: ModelSpec, seed: int, dtype: str) -> None:
    # a quantization scale, stored as `.weight_scale`, renamed to `.scale` and never cast
    sd = random_state_dict(spec, seed) | {"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(1)}
    sd_before = {k: v.clone() for k, v in sd.items()}
    scale = weight_table.copy("attn.o_scale", "self_attn.o_proj.scale", ("1",))
    family = program_of(spec).table
    table = attrs.evolve(family, layer=(*family.layer, scale))
    plan = weights.weight_plan_for(table, spec, torch_dtype=dtype).unwrap()
    out = weight_ops.convert(
        plan, sd | {f"model.layers.{i}.self_attn.o_proj.weight_scale": torch.ones(1) for i in range(spec.num_layers)}
    ).unwrap()
    assert all(torch.equal(sd[k], sd_before[k]) for k in sd), "convert modified its input"
    target = weight_ops.torch_dtype(dtype)
    assert all(t.dtype == target for n, t in out.items() if not n.endswith("scale"))
    assert out["layers.0.self_attn.o_proj.scale"].dtype == torch.float32, "scales keep their dtype"
    for i in range(spec.num_layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v = out[f"layers.{i}.self_attn.Wqkv.weight"].split([spec.q_size, spec.kv_size, spec.kv_size])
        for got, name in zip((q, k, v), ("q_proj", "k_proj", "v_proj"), strict=True):
            assert torch.equal(got, sd[f"{p}{name}.weight"].to(target))
    if spec.tie_word_embeddings:
        assert out["lm_head.weight"] is out["embed_tokens.weight"]
    else:
        assert torch.equal(out["lm_head.weight"], sd["lm_head.weight"].to(target))


@settings(deadline=None, max_examples=20)
@given(moe_specs(), SEEDS)
def test_convert_stacks_every_expert_in_order(spec: ModelSpec, seed: int) -> None:
    sd = random_state_dict(spec, seed)
    out = weight_ops.convert(plan_of(spec), sd).unwrap()
    for i in range(spec.num_layers):
        for part in ("gate", "up", "down"):
            got = out[f"layers.{i}.mlp.experts.{part}_proj.weight"]
            assert got.shape[0] == spec.num_experts
            for x in range(spec.num_experts):
                assert torch.equal(got[x], _expert_weight(spec, sd, i, x, part))


def _expert_weight(spec: ModelSpec, sd: dict[str, torch.Tensor], layer: int, x: int, part: str) -> torch.Tensor:
    """Expert x's gate/up [F, E] or down [E, F] in a checkpoint of `spec`'s family."""
    if spec.model_type == "dbrx":  # every expert in one [X*F, E] tensor; w2 holds down transposed
        fused = sd[f"transformer.blocks.{layer}.ffn.experts.mlp." + {"gate": "w1", "up": "v1", "down": "w2"}[part]]
        block = fused.view(spec.num_experts, spec.intermediate_size, spec.hidden_size)[x]
        return block.T if part == "down" else block
    if spec.model_type == "mixtral":
        n = {"gate": "1", "up": "3", "down": "2"}[part]
        return sd[f"model.layers.{layer}.block_sparse_moe.experts.{x}.w{n}.weight"]
    return sd[f"model.layers.{layer}.mlp.experts.{x}.{part}_proj.weight"]


def test_an_experts_split_that_does_not_tile_its_tensor_names_the_weight_and_its_source() -> None:
    """Shapes are checked before anything is read; applying a step without that check still names it."""
    split = weights.SplitExperts(experts=2, rows=weight_table.ExpertRows.TRANSPOSED)
    step = weights.WeightStep(
        name="layers.0.mlp.experts.down_proj.weight",
        sources=("blocks.0.ffn.experts.mlp.w2",),
        source_shapes=((6, 4),),
        transforms=(split,),
    )
    assert step.shape == (2, 4, 3)
    assert tuple(weight_ops.apply_step(step, [torch.arange(24.0).view(6, 4)]).shape) == (2, 4, 3)
    named = r"layers\.0\.mlp\.experts\.down_proj\.weight \(from blocks\.0\.ffn\.experts\.mlp\.w2\): shape \(7, 4\)"
    with pytest.raises(ValueError, match=named):
        weight_ops.apply_step(step, [torch.zeros(7, 4)])

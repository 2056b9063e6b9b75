"""Properties of multi-LoRA serving in the decoder program (`nxdi.core.programs.lora`) and of its
layout and adapter checks (`nxdi.core.planning.lora`), on tiny random specs and adapters.

- a row on an adapter's slot gives the logits of the base decoder with that adapter merged into its
  weights (`W + scaling * B A`, Q/K/V into their rows of the fused weight), whatever the other rows use;
- a row on the base slot (zeros) gives the base decoder's logits exactly;
- `stack` fills exactly `LoraLayout.shapes()`, whose bytes per slot are the planner's adapter size
  (what the device holds is what `nxdi plan` counts, at tp_degree 1); `check_adapter` accepts what fits and names the
  tensor of every rank above max_lora_rank and every shape of another base model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.core.config.sub_specs import LoraSpec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import lora as lora_plan
from nxdi.core.programs import decoder, inputs, kv_cache, lora
from nxdi.testing.strategies.decoders import LLAMA_SHAPED, dense_specs, random_weights
from tests.support.program_checks import DTYPE
from tests.support.program_checks import close as _close
from tests.support.program_checks import random_tokens as _tokens

SEEDS = st.integers(0, 2**31 - 1)
MLP = ("gate_proj", "up_proj", "down_proj")


def _key(layer: int, module: str, matrix: str) -> str:
    part = "mlp" if module in MLP else "self_attn"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{matrix}.weight"


@st.composite
def adapters(draw: st.DrawFn, layout: lora_plan.LoraLayout, seed: int) -> list[lora.Adapter]:
    """Adapters at every non-base slot: each on a random subset of the layout's modules, rank <= R."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in range(1 if layout.base_slot else 0, layout.slots):
        modules = draw(st.sets(st.sampled_from(layout.modules), min_size=1))
        rank = draw(st.integers(1, layout.rank))
        tensors = {}
        for layer in range(layout.model.num_layers):
            for m in sorted(modules):
                fan_in, fan_out = layout.dims(m)
                tensors[_key(layer, m, "A")] = torch.randn(rank, fan_in, generator=g) * 0.3
                tensors[_key(layer, m, "B")] = torch.randn(fan_out, rank, generator=g) * 0.3
        alpha = draw(st.sampled_from([None, 1.0, 8.0]))
        out.append(lora.Adapter(slot=slot, tensors=tensors, alpha=alpha, rslora=draw(st.booleans())))
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelSpec, lora_plan.LoraLayout, list[lora.Adapter], int]:
    spec = draw(dense_specs(model_types=LLAMA_SHAPED))
    modules = draw(st.sets(st.sampled_from(lora_plan.KNOWN_MODULES), min_size=1))
    cfg = LoraSpec(
        max_loras=draw(st.integers(1, 3)),
        max_lora_rank=draw(st.integers(1, 4)),
        target_modules=tuple(sorted(modules)),
        enable_base_model_only=draw(st.booleans()),
    )
    layout = lora_plan.layout_for(spec, cfg).unwrap()
    seed = draw(SEEDS)
    return spec, layout, draw(adapters(layout, seed)), seed


def _merged(w: decoder.DecoderWeights, adapter: lora.Adapter, layout: lora_plan.LoraLayout) -> decoder.DecoderWeights:
    """The base weights with `adapter` merged in: the reference a LoRA row must equal."""
    m = layout.model
    rows = {"q_proj": 0, "k_proj": m.q_size, "v_proj": m.q_size + m.kv_size}
    layers = []
    for i, lw in enumerate(w.layers):
        attn, mlp = lw.attn, lw.mlp
        for module in layout.modules:
            a, b = adapter.tensors.get(_key(i, module, "A")), adapter.tensors.get(_key(i, module, "B"))
            if a is None or b is None:
                continue
            # in the programs' dtype: an adapter's float32 product would put float32 rounding in the reference
            delta = b.to(DTYPE) @ a.to(DTYPE) * lora.scaling(adapter.alpha, a.shape[0], rslora=adapter.rslora)
            if module in rows:
                qkv = attn.qkv.clone()
                qkv[rows[module] : rows[module] + delta.shape[0]] += delta
                attn = dataclasses.replace(attn, qkv=qkv)
            elif module == "o_proj":
                attn = dataclasses.replace(attn, o=attn.o + delta)
            else:
                name = module.removesuffix("_proj")
                mlp = dataclasses.replace(mlp, **{name: getattr(mlp, name) + delta})
        layers.append(dataclasses.replace(lw, attn=attn, mlp=mlp))
    return dataclasses.replace(w, layers=tuple(layers))


def _run(weights: Any, spec: ModelSpec, prompts: list[list[int]], slots: list[int] | None, forward: Any) -> Any:
    n = max(len(p) for p in prompts) + 1
    x = inputs.prompt_inputs(prompts, length=n)
    if slots is not None:
        x = dataclasses.replace(x, adapter_ids=torch.tensor(slots))
    cache = kv_cache.empty_cache(spec, batch=len(prompts), length=n, dtype=DTYPE)
    logits, _, _ = forward(weights, cache, x, spec=spec)
    return logits


@settings(deadline=None, max_examples=25)
@given(case=cases(), data=st.data())
def test_a_row_on_an_adapter_equals_the_merged_model(case: Any, data: st.DataObject) -> None:
    spec, layout, found, seed = case
    base = random_weights(spec, seed, DTYPE)
    stacked = lora.stack(layout, found, dtype=DTYPE)
    w = lora.weights_from_tensors(base, stacked, layout)
    rows = data.draw(st.lists(st.integers(0, layout.slots - 1), min_size=1, max_size=4), label="slots")
    prompts = [_tokens(spec, seed + i, 1 + (seed + i) % 5) for i in range(len(rows))]
    logits = _run(w, spec, prompts, rows, lora.forward_outputs)
    plain = _run(base, spec, prompts, None, decoder.forward_outputs)
    by_slot = {a.slot: a for a in found}
    for i, slot in enumerate(rows):
        if slot not in by_slot:  # the base slot: zeros add exactly nothing
            assert torch.equal(logits[i], plain[i]), i
            continue
        merged = _run(_merged(base, by_slot[slot], layout), spec, [prompts[i]], None, decoder.forward_outputs)
        _close(logits[i], merged[0])


@settings(deadline=None, max_examples=25)
@given(case=cases())
def test_stack_fills_the_layout_and_leaves_the_base_slot_zero(case: Any) -> None:
    _, layout, found, _ = case
    stacked = lora.stack(layout, found, dtype=torch.float32)
    assert {n: tuple(t.shape) for n, t in stacked.items()} == layout.shapes()
    if layout.base_slot:
        assert all(not t[0].any() for t in stacked.values())
    planned = lora_plan.adapter_size(layout.model, rank=layout.rank, target_modules=layout.modules, dtype="float32")
    per_slot = sum(t[0].numel() for t in stacked.values()) * 4
    assert per_slot == planned.unwrap().total_bytes


@settings(deadline=None, max_examples=25)
@given(case=cases(), extra=st.integers(1, 3), data=st.data())
def test_check_adapter_names_every_wrong_tensor(case: Any, extra: int, data: st.DataObject) -> None:
    _, layout, found, _ = case
    shapes = {k: tuple(t.shape) for k, t in found[0].tensors.items()}
    assert lora_plan.check_adapter("x", shapes, layout) == ()
    key = data.draw(st.sampled_from(sorted(k for k in shapes if "lora_A" in k)), label="tensor")
    r, fan_in = shapes[key]
    wide = {**shapes, key: (layout.rank + extra, fan_in), key.replace("lora_A", "lora_B"): (1, layout.rank + extra)}
    problems = lora_plan.check_adapter("x", wide, layout)
    assert any(p.field == f"lora_config.lora_ckpt_paths[x].{key}" and "max_lora_rank" in p.reason for p in problems)
    other = {**shapes, key: (r, fan_in + extra)}
    (problem,) = lora_plan.check_adapter("x", other, layout)
    assert problem.field == f"lora_config.lora_ckpt_paths[x].{key}" and "another base model" in problem.reason

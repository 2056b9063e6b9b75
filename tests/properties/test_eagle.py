"""Properties of the EAGLE draft program, its layout and the target's hidden-state output, on tiny random specs.

- The draft's checkpoint layout (`EagleDraft.table`) is the family's with fc added and the norms
  dropped; a checkpoint of it passes the check with and without the `model.` prefix.
- Prefilling m pairs then drafting pair by pair through the cache gives one full forward's logits
  and hidden states; a right-padded batch gives each row what it gets alone.
- `pair_inputs` pairs each position's hidden state with the next token.
- Asking a step for its hidden states leaves its logits bit for bit unchanged, and the lm_head of
  the returned hidden state is the step's logits (dense and mixture-of-experts specs).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Success

from nxdi.core import weight_plan
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.host import weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import decoder, eagle, inputs, kv_cache
from nxdi.core.programs.linear import linear
from nxdi.testing.strategies.decoders import (
    LLAMA_SHAPED,
    cast_floats,
    decoder_specs,
    dense_specs,
    program_of,
    random_weights,
)
from tests.support.program_checks import DTYPE, close

SEEDS = st.integers(0, 2**31 - 1)
LAYOUTS = st.builds(EagleDraft, input_norm=st.booleans(), fc_bias=st.booleans())


def _plan(spec: ModelSpec, layout: EagleDraft) -> weight_plan.WeightPlan:
    return weight_plan.weight_plan_for(program_of(spec).table, spec, eagle_draft=layout).unwrap()


def _draft(spec: ModelSpec, layout: EagleDraft, seed: int) -> eagle.EagleWeights:
    """Random draft weights, written as a checkpoint (stored keys) and read through the draft's plan."""
    plan, g = _plan(spec, layout), torch.Generator().manual_seed(seed)
    state = {
        plan.stored_key(name): (1.0 + 0.2 * torch.randn(shape, generator=g))
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=g) * (0.5 if len(shape) == 1 else shape[-1] ** -0.5)
        for name, shape in plan.source_shapes().items()
    }
    tensors = cast_floats(weight_ops.convert(plan, state).unwrap(), DTYPE)
    return eagle.weights_from_slots(layout.table(program_of(spec).table).slots(tensors, spec), spec=spec)


def _pairs(spec: ModelSpec, seed: int, n: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, spec.vocab_size, (n,), generator=g).tolist(), torch.randn(
        1, n, spec.hidden_size, generator=g
    ).to(DTYPE)


@settings(deadline=None, max_examples=30)
@given(spec=dense_specs(model_types=LLAMA_SHAPED), layout=LAYOUTS, prefixed=st.booleans())
def test_the_draft_layout_is_the_family_layout_with_fc_and_without_norms(
    spec: ModelSpec, layout: EagleDraft, prefixed: bool
) -> None:
    family = set(_plan_names(weight_plan.weight_plan_for(program_of(spec).table, spec).unwrap()))
    plan = _plan(spec, layout)
    dropped = {"norm.weight"} | (
        set() if layout.input_norm else {n for n in family if n.endswith("input_layernorm.weight")}
    )
    added = {"fc.weight"} | ({"fc.bias"} if layout.fc_bias else set())
    assert set(_plan_names(plan)) == (family - dropped) | added
    assert plan.source_shapes()["fc.weight"] == (spec.hidden_size, 2 * spec.hidden_size)
    shapes = {(plan.stored_key(k) if prefixed else k): s for k, s in plan.source_shapes().items()}
    assert isinstance(weight_plan.check_checkpoint(plan, shapes), Success)


def _plan_names(plan: weight_plan.WeightPlan) -> list[str]:
    return [s.name for s in plan.steps]


@settings(deadline=None, max_examples=25)
@given(spec=dense_specs(model_types=LLAMA_SHAPED), layout=LAYOUTS, seed=SEEDS, n=st.integers(2, 10), data=st.data())
def test_prefill_then_drafting_equals_one_forward(
    spec: ModelSpec, layout: EagleDraft, seed: int, n: int, data: st.DataObject
) -> None:
    m = data.draw(st.integers(1, n - 1), label="prefill length")
    bucket = data.draw(st.integers(m, n), label="context bucket")
    w = _draft(spec, layout, seed)
    toks, hidden = _pairs(spec, seed, n)
    cache = kv_cache.empty_cache(spec, batch=1, length=n, dtype=DTYPE)
    full, full_own, _ = eagle.forward(w, cache, inputs.prompt_inputs([toks], length=n), hidden, spec=spec)
    padded = torch.cat((hidden[:, :m], torch.zeros(1, bucket - m, spec.hidden_size, dtype=DTYPE)), 1)
    logits, own, part = eagle.forward(
        w, cache.prefix(bucket), inputs.prompt_inputs([toks[:m]], length=bucket), padded, spec=spec
    )
    close(logits[:, :m], full[:, :m])
    close(own[:, :m], full_own[:, :m])
    cache = cache.splice(part)
    for p in range(m, n):
        x = inputs.token_inputs(torch.tensor([toks[p]]), torch.tensor([p]))
        logits, own, cache = eagle.forward(w, cache, x, hidden[:, p : p + 1], spec=spec)
        close(logits[:, 0], full[:, p])
        close(own[:, 0], full_own[:, p])


@settings(deadline=None, max_examples=20)
@given(
    spec=dense_specs(model_types=LLAMA_SHAPED),
    layout=LAYOUTS,
    seed=SEEDS,
    lengths=st.lists(st.integers(1, 8), min_size=2, max_size=3),
)
def test_padded_draft_rows_equal_rows_alone(spec: ModelSpec, layout: EagleDraft, seed: int, lengths: list[int]) -> None:
    w = _draft(spec, layout, seed)
    rows = [_pairs(spec, seed + i, n) for i, n in enumerate(lengths)]
    bucket = max(lengths) + 1
    hidden = torch.zeros(len(rows), bucket, spec.hidden_size, dtype=DTYPE)
    for i, (_, h) in enumerate(rows):
        hidden[i, : h.shape[1]] = h[0]
    cache = kv_cache.empty_cache(spec, batch=len(rows), length=bucket, dtype=DTYPE)
    batched, own, _ = eagle.forward(
        w, cache, inputs.prompt_inputs([t for t, _ in rows], length=bucket), hidden, spec=spec
    )
    for i, (t, h) in enumerate(rows):
        one = kv_cache.empty_cache(spec, batch=1, length=len(t), dtype=DTYPE)
        alone, alone_own, _ = eagle.forward(w, one, inputs.prompt_inputs([t], length=len(t)), h, spec=spec)
        close(batched[i, : len(t)], alone[0])
        close(own[i, : len(t)], alone_own[0])


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=SEEDS)
def test_pair_inputs_pair_each_hidden_state_with_the_next_token(lengths: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 50, (n,), generator=g).tolist() for n in lengths]
    x = inputs.prompt_inputs(prompts, length=max(lengths))
    hidden, nxt = (
        torch.randn(len(lengths), max(lengths), 4, generator=g),
        torch.randint(3, 50, (len(lengths),), generator=g),
    )
    pairs, prev = eagle.pair_inputs(x, hidden, nxt)
    assert (
        prev is hidden
        and torch.equal(pairs.position_ids, x.position_ids)
        and torch.equal(pairs.last_index, x.last_index)
    )
    for b, p in enumerate(prompts):
        assert pairs.input_ids[b, : len(p)].tolist() == [*p[1:], int(nxt[b])]
    fewer, _ = eagle.pair_inputs(x, hidden, nxt, last_index=torch.zeros(len(lengths), dtype=torch.int64))
    assert fewer.input_ids[:, 0].tolist() == nxt.tolist()


@settings(deadline=None, max_examples=25)
@given(
    spec=decoder_specs(), seed=SEEDS, lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3), every=st.booleans()
)
def test_the_hidden_state_output_changes_nothing_and_is_the_lm_heads_input(
    spec: ModelSpec, seed: int, lengths: list[int], every: bool
) -> None:
    w = random_weights(spec, seed, DTYPE)
    g = torch.Generator().manual_seed(seed)
    x = inputs.prompt_inputs([torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths], length=8)
    cache = kv_cache.empty_cache(spec, batch=len(lengths), length=8, dtype=DTYPE)
    plain, plain_cache, plain_extras = decoder.forward_outputs(w, cache, x, spec=spec, all_logits=every)
    logits, new_cache, extras = decoder.forward_outputs(w, cache, x, spec=spec, all_logits=every, hidden=True)
    torch.testing.assert_close(logits, plain, atol=0, rtol=0)
    for a, b in zip(new_cache.to_tensors(), plain_cache.to_tensors(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert list(extras) == [*plain_extras, decoder.HIDDEN]
    hidden = extras[decoder.HIDDEN]  # [B, S, E]
    assert hidden.shape == (len(lengths), 8, spec.hidden_size)
    picked = hidden if every else eagle.last_of(hidden, x.last_index)[:, None]
    head = linear(picked, w.lm_head)
    cap = spec.final_logit_softcap
    close((head if cap is None else torch.tanh(head / cap) * cap).float(), logits)

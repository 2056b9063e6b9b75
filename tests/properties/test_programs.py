"""Properties of the decoder programs on tiny random specs (mlx-lm's runner checks, as properties).

- prefill then token-by-token decoding gives the logits of one full forward;
- a right-padded batch gives each row the logits it gets alone (padding never leaks);
- cache writes are out of place, touch only the written slots, and agree with an in-place write;
- every weight of the family's table lands in its slot of the weights value; caches round-trip;
- the catalog runs every decoder family and lists what the decoder lacks for other specs.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core import families
from nxdi.core.model_spec import ModelSpec, NormKind, PositionKind
from nxdi.core.programs import catalog, inputs, kv_cache
from nxdi.core.programs import decoder as llama
from nxdi.testing.strategies.decoders import dense_specs, program_of, random_weights
from tests.support.program_checks import DTYPE
from tests.support.program_checks import close as _close
from tests.support.program_checks import random_tokens as _tokens

SEEDS = st.integers(0, 2**31 - 1)


@settings(deadline=None, max_examples=30)
@given(spec=dense_specs(), seed=SEEDS, n=st.integers(2, 12), data=st.data())
def test_prefill_then_decode_equals_full_forward(spec: ModelSpec, seed: int, n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, n - 1), label="prefill length")
    bucket = data.draw(st.integers(m, n), label="context bucket")
    w = random_weights(spec, seed, DTYPE)
    toks = _tokens(spec, seed, n)
    cache = kv_cache.empty_cache(spec, batch=1, length=n, dtype=DTYPE)
    full, _ = llama.forward(w, cache, inputs.prompt_inputs([toks], length=n), spec=spec, all_logits=True)
    logits, part = llama.forward(w, cache.prefix(bucket), inputs.prompt_inputs([toks[:m]], length=bucket), spec=spec)
    cache = cache.splice(part)
    steps = [logits[:, 0]]
    for p in range(m, n - 1):
        x = inputs.token_inputs(torch.tensor([toks[p]]), torch.tensor([p]))
        logits, cache = llama.forward(w, cache, x, spec=spec)
        steps.append(logits[:, 0])
    _close(torch.stack(steps, 1), full[:, m - 1 : n - 1])


@settings(deadline=None, max_examples=20)
@given(spec=dense_specs(), seed=SEEDS, lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4))
def test_padded_batch_rows_equal_rows_alone(spec: ModelSpec, seed: int, lengths: list[int]) -> None:
    w = random_weights(spec, seed, DTYPE)
    prompts = [_tokens(spec, seed + i, n) for i, n in enumerate(lengths)]
    bucket = max(lengths) + 1
    cache = kv_cache.empty_cache(spec, batch=len(prompts), length=bucket + 2, dtype=DTYPE)
    batched, new = llama.forward(w, cache, inputs.prompt_inputs(prompts, length=bucket), spec=spec)
    for i, p in enumerate(prompts):
        one = kv_cache.empty_cache(spec, batch=1, length=len(p), dtype=DTYPE)
        alone, _ = llama.forward(w, one, inputs.prompt_inputs([p], length=len(p)), spec=spec)
        _close(batched[i], alone[0])
    # a decode step right after each prompt also matches, whatever the padding wrote
    nxt = torch.tensor([p[0] for p in prompts])
    pos = torch.tensor(lengths)
    stepped, _ = llama.forward(w, new, inputs.token_inputs(nxt, pos), spec=spec)
    for i, p in enumerate(prompts):
        one = kv_cache.empty_cache(spec, batch=1, length=len(p) + 1, dtype=DTYPE)
        alone, _ = llama.forward(w, one, inputs.prompt_inputs([[*p, p[0]]], length=len(p) + 1), spec=spec)
        _close(stepped[i], alone[0])


@settings(deadline=None, max_examples=20)
@given(spec=dense_specs(), seed=SEEDS, lengths=st.lists(st.integers(2, 9), min_size=1, max_size=3))
def test_context_encoding_prunes_the_last_layer_to_the_output_tokens_without_changing_them(
    spec: ModelSpec, seed: int, lengths: list[int]
) -> None:
    w = random_weights(spec, seed, DTYPE)
    prompts = [_tokens(spec, seed + i, n) for i, n in enumerate(lengths)]
    bucket = max(lengths) + 1
    cache = kv_cache.empty_cache(spec, batch=len(prompts), length=bucket, dtype=DTYPE)
    x = inputs.prompt_inputs(prompts, length=bucket)
    last, pruned = llama.forward(w, cache, x, spec=spec)  # the last layer runs at the output tokens only
    every, whole = llama.forward(w, cache, x, spec=spec, all_logits=True)  # every token's output: not pruned
    _close(last[:, 0], every[torch.arange(len(prompts)), x.last_index])
    for a, b in zip((*pruned.k, *pruned.v), (*whole.k, *whole.v), strict=True):
        assert torch.equal(a, b)  # every token's keys and values are still written


@st.composite
def cache_writes(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, k, t, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 4))
    s = draw(st.integers(1, t))
    g = torch.Generator().manual_seed(draw(SEEDS))
    slots = torch.stack([torch.randperm(t, generator=g)[:s] for _ in range(b)])  # distinct per row
    return torch.randn(b, k, t, d, generator=g), torch.randn(b, k, s, d, generator=g), slots


@settings(deadline=None)
@given(cache_writes())
def test_cache_write_is_out_of_place_and_agrees_with_an_in_place_write(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    cache, new, slots = case
    before = cache.clone()
    out = kv_cache.write(cache, new, slots)
    assert torch.equal(cache, before), "the input cache was modified"
    in_place = cache.clone()
    rows = torch.arange(cache.shape[0])[:, None]
    in_place.permute(0, 2, 1, 3)[rows, slots] = new.permute(0, 2, 1, 3)  # index_put_ on [B, T, K, D]
    assert torch.equal(out, in_place)
    untouched = torch.ones(cache.shape[0], cache.shape[2], dtype=torch.bool)
    untouched[rows, slots] = False
    assert torch.equal(out.permute(0, 2, 1, 3)[untouched], before.permute(0, 2, 1, 3)[untouched])


def _at(value: object, path: str) -> object:
    """The field at a slot path: `layers.0.attn.qkv` -> value.layers[0].attn.qkv."""
    for part in path.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)  # type: ignore[index]
    return value


@settings(deadline=None, max_examples=15)
@given(spec=dense_specs())
def test_every_table_weight_lands_in_its_slot(spec: ModelSpec) -> None:
    program = program_of(spec)
    named = {name: torch.zeros(shape) for name, shape in program.table.shapes(spec)}
    if spec.tie_word_embeddings:
        del named["lm_head.weight"]  # a tied lm_head is bound once, as the embedding
    w = program.weights(named, spec=spec)
    for name, slot, _ in program.table.entries(spec):
        if name in named:
            assert _at(w, slot) is named[name], f"{name} is not in slot {slot}"
    if spec.tie_word_embeddings:
        assert w.lm_head is w.embed, "tied weights must be stored once"


@settings(deadline=None)
@given(spec=dense_specs(), b=st.integers(1, 3), t=st.integers(1, 6))
def test_cache_round_trips_through_flat_tensors(spec: ModelSpec, b: int, t: int) -> None:
    cache = kv_cache.empty_cache(spec, batch=b, length=t, dtype=DTYPE)
    flat = cache.to_tensors()
    assert len(flat) == 2 * spec.num_layers and flat[0] is cache.k[0] and flat[1] is cache.v[0]
    back = kv_cache.KVCache.from_tensors(flat)
    assert all(x is y for x, y in zip(back.to_tensors(), flat, strict=True))
    assert cache.prefix(t).length == t and cache.splice(cache.prefix(max(t - 1, 1))).length == t


@given(spec=dense_specs())
def test_every_decoder_family_has_a_program_and_other_specs_are_refused(spec: ModelSpec) -> None:
    record = families.record_for(spec.model_type).unwrap()
    match catalog.program_for(record, spec):
        case Success(program):
            assert program.record is record and program.forward is llama.forward
        case Failure(err):
            raise AssertionError(err.render())
    gpt2_like = attrs.evolve(spec, gated_mlp=False, norm=NormKind.LAYER, norm_bias=True)
    assert isinstance(catalog.program_for(record, gpt2_like), Success)
    dbrx_like = attrs.evolve(spec, norm=NormKind.LAYER, norm_bias=False, clip_qkv=8.0)
    assert isinstance(catalog.program_for(record, dbrx_like), Success)
    assert isinstance(catalog.program_for(record, attrs.evolve(spec, num_experts=4, num_experts_per_tok=2)), Success)
    gptj_like = attrs.evolve(spec, shared_layer_norm=True, rotary_dim=spec.head_dim + 2)
    refused = catalog.program_for(record, gptj_like)
    assert isinstance(refused, Failure) and refused.failure().fields() == {"shared_layer_norm", "rotary_dim"}
    alibi = attrs.evolve(spec, position=PositionKind.ALIBI, rope=None)
    assert isinstance(
        catalog.program_for(record, alibi), Success if spec.num_kv_heads == spec.num_attention_heads else Failure
    )

"""Properties of the sampler program: greedy agreement, top-k/top-p support, reproducibility."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.core.programs import sampling


@st.composite
def logits_cases(draw: st.DrawFn) -> torch.Tensor:
    """[B, V] logits with distinct values (ties would make 'the top k' ambiguous)."""
    b, v = draw(st.integers(1, 4)), draw(st.integers(2, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    return torch.randn(b, v, generator=g, dtype=torch.float64).float() * scale


@st.composite
def params_for(draw: st.DrawFn, b: int, v: int) -> torch.Tensor:
    rows = [
        (
            draw(st.integers(-1, v + 3)),
            draw(st.sampled_from([0.05, 0.3, 0.5, 0.9, 0.99, 1.0])),
            draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        )
        for _ in range(b)
    ]
    return torch.tensor(rows, dtype=torch.float32)


def _uniforms(b: int, seed: int) -> torch.Tensor:
    return torch.rand(b, generator=torch.Generator().manual_seed(seed))


def _allowed(logits: torch.Tensor, top_k: int, top_p: float, temperature: float, global_topk: int) -> set[int]:
    """The Hugging Face rule, written independently: the tokens a row may produce.

    A token is kept while the mass of the better tokens is below top_p (so the token that crosses
    top_p is kept); 1e-5 of slack absorbs fp32-vs-fp64 rounding right at the boundary.
    """
    v = logits.shape[-1]
    c = v if global_topk <= 0 else min(global_topk, v)
    k = 1 if temperature <= 0 else (c if top_k <= 0 else min(top_k, c))
    t = 1.0 if temperature <= 0 else temperature
    order = sorted(range(v), key=lambda i: -logits[i].item())[:k]
    probs = torch.softmax(logits[order].double() / t, dim=-1).tolist()
    kept, mass = [], 0.0
    for tok, p in zip(order, probs, strict=True):
        if kept and top_p < 1.0 and mass >= top_p + 1e-5:
            break
        kept.append(tok)
        mass += p
    return set(kept)


@settings(deadline=None)
@given(logits_cases(), st.integers(0, 2**31 - 1), st.sampled_from([0, 3, 256]))
def test_top_k_1_equals_greedy(logits: torch.Tensor, seed: int, global_topk: int) -> None:
    b = logits.shape[0]
    params = torch.tensor([[1.0, 1.0, 1.0]] * b)
    tokens = sampling.sample(logits, params, _uniforms(b, seed), global_topk=global_topk)
    assert torch.equal(tokens, sampling.greedy(logits))


@settings(deadline=None)
@given(logits_cases(), st.integers(0, 2**31 - 1))
def test_temperature_0_is_greedy(logits: torch.Tensor, seed: int) -> None:
    b = logits.shape[0]
    params = torch.tensor([[-1.0, 0.5, 0.0]] * b)
    assert torch.equal(sampling.sample(logits, params, _uniforms(b, seed), global_topk=0), sampling.greedy(logits))


@settings(deadline=None, max_examples=60)
@given(data=st.data(), logits=logits_cases(), seed=st.integers(0, 2**31 - 1))
def test_sampled_tokens_respect_top_k_and_top_p(data: st.DataObject, logits: torch.Tensor, seed: int) -> None:
    b, v = logits.shape
    params = data.draw(params_for(b, v))
    global_topk = data.draw(st.sampled_from([0, 4, 256]))
    for draw_seed in range(seed, seed + 5):
        tokens = sampling.sample(logits, params, _uniforms(b, draw_seed), global_topk=global_topk)
        for i in range(b):
            top_k, top_p, temp = params[i].tolist()
            allowed = _allowed(logits[i], int(top_k), top_p, temp, global_topk)
            assert tokens[i].item() in allowed, (tokens[i].item(), allowed)


@settings(deadline=None)
@given(logits_cases(), st.integers(0, 2**31 - 1))
def test_fixed_uniforms_reproduce_and_extremes_pick_the_ends(logits: torch.Tensor, seed: int) -> None:
    b = logits.shape[0]
    params = torch.tensor([[0.0, 1.0, 1.0]] * b)  # whole vocabulary, plain softmax
    u = _uniforms(b, seed)
    assert torch.equal(
        sampling.sample(logits, params, u, global_topk=0), sampling.sample(logits, params, u, global_topk=0)
    )
    lowest = sampling.sample(logits, params, torch.zeros(b), global_topk=0)
    assert torch.equal(lowest, sampling.greedy(logits)), "u = 0 picks the most likely candidate"
    probs = torch.softmax(logits.double(), -1)
    deterministic = sampling.sample(logits, params, torch.full((b,), 0.5), global_topk=0)
    for i in range(b):  # 0.5 picks the candidate where the sorted cumulative probability reaches one half
        order = torch.argsort(logits[i], descending=True)
        cdf = torch.cumsum(probs[i][order], 0)
        assert deterministic[i].item() == order[int((cdf < 0.5).sum())].item()


@settings(deadline=None)
@given(logits_cases(), st.integers(0, 2**31 - 1))
def test_sampling_draws_follow_the_filtered_distribution(logits: torch.Tensor, seed: int) -> None:
    b, v = logits.shape
    params = torch.tensor([[0.0, 1.0, 1.0]] * b)
    probs, _ = sampling.filtered_probs(logits, params, global_topk=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(b))
    u = torch.linspace(0, 1, 2001)[:-1]
    for i in range(b):
        picks = sampling.sample(logits[i : i + 1].expand(len(u), v), params[:1].expand(len(u), 3), u, global_topk=0)
        freq = torch.bincount(picks, minlength=v).double() / len(u)
        expected = torch.softmax(logits[i].double(), -1)
        assert (freq - expected).abs().max().item() <= 1.5 / len(u) + 1e-6

"""Speculative decoding's verification step (nxdi.core.programs.speculation): greedy by hand and as
k greedy steps; sampling keeps the target's distribution, exactly (integrating over the uniforms)
and statistically (chi-square); degenerate inputs; temperature 0 as greedy; export."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nxdi.core.programs import sampling, speculation

CHI2_DF7_UPPER_1E4 = 29.8775
"""The chi-square distribution's 1 - 1e-4 quantile with 7 degrees of freedom (V = 8 cells less
one), computed with mpmath (scipy is not installed): a correct sampler exceeds it with
probability 1e-4 per test statistic."""


def _logits_with_argmax(best: Tensor, v: int, g: torch.Generator) -> Tensor:
    """Random logits [..., V] whose argmax is `best` [...] (the maximum by a clear margin)."""
    x = torch.rand(*best.shape, v, generator=g)  # in [0, 1)
    return x.scatter(-1, best[..., None], torch.full_like(x[..., :1], 2.0))


def _distribution(v: int, g: torch.Generator, *, zeros: bool) -> Tensor:
    """A random float64 distribution [V]; with `zeros`, some entries are 0 (never all)."""
    x = -torch.log1p(-torch.rand(v, generator=g, dtype=torch.float64))  # exponential: Dirichlet(1)
    if zeros:
        x = torch.where(torch.rand(v, generator=g) < 0.3, torch.zeros_like(x), x)
        x[int(torch.randint(v, (), generator=g))] += 1.0
    return x / x.sum()


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_all_accepted_emits_the_bonus_token() -> None:
    g = torch.Generator().manual_seed(0)
    logits = _logits_with_argmax(torch.tensor([[2, 4, 1]]), 5, g)
    tokens, counts = speculation.greedy_accept(logits, torch.tensor([[2, 4]]))
    assert tokens.tolist() == [[2, 4, 1]] and counts.tolist() == [3]
    assert tokens.dtype == counts.dtype == torch.int64


def test_greedy_first_mismatch_emits_the_target_token() -> None:
    g = torch.Generator().manual_seed(0)
    logits = _logits_with_argmax(torch.tensor([[2, 4, 1]]), 5, g)
    tokens, counts = speculation.greedy_accept(logits, torch.tensor([[3, 4]]))
    assert tokens.tolist() == [[2, -1, -1]] and counts.tolist() == [1]


def test_greedy_rows_accept_different_counts() -> None:
    g = torch.Generator().manual_seed(1)
    best = torch.tensor([[2, 4, 1, 0], [2, 4, 1, 0], [2, 4, 1, 0], [3, 3, 3, 3]])
    draft = torch.tensor([[2, 4, 1], [0, 4, 1], [2, 4, 0], [3, 0, 3]])
    tokens, counts = speculation.greedy_accept(_logits_with_argmax(best, 5, g), draft, pad=9)
    assert counts.tolist() == [4, 1, 3, 2]
    assert tokens.tolist() == [[2, 4, 1, 0], [2, 9, 9, 9], [2, 4, 1, 9], [3, 3, 9, 9]]


def test_no_draft_tokens_is_one_ordinary_step() -> None:
    """k = 1: the target's own token, greedy or sampled."""
    g = torch.Generator().manual_seed(2)
    logits = _logits_with_argmax(torch.tensor([[3], [1]]), 5, g)
    draft = torch.zeros(2, 0, dtype=torch.int64)
    tokens, counts = speculation.greedy_accept(logits, draft)
    assert tokens.tolist() == [[3], [1]] and counts.tolist() == [1, 1]
    p = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0]], [[0.0, 0.5, 0.0, 0.0, 0.5]]])
    tokens, counts = speculation.sample_accept(p, p[:, :0], draft, torch.tensor([[0.3], [0.7]]))
    assert tokens.tolist() == [[2], [4]] and counts.tolist() == [1, 1]


@settings(deadline=None)
@given(
    b=st.integers(1, 4), k=st.integers(1, 5), v=st.integers(2, 7), seed=st.integers(0, 2**31 - 1), agree=st.floats(0, 1)
)
def test_greedy_equals_successive_greedy_steps(b: int, k: int, v: int, seed: int, agree: float) -> None:
    """tokens[:count] are what k greedy steps of the target emit, stopping at the first token
    that differs from the draft (past it, the target's logits assumed the wrong input)."""
    g = torch.Generator().manual_seed(seed)
    best = torch.randint(v, (b, k), generator=g)
    wrong = (best[:, :-1] + torch.randint(1, v, (b, k - 1), generator=g)) % v
    draft = torch.where(torch.rand(b, k - 1, generator=g) < agree, best[:, :-1], wrong)
    logits = _logits_with_argmax(best, v, g)
    tokens, counts = speculation.greedy_accept(logits, draft)
    for row in range(b):
        emitted: list[int] = []
        for i in range(k):
            emitted.append(int(torch.argmax(logits[row, i])))
            if i == k - 1 or emitted[-1] != int(draft[row, i]):
                break
        assert counts[row] == len(emitted)
        assert tokens[row].tolist() == emitted + [-1] * (k - len(emitted))


# --- sampling keeps the target's distribution ---------------------------------------------------


def _cuts(points: Tensor) -> list[tuple[float, float]]:
    """The intervals of [0, 1] between sorted `points` (0 and 1 added), empty ones dropped."""
    edges = sorted({0.0, 1.0, *(min(max(float(x), 0.0), 1.0) for x in points)})
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def _outcomes(p0: Tensor, q0: Tensor, p1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every outcome of sample_accept with k = 2, with its exact probability.

    The draft token d is drawn from q0 and the target's distribution after it is p1[d]. The
    result is piecewise constant in the two uniforms: the acceptance test changes only at
    u0 = p0(d)/q0(d), the final draw only at the CDF steps of the residual and of p1[d]. So one
    call per piece, at its midpoint, weighted by q0(d) times the piece's area, integrates exactly.
    Returns weights [R], tokens [R, 2] and counts [R].
    """
    v = p0.shape[0]
    rows: list[tuple[float, int, Tensor, float, float]] = []
    for d in range(v):
        if q0[d] == 0:
            continue  # never drafted
        r = (p0 - q0).clamp(min=0)
        r = r / r.sum() if r.sum() > 0 else p0
        accept = _cuts((p0[d] / q0[d]).reshape(1))
        final = _cuts(torch.cat((torch.cumsum(r, 0), torch.cumsum(p1[d], 0))))
        for (a, b), (c, e) in itertools.product(accept, final):
            rows.append((float(q0[d]) * (b - a) * (e - c), d, p1[d], (a + b) / 2, (c + e) / 2))
    weights = torch.tensor([w for w, *_ in rows], dtype=torch.float64)
    p = torch.stack([torch.stack((p0, row[2])) for row in rows])  # [R, 2, V]
    draft = torch.tensor([[row[1]] for row in rows])
    uniforms = torch.tensor([[row[3], row[4]] for row in rows], dtype=torch.float64)
    tokens, counts = speculation.sample_accept(p, q0.expand(len(rows), 1, v), draft, uniforms)
    return weights, tokens, counts


@settings(deadline=None)
@given(v=st.integers(2, 6), seed=st.integers(0, 2**31 - 1), zeros=st.booleans())
def test_sampling_is_exactly_the_target_distribution(v: int, seed: int, zeros: bool) -> None:
    """k = 2, integrated over the draft draw and both uniforms: the first token is distributed as
    p0; a draft token x is accepted with probability min(p0(x), q0(x)); and the token after an
    accepted x (the bonus token) is distributed as p1[x]."""
    g = torch.Generator().manual_seed(seed)
    p0, q0 = _distribution(v, g, zeros=zeros), _distribution(v, g, zeros=zeros)
    p1 = torch.stack([_distribution(v, g, zeros=zeros) for _ in range(v)])  # [V, V], row x: after x
    weights, tokens, counts = _outcomes(p0, q0, p1)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)
    first = torch.zeros(v, dtype=torch.float64).index_add(0, tokens[:, 0], weights)
    torch.testing.assert_close(first, p0, rtol=0, atol=1e-6)
    accepted = counts == 2
    both = torch.zeros(v, v, dtype=torch.float64).index_put(
        (tokens[accepted, 0], tokens[accepted, 1]), weights[accepted], accumulate=True
    )
    torch.testing.assert_close(both.sum(1), torch.minimum(p0, q0), rtol=0, atol=1e-6)
    torch.testing.assert_close(both, both.sum(1, keepdim=True) * p1, rtol=0, atol=1e-6)


def _chi2(tokens: Tensor, expected: Tensor) -> float:
    """Pearson's statistic of `tokens` [M] against the distribution `expected` [V]."""
    observed = torch.bincount(tokens, minlength=expected.shape[0]).double()
    mean = expected * tokens.shape[0]
    assert float(mean.min()) >= 5, "too few expected draws per cell for the chi-square approximation"
    return float(((observed - mean) ** 2 / mean).sum())


def test_sampling_statistics_match_the_target() -> None:
    """20000 rows of one k = 3 call, V = 8, fixed seed. Token i, among rows that accepted the
    drafts before it (all rows for i = 0; the bonus token for i = 2), is distributed as p_i.
    Each statistic is compared with the chi-square 1 - 1e-4 quantile (7 degrees of freedom), so a
    correct sampler fails one of the three with probability at most 3e-4 over seeds."""
    n, k, v = 20000, 3, 8
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(k, v, generator=g), -1)  # [k, V], the same target for every row
    q = torch.softmax(torch.randn(k - 1, v, generator=g), -1)  # [k-1, V]
    draft = speculation.draw(q.expand(n, k - 1, v), torch.rand(n, k - 1, generator=g))  # d_i ~ q_i
    uniforms = torch.rand(n, k, generator=g)
    tokens, counts = speculation.sample_accept(p.expand(n, k, v), q.expand(n, k - 1, v), draft, uniforms)
    assert 0.2 < float((counts > 1).double().mean()) < 0.9  # both paths are exercised
    for i in range(k):
        reached = tokens[counts > i, i]
        assert _chi2(reached, p[i].double()) < CHI2_DF7_UPPER_1E4, f"token {i}"


# --- degenerate inputs -------------------------------------------------------------------------


def test_a_draft_token_the_draft_gave_probability_zero() -> None:
    """q(d) = 0 divides nothing: accepted where p(d) > 0, rejected where p(d) = 0 too."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]).expand(2, 2, 4)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]).expand(2, 1, 4)
    tokens, counts = speculation.sample_accept(p, q, torch.tensor([[1], [2]]), torch.tensor([[0.99, 0.9]] * 2))
    assert counts.tolist() == [2, 1]
    assert tokens.tolist() == [[1, 3], [1, -1]]  # row 1: the residual max(0, p - q) is all on token 1


def test_equal_distributions_accept_everything_and_fall_back_to_p() -> None:
    p = torch.tensor([[[0.0, 0.3, 0.0, 0.7]] * 3]).expand(3, 3, 4)
    torch.testing.assert_close(speculation.residual(p, p), p, rtol=0, atol=0)
    uniforms = torch.tensor([[0.999, 0.999, 0.1], [0.0, 0.5, 0.5], [0.5, 0.5, 0.9]])
    draft = torch.tensor([[3, 1], [1, 3], [2, 3]])  # row 2: a token p and q both give 0
    tokens, counts = speculation.sample_accept(p, p[:, 1:], draft, uniforms)
    assert counts.tolist() == [3, 3, 1]
    assert tokens.tolist() == [[3, 1, 1], [1, 3, 3], [3, -1, -1]]  # row 2: drawn from p, no NaN


def test_residual_is_normalised() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.1, 0.6, 0.0, 0.3])
    torch.testing.assert_close(speculation.residual(p, q), torch.tensor([0.4, 0.0, 0.2, 0.0]) / 0.6)


def test_draw_never_picks_a_token_of_probability_zero() -> None:
    dist = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    edges = torch.tensor([0.0, 0.25, 0.5 - 1e-7, 0.5, 0.75, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))])
    assert speculation.draw(dist.expand(6, 5), edges).tolist() == [1, 1, 1, 3, 3, 3]
    u64 = torch.tensor([1 - 1e-12], dtype=torch.float64)  # would round to 1.0 in fp32
    assert speculation.draw(dist[None], u64).tolist() == [3]


@settings(deadline=None)
@given(
    b=st.integers(1, 3),
    k=st.integers(1, 4),
    v=st.integers(2, 9),
    seed=st.integers(0, 2**31 - 1),
    top_k=st.integers(0, 9),
    top_p=st.floats(0.05, 1.0),
)
def test_temperature_zero_is_greedy_for_any_draft(b: int, k: int, v: int, seed: int, top_k: int, top_p: float) -> None:
    """A one-hot target accepts exactly the draft tokens equal to its argmax, whatever q was."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k, v, generator=g)
    p = speculation.probs(logits, torch.tensor([[float(top_k), top_p, 0.0]] * b))
    torch.testing.assert_close(p, torch.nn.functional.one_hot(logits.argmax(-1), v).float(), rtol=0, atol=0)
    q = speculation.probs(torch.randn(b, k - 1, v, generator=g), torch.tensor([[float(top_k), top_p, 1.0]] * b))
    best = logits.argmax(-1)
    draft = torch.where(
        torch.rand(b, k - 1, generator=g) < 0.7, best[:, :-1], torch.randint(v, (b, k - 1), generator=g)
    )
    got = speculation.sample_accept(p, q, draft, torch.rand(b, k, generator=g))
    want = speculation.greedy_accept(logits, draft)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_probs_is_the_samplers_distribution_over_the_vocabulary() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 10, generator=g)
    plain = speculation.probs(logits, torch.tensor([[0.0, 1.0, 0.7]] * 2), global_topk=0)
    torch.testing.assert_close(plain, torch.softmax(logits / 0.7, -1))
    top2 = speculation.probs(logits, torch.tensor([[2.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    torch.testing.assert_close(top2.sum(-1), torch.ones(2, 3))
    assert ((top2[0] > 0).sum(-1) == 2).all() and ((top2[1] > 0).sum(-1) == 10).all()
    ids = torch.topk(logits[0], 2, dim=-1).indices
    torch.testing.assert_close(top2[0].gather(-1, ids), torch.softmax(logits[0].gather(-1, ids), -1))
    # every token the ordinary sampler can return for row 0 has mass here, and no other
    drawn = {
        int(sampling.sample(logits[0], torch.tensor([[2.0, 1.0, 1.0]] * 3), torch.full((3,), u))[0])
        for u in (0.0, 0.99)
    }
    assert drawn == set((top2[0, 0] > 0).nonzero()[:, 0].tolist())


# --- export ------------------------------------------------------------------------------------


class _Verify(torch.nn.Module):
    """Logits to distributions to accepted tokens, as a backend would trace the verification."""

    def forward(
        self, target: Tensor, drafted: Tensor, draft: Tensor, params: Tensor, uniforms: Tensor
    ) -> tuple[Tensor, ...]:
        p, q = speculation.probs(target, params), speculation.probs(drafted, params)
        tokens, counts = speculation.sample_accept(p, q, draft, uniforms)
        greedy_tokens, greedy_counts = speculation.greedy_accept(target, draft)
        return tokens, counts, greedy_tokens, greedy_counts


@pytest.mark.parametrize("strict", [False, True])
def test_exports_with_static_shapes(strict: bool) -> None:
    b, k, v = 4, 3, 6
    g = torch.Generator().manual_seed(7)

    def inputs() -> tuple[Tensor, ...]:
        target = torch.randn(b, k, v, generator=g)
        draft = torch.where(
            torch.rand(b, k - 1, generator=g) < 0.6,
            target[:, :-1].argmax(-1),
            torch.randint(v, (b, k - 1), generator=g),
        )
        params = torch.tensor([[0.0, 1.0, 1.0], [3.0, 0.9, 0.7], [0.0, 1.0, 0.0], [2.0, 1.0, 1.5]])
        return target, torch.randn(b, k - 1, v, generator=g), draft, params, torch.rand(b, k, generator=g)

    module = _Verify()
    ep = torch.export.export(module, inputs(), strict=strict)
    counts: set[int] = set()
    for _ in range(8):  # other values, same shapes: the graph must not depend on them
        x = inputs()
        got, want = ep.module()(*x), module(*x)
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        counts |= set(want[1].tolist()) | set(want[3].tolist())
    assert counts == {1, 2, 3}  # rows accepted every possible count across the runs

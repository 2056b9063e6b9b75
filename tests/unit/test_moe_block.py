"""The MoE block program: transformers parity (Mixtral, Qwen3-MoE, DBRX), the three paths agreeing,
expert parallelism, NxD's capacity dropping by hand, padded tokens, router properties, export."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nxdi.core.programs import moe
from nxdi.core.programs.moe import Experts, MoEOptions, MoEPath

PATHS = list(MoEPath)


def _init(module: torch.nn.Module, seed: int) -> None:
    """HF expert parameters are created with torch.empty: give them seeded values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _random_experts(
    x_total: int, hidden: int, ffn: int, seed: int, *, bias: bool = False, dtype: torch.dtype = torch.float32
) -> Experts:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Tensor:
        return (torch.randn(shape, generator=g) * 0.5).to(dtype)

    return Experts(
        router=r(x_total, hidden),
        gate=r(x_total, ffn, hidden),
        up=r(x_total, ffn, hidden),
        down=r(x_total, hidden, ffn),
        router_bias=r(x_total) if bias else None,
    )


def _slice(e: Experts, first: int, count: int) -> Experts:
    """This rank's experts under expert parallelism: all of the router, `count` experts from `first`."""
    part = slice(first, first + count)
    return dataclasses.replace(e, gate=e.gate[part], up=e.up[part], down=e.down[part])


def _full(options: MoEOptions, num_experts: int) -> MoEOptions:
    """A capacity factor that drops nothing (C = T) for the capacity path."""
    return dataclasses.replace(options, capacity_factor=num_experts / options.top_k)


def _run(x: Tensor, e: Experts, options: MoEOptions, path: MoEPath, **kw: Any) -> Tensor:
    if path is MoEPath.CAPACITY and options.capacity_factor is None:
        options = _full(options, e.router.shape[0])
    return moe.forward(x, e, options, path=path, **kw).hidden


# --- transformers parity ---------------------------------------------------------------------


def _hf_fused(block: Any, router: Tensor) -> Experts:
    """Experts from a transformers block storing fused gate_up_proj [X, 2F, E] and down_proj [X, E, F]."""
    gate, up = block.experts.gate_up_proj.detach().chunk(2, dim=1)
    return Experts(router=router.detach(), gate=gate, up=up, down=block.experts.down_proj.detach())


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("path", PATHS)
def test_matches_mixtral(tokens: int, path: MoEPath) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(config).eval()
    _init(block, seed=tokens)
    x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = block(x).reshape(tokens, 16)
    got = _run(x[0], _hf_fused(block, block.gate.weight), MoEOptions(top_k=2), path)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_qwen3_moe(tokens: int, norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm
    )
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    _init(block, seed=100 + tokens)
    x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = block(x).reshape(tokens, 16)
    experts = _hf_fused(block, block.gate.weight)
    for path in PATHS:
        got = _run(x[0], experts, MoEOptions(top_k=3, normalize_top_k=norm), path)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("p", [1.0, 2.0, None])
def test_matches_dbrx(tokens: int, p: float | None) -> None:
    from transformers import DbrxConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    ffn = {"ffn_hidden_size": 12, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": p}
    block = DbrxFFN(DbrxConfig(d_model=16, ffn_config=ffn)).eval()
    _init(block, seed=200 + tokens)
    x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = block(x).reshape(tokens, 16)
    mlp = block.experts.mlp  # w1 (gate), v1 (up), w2 (down, transposed) as [X*F, E]: restacked per expert
    experts = Experts(
        router=block.router.layer.weight.detach(),
        gate=mlp.w1.detach().view(4, 12, 16),
        up=mlp.v1.detach().view(4, 12, 16),
        down=mlp.w2.detach().view(4, 12, 16).transpose(1, 2),
    )
    options = MoEOptions(top_k=2, normalize_top_k=p is not None, normalize_p=p or 1.0)
    for path in PATHS:
        torch.testing.assert_close(_run(x[0], experts, options, path), want, rtol=0, atol=1e-5)


# --- paths and expert parallelism ------------------------------------------------------------

OPTION_CASES = {
    "default": MoEOptions(top_k=2),
    "gpt-oss swiglu": MoEOptions(
        top_k=2,
        activation="sigmoid",
        glu_type="swiglu",
        hidden_act_scaling_factor=1.702,
        hidden_act_bias=1.0,
        gate_clamp_upper=0.5,
        up_clamp_lower=-0.5,
        up_clamp_upper=0.5,
    ),
    "glu scaled": MoEOptions(top_k=3, activation="gelu", hidden_act_scaling_factor=0.5, hidden_act_bias=0.25),
    "sigmoid router": MoEOptions(top_k=2, router_act="sigmoid", normalize_top_k=False),
    "early modulation": MoEOptions(
        top_k=1, router_act="sigmoid", normalize_top_k=False, early_affinity_modulation=True
    ),
    "early modulation k2": MoEOptions(top_k=2, early_affinity_modulation=True, hidden_act_bias=0.5),
    "p2": MoEOptions(top_k=2, normalize_p=2.0),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("tokens", [1, 5])
def test_paths_agree_and_split_over_ranks(case: str, tokens: int) -> None:
    options = OPTION_CASES[case]
    e = _random_experts(8, 16, 12, seed=tokens, bias=True)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(3))
    want = _run(x, e, options, MoEPath.ALL_EXPERTS)
    assert want.abs().max() > 0
    for path in PATHS:
        torch.testing.assert_close(_run(x, e, options, path), want, rtol=0, atol=1e-5)
        halves = [_run(x, _slice(e, first, 4), options, path, first_expert=first) for first in (0, 4)]
        torch.testing.assert_close(halves[0] + halves[1], want, rtol=0, atol=1e-5)


def test_paths_agree_in_bf16() -> None:
    e = _random_experts(8, 32, 16, seed=1, dtype=torch.bfloat16)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    outs = [_run(x, e, MoEOptions(top_k=2), p) for p in PATHS]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=2e-2, atol=2e-2)


def test_choose_path_and_capacity_follow_nxd() -> None:
    o = MoEOptions(top_k=2)
    assert moe.choose_path(3, 8, o) is MoEPath.SELECTIVE  # 6 expert loads < 8 experts
    assert moe.choose_path(4, 8, o) is MoEPath.ALL_EXPERTS
    assert moe.choose_path(4, 8, dataclasses.replace(o, selective_max_tokens=8)) is MoEPath.SELECTIVE
    c = dataclasses.replace(o, capacity_factor=1.25)
    assert moe.expert_capacity(10, 8, c) == math.ceil(10 * 2 * 1.25 / 8) == 4
    assert moe.expert_capacity(2, 8, dataclasses.replace(o, capacity_factor=3.9)) == 2  # capped at T
    assert moe.expert_capacity(10, 8, dataclasses.replace(o, capacity_factor=4.0)) is None  # >= X / k: full
    assert moe.choose_path(1, 8, c) is MoEPath.CAPACITY
    assert moe.choose_path(1, 8, c, token_generation=True) is MoEPath.SELECTIVE
    assert moe.choose_path(16, 8, c, token_generation=True) is MoEPath.ALL_EXPERTS


# --- capacity dropping and padded tokens, by hand --------------------------------------------


def _expert_fn(e: Experts, i: int, v: Tensor) -> Tensor:
    """Expert i of `e` on one token v [E]: down (silu(gate v) * up v), written out."""
    return e.down[i] @ (F.silu(e.gate[i] @ v) * (e.up[i] @ v))


def test_capacity_drops_later_tokens_top1() -> None:
    # Router = identity, so logits = x: tokens 0, 1, 2 pick expert 0, token 3 expert 1. T=4, k=1,
    # X=2, capacity_factor=1: C = min(4, ceil(4 * 1 * 1 / 2)) = 2, so token 2 overflows expert 0.
    e = dataclasses.replace(_random_experts(2, 2, 3, seed=5), router=torch.eye(2))
    x = torch.tensor([[2.0, 0.0], [1.0, 0.5], [0.5, -1.0], [0.0, 1.5]])
    options = MoEOptions(top_k=1, normalize_top_k=False, capacity_factor=1.0)
    a = torch.softmax(x, dim=-1)  # top-1 affinity is the winner's probability
    want = torch.stack(
        [
            a[0, 0] * _expert_fn(e, 0, x[0]),
            a[1, 0] * _expert_fn(e, 0, x[1]),
            torch.zeros(2),
            a[3, 1] * _expert_fn(e, 1, x[3]),
        ]
    )
    out = moe.forward(x, e, options)
    assert out.expert_index[:, 0].tolist() == [0, 0, 0, 1]
    torch.testing.assert_close(out.hidden, want, rtol=0, atol=1e-6)
    # Padding token 0 frees its slot: token 2 now fits, token 0 outputs zero.
    mask = torch.tensor([False, True, True, True])
    masked = moe.forward(x, e, options, token_mask=mask).hidden
    want_masked = torch.stack([torch.zeros(2), want[1], a[2, 0] * _expert_fn(e, 0, x[2]), want[3]])
    torch.testing.assert_close(masked, want_masked, rtol=0, atol=1e-6)


def test_capacity_renormalises_survivors_top2() -> None:
    # X=4, k=2, T=3, capacity_factor=1: C = min(3, ceil(3 * 2 / 4)) = 2. Every token picks expert 0
    # first (logit 3) and a second expert (logit 2): 1, 2, 3. Expert 0 takes tokens 0 and 1; token 2
    # loses it and, renormalised, gives expert 3 its whole weight.
    e = dataclasses.replace(_random_experts(4, 4, 3, seed=6), router=torch.eye(4))
    x = torch.tensor([[3.0, 2.0, 0.0, 0.0], [3.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 2.0]])
    hi, lo = math.e / (math.e + 1), 1 / (math.e + 1)  # e^3 / (e^3 + e^2) and e^2 / (e^3 + e^2)
    want = torch.stack(
        [
            hi * _expert_fn(e, 0, x[0]) + lo * _expert_fn(e, 1, x[0]),
            hi * _expert_fn(e, 0, x[1]) + lo * _expert_fn(e, 2, x[1]),
            1.0 * _expert_fn(e, 3, x[2]),
        ]
    )
    options = MoEOptions(top_k=2, capacity_factor=1.0)
    torch.testing.assert_close(moe.forward(x, e, options).hidden, want, rtol=0, atol=1e-6)
    # Without renormalising, token 2 keeps its original (smaller) weight for expert 3.
    raw = moe.forward(x, e, dataclasses.replace(options, normalize_top_k=False)).hidden
    p = torch.softmax(x[2], dim=-1)[3]
    torch.testing.assert_close(raw[2], p * _expert_fn(e, 3, x[2]), rtol=0, atol=1e-6)
    # Expert parallelism: the rank holding experts 2, 3 sees the same dropping.
    part = moe.forward(x, _slice(e, 2, 2), options, first_expert=2).hidden
    torch.testing.assert_close(part[2], want[2], rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("early", [False, True])
def test_masked_tokens_output_zero(path: MoEPath, early: bool) -> None:
    e = _random_experts(4, 8, 6, seed=2)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(5))
    options = MoEOptions(top_k=2, early_affinity_modulation=early, hidden_act_bias=0.5, activation="sigmoid")
    mask = torch.tensor([True, False, True, False, True])
    got = _run(x, e, options, path, token_mask=mask)
    assert (got[~mask] == 0).all()
    torch.testing.assert_close(got[mask], _run(x[mask], e, options, path), rtol=0, atol=1e-5)


# --- router properties -----------------------------------------------------------------------


@settings(deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 9),
    st.data(),
    st.sampled_from(["softmax", "sigmoid"]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_route_properties(tokens: int, num_experts: int, data: st.DataObject, act: str, norm: bool, seed: int) -> None:
    k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    e = Experts(
        router=torch.randn(num_experts, 8, generator=g),
        gate=torch.zeros(1, 1, 8),
        up=torch.zeros(1, 1, 8),
        down=torch.zeros(1, 8, 1),
    )
    x = torch.randn(tokens, 8, generator=g)
    logits, a, idx = moe.route(x, e, MoEOptions(top_k=k, router_act=act, normalize_top_k=norm))
    assert logits.shape == (tokens, num_experts) and a.shape == idx.shape == (tokens, k)
    assert idx.dtype == torch.int64 and ((idx >= 0) & (idx < num_experts)).all()
    assert all(len(set(row)) == k for row in idx.tolist())
    assert (a >= 0).all()
    if norm:
        torch.testing.assert_close(a.sum(-1), torch.ones(tokens), rtol=0, atol=1e-5)
    # The chosen experts are the k best: every unchosen logit is at most the smallest chosen one.
    chosen_min = logits.gather(1, idx).min(-1).values
    unchosen = logits.scatter(1, idx, float("-inf"))
    assert (unchosen.max(-1).values <= chosen_min).all()


def test_bad_options_and_shapes_raise() -> None:
    with pytest.raises(ValueError, match="router_act"):
        MoEOptions(top_k=1, router_act="relu")
    with pytest.raises(ValueError, match="glu_type"):
        MoEOptions(top_k=1, glu_type="geglu")
    with pytest.raises(ValueError, match="activation"):
        MoEOptions(top_k=1, activation="tanh")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEOptions(top_k=1, capacity_factor=0.0)
    e = _random_experts(4, 8, 6, seed=0)
    with pytest.raises(ValueError, match="exceed"):
        moe.forward(torch.zeros(2, 8), _slice(e, 0, 2), MoEOptions(top_k=1), first_expert=3)
    with pytest.raises(ValueError, match="top_k"):
        moe.forward(torch.zeros(2, 8), e, MoEOptions(top_k=5))
    with pytest.raises(ValueError, match="do not"):
        moe.forward(torch.zeros(2, 7), e, MoEOptions(top_k=1))


# --- export ----------------------------------------------------------------------------------


class _Bound(torch.nn.Module):
    """The block with its weights as parameters, as a program is traced."""

    def __init__(self, e: Experts, options: MoEOptions, path: MoEPath) -> None:
        super().__init__()
        self.w = torch.nn.ParameterDict(
            {f.name: torch.nn.Parameter(getattr(e, f.name), requires_grad=False) for f in dataclasses.fields(e)}
        )
        self.options, self.path = options, path

    def forward(self, x: Tensor, mask: Tensor, first: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = Experts(**dict(self.w))
        out = moe.forward(x, e, self.options, token_mask=mask, path=self.path, first_expert=first)
        return out.hidden, out.router_logits, out.expert_index


@pytest.mark.parametrize("path", PATHS)
def test_exports_with_static_shapes(path: MoEPath) -> None:
    e = _random_experts(4, 8, 6, seed=3, bias=True)
    options = MoEOptions(top_k=2, capacity_factor=1.0 if path is MoEPath.CAPACITY else None)
    module = _Bound(_slice(e, 2, 2), options, path)
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 8, generator=g), torch.tensor([True] * 5 + [False])
    ep = torch.export.export(module, (x, mask, torch.tensor(2)), strict=False)
    x2 = torch.randn(6, 8, generator=g)  # other values, same shape: the graph must not depend on them
    for first in (2, 0):  # nor on the rank's first expert, a tensor input as a rank's program has it
        rank = torch.tensor(first)
        for got, want in zip(ep.module()(x2, mask, rank), module(x2, mask, rank), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

"""Load-time rewrites that fuse a decode step's small bf16 ops into nxdi's one-op kernels. Effects: none
beyond the graph (the kernels are `kernels/`).

In a decode step every op runs just after a linear has streamed megabytes of weights through the
caches, where each torch dispatch costs tens of microseconds instead of a few (docs/cpu-backend.md,
"Decode steps outside the linears"). These rewrites turn the ops the decoder dispatches several at
a time into one call each, when this CPU runs the kernels (`kernels.load()`):

- `fused_rms_norms`: `w * rms_norm(x)` (seven dispatches), the same two roundings;
- `fused_residual_norms`: the residual sum before such a norm, into the same op (one fewer);
- `fused_ropes`: `x * cos + roll(x, D/2) * sin` (four), the same bits;
- `decode_attentions`: `scaled_dot_product_attention` over a decode step's few query rows, torch's
  roundings within a bf16 step.

`cpu_passes` holds the other rewrites of the bound graph (linears, cache writes, constants), and
`cpu_attention_blocks` the one that makes a decode step's whole attention glue one op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from nxdi.effects.backends import kernels
from nxdi.effects.backends.cpu_passes import _MUL, _val

_RMS_NORM = torch.ops.aten.rms_norm.default


def fused_rms_norms(gm: fx.GraphModule) -> int:
    """Rewrite `w * rms_norm(x, [N], eps=eps)` (`nxdi.core.programs.layers.rms_norm`) with x and w
    bf16 into nxdi's one-op kernel (`kernels/bf16_pointwise.cpp`; the same two roundings), when this CPU
    runs the kernels. Returns the count.

    Why: in a decode step every op runs just after a linear streamed megabytes of weights through
    the caches, and the seven dispatches of torch's norm and product then cost 100-190 us per norm
    at 4 rows of 2048, where the one op costs a few (docs/cpu-backend.md)."""
    found = [m for m in map(_weighted_bf16_norm, gm.graph.nodes) if m is not None]
    if not found or not kernels.load():
        return 0
    for norm, mul, x, w, eps in found:
        replace_run(gm, mul, torch.ops.nxdi_kernels.rms_norm.default, (x, w, eps), (norm,))
    return len(found)


def fused_residual_norms(gm: fx.GraphModule) -> int:
    """Rewrite `s = a + b` of bf16 a, b of one shape, normed by nxdi's `rms_norm(s, w, eps)` (after
    `fused_rms_norms`), into one `add_rms_norm(a, b, w, eps)` giving both s and the norm (the same
    bits: torch's rounded sum, then the norm's). Returns the count.

    Why: the decoder's residual sum comes right after the o or down linear, where its dispatch costs
    tens of microseconds (docs/cpu-backend.md); s is still read by the next residual sum."""
    found = [m for m in map(_residual_norm, gm.graph.nodes) if m is not None]
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    count = 0
    for add, norm in found:
        a, b = add.args
        w, eps = norm.args[1], norm.args[2]
        if not isinstance(w, fx.Node) or order[w] > order[add]:
            continue  # the weight is read where the sum was computed
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_function(torch.ops.nxdi_kernels.add_rms_norm.default, (a, b, w, eps))
            total = gm.graph.call_function(operator.getitem, (fused, 0))
            normed = gm.graph.call_function(operator.getitem, (fused, 1))
        total.meta, normed.meta = dict(add.meta), dict(norm.meta)
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        gm.graph.erase_node(norm)
        gm.graph.erase_node(add)
        count += 1
    return count


def _residual_norm(norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """`(add, norm)` when `norm` is nxdi's `rms_norm(add, w, eps)` and `add` is `a + b` of bf16
    nodes of one shape (no alpha); else None."""
    if str(norm.target) != "nxdi_kernels.rms_norm.default":  # present only once the kernels loaded
        return None
    add = norm.args[0]
    if not isinstance(add, fx.Node) or add.target is not _ADD or len(add.args) != 2 or add.kwargs:
        return None
    a_val, b_val = _val(add.args[0]), _val(add.args[1])
    if not (_is_bf16(add.args[0]) and _is_bf16(add.args[1]) and _is_bf16(add)) or a_val is None or b_val is None:
        return None
    return (add, norm) if a_val.shape == b_val.shape and all(isinstance(t, fx.Node) for t in add.args) else None


_SILU = torch.ops.aten.silu.default
_SWIGLU_OF = {
    "nxdi_kernels.int8_linear.default": ("int8_swiglu", 2),
    "nxdi_kernels.fp8_linear.default": ("fp8_swiglu", 2),
    "nxdi_kernels.bf16_linear.default": ("bf16_swiglu", 1),
}
"""nxdi's decode linear (`cpu_passes.quantized_weight_linears`, `cpu_passes.bf16_weight_linears`)
-> (its SwiGLU op, how many of its args after x are the weight: w and its scales, or w alone)."""


def fused_swiglus(gm: fx.GraphModule) -> int:
    """Rewrite `silu(linear(x, w_gate)) * linear(x, w_up)` over nxdi's bf16, int8 or float8 decode
    linears (bf16 x, no bias, each result used only there) into one `bf16_swiglu`, `int8_swiglu` or
    `fp8_swiglu` (`kernels/bf16_linear.cpp`, `kernels/quantized_linear.cpp`; the same bits: each
    linear's rows are its kernel's sums, and torch's silu is reproduced on every bf16 input).
    Returns the count.

    Why: the MLP's two linears and two pointwise ops become one call and one parallel region, where
    each dispatch after a linear costs tens of microseconds (docs/cpu-backend.md)."""
    found = [m for m in map(_swiglu, gm.graph.nodes) if m is not None]
    for mul, op, args, dead in found:
        replace_run(gm, mul, getattr(torch.ops.nxdi_kernels, op).default, args, dead)
    return len(found)


def _swiglu(mul: fx.Node) -> tuple[fx.Node, str, tuple[object, ...], tuple[fx.Node, ...]] | None:
    """`(mul, the SwiGLU op's name, its args, (silu, gate, up))` when `mul` is a SwiGLU
    `fused_swiglus` takes, else None. The args: `(x, w_gate, w_up)` over bf16 weights,
    `(x, w_gate, s_gate, w_up, s_up)` over quantized ones."""
    if mul.target is not _MUL or len(mul.args) != 2 or mul.kwargs or not _is_bf16(mul):
        return None
    for silu, up in (mul.args, mul.args[::-1]):
        if not isinstance(silu, fx.Node) or silu.target is not _SILU or list(silu.users) != [mul]:
            continue
        gate = silu.args[0]
        if not (_plain_decode_linear(gate, silu) and _plain_decode_linear(up, mul)):
            continue
        assert isinstance(gate, fx.Node) and isinstance(up, fx.Node)
        x, w_gate = gate.args[:2]
        w_val, u_val = _val(w_gate), _val(up.args[1])
        if up.args[0] is not x or up.target is not gate.target or not _is_bf16(x) or w_val is None or u_val is None:
            continue
        if w_val.shape != u_val.shape or w_val.dtype != u_val.dtype:
            continue
        op, k = _SWIGLU_OF[str(gate.target)]
        return mul, op, (x, *gate.args[1 : 1 + k], *up.args[1 : 1 + k]), (silu, gate, up)
    return None


def _plain_decode_linear(node: object, user: fx.Node) -> bool:
    """`node` is nxdi's bf16, int8 or float8 decode linear without a bias, read only by `user`."""
    if not isinstance(node, fx.Node) or str(node.target) not in _SWIGLU_OF or list(node.users) != [user]:
        return False
    bias = 1 + _SWIGLU_OF[str(node.target)][1]  # the bias's place in the args, after x and the weight
    return len(node.args) == bias or (len(node.args) == bias + 1 and node.args[bias] is None)


def replace_run(
    gm: fx.GraphModule,
    last: fx.Node,
    kernel: Callable[..., object],
    args: tuple[object, ...],
    dead: tuple[fx.Node, ...],
) -> None:
    """Put `kernel(*args)` where `last` was (its users now read the kernel's result) and erase `last`
    and the nodes only it used (`dead`, users first)."""
    with gm.graph.inserting_before(last):
        fused = gm.graph.call_function(kernel, args)
    fused.meta = dict(last.meta)
    last.replace_all_uses_with(fused)
    for node in (last, *dead):
        gm.graph.erase_node(node)


def _weighted_bf16_norm(norm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, float] | None:
    """`(norm, mul, x, w, eps)` when `norm` is `rms_norm(x, [N], None, eps)` of bf16 x whose one user
    is `w * norm` (either order) with w bf16 [N]; else None."""
    if norm.target is not _RMS_NORM or len(norm.users) != 1:
        return None
    x, shape, *rest = norm.args
    weight = rest[0] if rest else norm.kwargs.get("weight")
    eps = rest[1] if len(rest) > 1 else norm.kwargs.get("eps")
    x_val = _val(x)
    if x_val is None or x_val.dtype != torch.bfloat16 or weight is not None or not isinstance(eps, float):
        return None
    (mul,) = norm.users
    w = mul.args[1] if mul.args[0] is norm else mul.args[0]
    w_val = _val(w)
    if mul.target is not _MUL or w_val is None or w_val.dtype != torch.bfloat16 or w_val.dim() != 1:
        return None
    if list(shape) != [x_val.shape[-1]] or w_val.shape[0] != x_val.shape[-1] or not isinstance(x, fx.Node):
        return None
    return norm, mul, x, w, eps


_ROLL = torch.ops.aten.roll.default
_ADD = torch.ops.aten.add.Tensor


def fused_ropes(gm: fx.GraphModule) -> int:
    """Rewrite `x * cos + roll(x, D/2, -1) * sin` (`nxdi.core.programs.layers.apply_rope`) with x, cos
    and sin bf16 into nxdi's one-op kernel (`kernels/bf16_pointwise.cpp`; the same roundings, so the
    same bits), when this CPU runs the kernels. Returns the count.

    Why: the four dispatches (two products, the roll, the sum) each run just after the qkv linear
    streamed its weights, where a dispatch costs tens of microseconds (docs/cpu-backend.md)."""
    found = [m for m in map(_bf16_rope, gm.graph.nodes) if m is not None]
    if not found or not kernels.load():
        return 0
    for add, x, cos, sin, dead in found:
        replace_run(gm, add, torch.ops.nxdi_kernels.rope.default, (x, cos, sin), dead)
    return len(found)


def _bf16_rope(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, tuple[fx.Node, ...]] | None:
    """`(add, x, cos, sin, (the products and the roll))` when `add` is `x * cos + roll(x, D/2, -1) *
    sin` (either order in each op) of bf16 x [..., D], cos and sin of x's rank broadcasting to it,
    a contiguous result, and the products and the roll used only there; else None."""
    if add.target is not _ADD or len(add.args) != 2 or add.kwargs or not _is_bf16(add, contiguous=True):
        return None
    for plain, turned in (add.args, add.args[::-1]):
        if not (_sole_user_mul(plain, add) and _sole_user_mul(turned, add)):
            continue
        for roll, sin in (turned.args, turned.args[::-1]):
            x = _half_roll_of(roll)
            if x is None or x not in plain.args:
                continue
            cos = plain.args[1] if plain.args[0] is x else plain.args[0]
            if _is_bf16(x) and _broadcasts_to(cos, x) and _broadcasts_to(sin, x):
                return add, x, cos, sin, (plain, turned, roll)
    return None


def _half_roll_of(roll: object) -> fx.Node | None:
    """x when `roll` is `roll(x, [D/2], [-1])` of x [..., D] (D even) with one user; else None."""
    if not isinstance(roll, fx.Node) or roll.target is not _ROLL or len(roll.args) != 3 or roll.kwargs:
        return None
    x, shifts, dims = roll.args
    x_val = _val(x)
    if (
        not isinstance(shifts, list | tuple)
        or not isinstance(dims, list | tuple)
        or x_val is None
        or x_val.dim() == 0
        or x_val.shape[-1] % 2
        or len(roll.users) != 1
    ):
        return None
    if list(shifts) != [x_val.shape[-1] // 2] or list(dims) not in ([-1], [x_val.dim() - 1]):
        return None
    return x if isinstance(x, fx.Node) else None


def _sole_user_mul(node: object, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and node.target is _MUL and len(node.args) == 2 and list(node.users) == [user]


def _is_bf16(node: object, *, contiguous: bool = False) -> bool:
    val = _val(node)
    return val is not None and val.dtype == torch.bfloat16 and (not contiguous or val.is_contiguous())


def _broadcasts_to(t: object, x: object) -> bool:
    """t is a bf16 node of x's rank and last dim whose every other dim is 1 or x's."""
    t_val, x_val = _val(t), _val(x)
    if t_val is None or x_val is None or t_val.dtype != torch.bfloat16 or t_val.dim() != x_val.dim():
        return False
    return t_val.shape[-1] == x_val.shape[-1] and all(
        a in (1, b) for a, b in zip(t_val.shape, x_val.shape, strict=True)
    )


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_SDPA_DEFAULTS = {"dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
DECODE_ATTENTION_MAX_ROWS = 64
"""Query rows per (sequence, head) up to which attention runs nxdi's decode kernel: a decode step's
tokens times the GQA group folded into them (8 rows for the 1.1B shape at one token; speculation's
k + 1 tokens multiply them). Longer ones (prefill, larger trees) keep torch's flash attention,
whose GEMMs are faster there."""


def decode_attentions(gm: fx.GraphModule) -> int:
    """Rewrite `scaled_dot_product_attention(q, k, v, mask)` of bf16 q [B, H, L, D] and k, v [B, H, T, D]
    (L <= `DECODE_ATTENTION_MAX_ROWS`, D a multiple of 16 up to 256) with a bool mask and torch's
    other defaults into nxdi's kernel (`kernels/decode_attention.cpp`; torch's roundings, within a
    bf16 step), when this CPU runs the kernels. Returns the count.

    Why: the attention runs just after the qkv linear streamed its weights, where torch's op (its
    dispatch, mask conversion and GEMM set-up) cost 120-230 us per call at 1 x 144 slots, and this
    one 70-105 (docs/cpu-backend.md)."""
    found = [(node, args) for node in gm.graph.nodes if (args := _decode_attention_args(node)) is not None]
    if not found or not kernels.load():
        return 0
    for node, args in found:
        node.target, node.args, node.kwargs = torch.ops.nxdi_kernels.decode_attention.default, args, {}
    return len(found)


def _decode_attention_args(node: fx.Node) -> tuple[object, object, object, object] | None:
    """(q, k, v, mask) when `node` is an attention `decode_attentions` takes; else None."""
    if node.target is not _SDPA:
        return None
    given = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
    if any(given.get(name, value) != value for name, value in _SDPA_DEFAULTS.items()):
        return None
    q, k, v, mask = (given.get(name) for name in _SDPA_ARGS[:4])
    vals = [_val(t) for t in (q, k, v, mask)]
    if any(val is None or val.dim() != 4 for val in vals):
        return None
    q_val, k_val, v_val, m_val = vals
    b, h, rows, d = q_val.shape
    if any(val.dtype != torch.bfloat16 for val in (q_val, k_val, v_val)) or m_val.dtype != torch.bool:
        return None
    if k_val.shape != v_val.shape or tuple(k_val.shape[:2]) != (b, h) or k_val.shape[3] != d:
        return None
    full = (b, h, rows, k_val.shape[2])
    if (
        rows > DECODE_ATTENTION_MAX_ROWS
        or d % 16
        or d > 256
        or any(a not in (1, f) for a, f in zip(m_val.shape, full, strict=True))
    ):
        return None
    return q, k, v, mask

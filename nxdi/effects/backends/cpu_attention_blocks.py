"""Load-time rewrite of a decode step's attention glue into one op. Effects: none beyond the graph.

Between the qkv and o projections a decoder layer's decode step is about 18 graph nodes: the view of
the fused qkv output, its q/k and v slices, RoPE, the k and v cache writes (int16 scatters, in
place), the GQA fold of q, nxdi's decode attention and the unfold of its result. Each node is a
torch dispatch from Python, and each runs just after a linear has streamed its weights through the
caches, where a dispatch costs several microseconds instead of one. `fused_attention_blocks` turns
that run into one call of `nxdi_kernels::attention_block`, which makes the same ATen and nxdi calls
in the same order from C++ (the same results and cache writes, bit for bit).

Measured on the AMD Zen 4 machine (docs/cpu-backend.md, "Decode steps outside the linears (AMD)"):
taking the whole run out of the 1.1B int8 step (wrong tokens; an upper bound) saved 3.2 ms of a
33-40 ms step, and the op keeps the part of that spent in Python.

It runs after `cpu_passes.scatter_half_floats_as_bits` (it matches that pass's in-place scatters)
and only where the run has exactly the decoder's form; anything else (biases, q/k norms, float8 or
block caches, other folds) is left as it is.
"""

from __future__ import annotations

import attrs
import torch
from torch import fx

from nxdi.effects.backends.cpu_fusions import replace_run
from nxdi.effects.backends.cpu_passes import scatter_bits_

_VIEW = torch.ops.aten.view.default
_SLICE = torch.ops.aten.slice.Tensor
_PERMUTE = torch.ops.aten.permute.default
_RESHAPE = torch.ops.aten.reshape.default
_TRANSPOSE = torch.ops.aten.transpose.int
_ROPE = "nxdi_kernels.rope.default"
_ATTENTION = "nxdi_kernels.decode_attention.default"
_FOLD = [0, 2, 3, 1, 4]  # [B, T, Hkv, G, D] -> [B, Hkv, G, T, D]
_UNFOLD = [0, 3, 1, 2, 4]  # [B, Hkv, G, T, D] -> [B, T, Hkv, G, D]


@attrs.frozen
class _Block:
    args: tuple[object, ...]  # the op's arguments
    last: fx.Node  # the node whose result the op gives (the o projection's input)
    writes: tuple[tuple[fx.Node, fx.Node], ...]  # (cache write, its cache): later reads see the cache
    dead: tuple[fx.Node, ...]  # the run's other nodes, users first


def fused_attention_blocks(gm: fx.GraphModule) -> int:
    """Replace each decode attention's glue (see the module) with `nxdi_kernels::attention_block`.
    Returns the count."""
    blocks = [b for node in gm.graph.nodes if str(node.target) == _ATTENTION and (b := _block(node)) is not None]
    for b in blocks:
        for write, cache in b.writes:  # the op writes the cache in place, as the scatter did
            write.replace_all_uses_with(cache)
        replace_run(gm, b.last, torch.ops.nxdi_kernels.attention_block.default, b.args, b.dead)
    return len(blocks)


def _call(node: object, target: object, n_args: int) -> tuple[object, ...] | None:
    """`node`'s arguments when it calls `target` with `n_args` of them and no keywords; else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.kwargs:
        return None
    if (node.target is not target and str(node.target) != target) or len(node.args) != n_args:
        return None
    return node.args


def _slice(node: object, source: fx.Node, start: int, end: int, *, to_end: bool = False) -> bool:
    """`node` is `source[:, :, start:end]` (`to_end`: any end at or past `end`)."""
    if not isinstance(node, fx.Node) or node.kwargs or node.target is not _SLICE:
        return False
    args = list(node.args) + [None, 0, None, 1][len(node.args) - 1 :]
    src, dim, lo, hi, step = args[:5]
    ends = isinstance(hi, int) and (hi >= end if to_end else hi == end)
    return src is source and dim == 2 and lo == start and ends and step == 1


def _only_users(node: object, *users: object) -> bool:
    return isinstance(node, fx.Node) and set(node.users) == set(users)


def _sole_user(node: object) -> fx.Node | None:
    """The one node reading `node`, or None."""
    return next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None


@attrs.frozen
class _Query:
    """The q side of the run: qkv -> view x -> slice qk -> rope (turned) -> slice q -> view, permute, reshape."""

    qkv: object
    x: fx.Node
    qk: fx.Node
    turned: fx.Node
    cos: object
    sin: object
    nodes: tuple[fx.Node, ...]  # the fold's reshape, permute and view, and the q slice, users first
    dims: tuple[int, int, int, int, int]  # batch, tokens, q heads, kv heads, head dim


def _query(q_fold: object) -> _Query | None:
    """The q side feeding the attention's `q_fold`, when it has the decoder's form."""
    fold = _call(q_fold, _RESHAPE, 2)
    perm = _call(fold[0], _PERMUTE, 2) if fold else None
    view = _call(perm[0], _VIEW, 2) if perm and list(perm[1]) == _FOLD else None
    q_slice = view[0] if view else None
    turned = q_slice.args[0] if isinstance(q_slice, fx.Node) and q_slice.args else None
    rope = _call(turned, _ROPE, 3)
    qk = rope[0] if rope else None
    x = qk.args[0] if isinstance(qk, fx.Node) and qk.args else None
    x_view = _call(x, _VIEW, 2)
    if not (fold and perm and view and rope and x_view) or len(x_view[1]) != 4 or len(view[1]) != 5:
        return None
    assert isinstance(q_fold, fx.Node) and isinstance(x, fx.Node) and isinstance(qk, fx.Node)
    assert isinstance(turned, fx.Node) and isinstance(q_slice, fx.Node)
    batch, tokens, heads, head_dim = x_view[1]
    kv_heads, group = view[1][2], view[1][3]
    q_heads = kv_heads * group
    if list(view[1]) != [batch, tokens, kv_heads, group, head_dim] or heads != q_heads + 2 * kv_heads:
        return None
    if list(fold[1]) != [batch, kv_heads, group * tokens, head_dim]:
        return None
    if not (_slice(q_slice, turned, 0, q_heads) and _slice(qk, x, 0, q_heads + kv_heads)):
        return None
    nodes = (q_fold, fold[0], perm[0], q_slice)
    if not all(_only_users(n, user) for n, user in zip(nodes[1:], nodes, strict=False)):
        return None
    return _Query(
        qkv=x_view[0],
        x=x,
        qk=qk,
        turned=turned,
        cos=rope[1],
        sin=rope[2],
        nodes=nodes,
        dims=(batch, tokens, q_heads, kv_heads, head_dim),
    )


def _write(write: object, source: fx.Node, start: int, end: int) -> tuple[fx.Node, fx.Node, object] | None:
    """(the cache, the slice written, the index) when `write` is the in-place int16 scatter of
    `source[:, :, start:end]` transposed into a cache input along its positions."""
    args = _call(write, scatter_bits_, 4)
    t = _call(args[3], _TRANSPOSE, 3) if args and args[1] == 2 else None
    if not (args and t and tuple(t[1:]) == (1, 2) and _slice(t[0], source, start, end, to_end=True)):
        return None
    cache, rows = args[0], t[0]
    if not (isinstance(cache, fx.Node) and cache.op == "placeholder") or not _only_users(args[3], write):
        return None
    assert isinstance(rows, fx.Node) and isinstance(args[3], fx.Node)
    return cache, rows, args[2]


def _unfold(att: fx.Node, dims: tuple[int, int, int, int, int]) -> tuple[fx.Node, ...] | None:
    """The attention output's view, permute and reshape back to [B, T, Hq * D] (and the view to
    [B * T, Hq * D] when present), last first."""
    batch, tokens, q_heads, kv_heads, head_dim = dims
    view = _sole_user(att)
    perm = _sole_user(view)
    rows = _sole_user(perm)
    view_args, perm_args, rows_args = _call(view, _VIEW, 2), _call(perm, _PERMUTE, 2), _call(rows, _RESHAPE, 2)
    if not (view_args and perm_args and rows_args) or list(perm_args[1]) != _UNFOLD:
        return None
    if list(view_args[1]) != [batch, kv_heads, q_heads // kv_heads, tokens, head_dim]:
        return None
    if list(rows_args[1]) != [batch, tokens, q_heads * head_dim]:
        return None
    assert view is not None and perm is not None and rows is not None
    flat = _sole_user(rows)
    flat_args = _call(flat, _VIEW, 2)
    head = (flat,) if flat is not None and flat_args and list(flat_args[1]) == [-1, q_heads * head_dim] else ()
    return (*head, rows, perm, view)


def _block(att: fx.Node) -> _Block | None:
    """The run around the decode attention `att`, when it has exactly the decoder's form."""
    args = _call(att, _ATTENTION, 4)
    query = _query(args[0]) if args else None
    if args is None or query is None:
        return None
    _, k_write, v_write, mask = args
    batch, tokens, q_heads, kv_heads, head_dim = query.dims
    k = _write(k_write, query.turned, q_heads, q_heads + kv_heads)
    v = _write(v_write, query.x, q_heads + kv_heads, q_heads + 2 * kv_heads)
    if k is None or v is None or k[2] is not v[2]:
        return None
    assert isinstance(k_write, fx.Node) and isinstance(v_write, fx.Node)
    output = next(n for n in reversed(att.graph.nodes) if n.op == "output")
    readers = {att, output}  # the attention, and the step's returned cache
    if not _only_users(query.nodes[0], att):
        return None
    if not (set(k_write.users) <= readers and set(v_write.users) <= readers):
        return None
    if not (_only_users(query.turned, query.nodes[-1], k[1]) and _only_users(query.qk, query.turned)):
        return None
    if not (
        _only_users(query.x, query.qk, v[1])
        and _only_users(k[1], k_write.args[3])
        and _only_users(v[1], v_write.args[3])
    ):
        return None
    unfold = _unfold(att, query.dims)
    if unfold is None:
        return None
    flat = len(unfold) == 4
    op_args = (
        query.qkv,
        query.cos,
        query.sin,
        k[0],
        v[0],
        k[2],
        mask,
        batch,
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        flat,
    )
    dead = (
        *unfold[1:],
        att,
        *query.nodes,
        v_write,
        v_write.args[3],
        v[1],
        k_write,
        k_write.args[3],
        k[1],
        query.turned,
        query.qk,
        query.x,
    )
    return _Block(args=op_args, last=unfold[0], writes=((k_write, k[0]), (v_write, v[0])), dead=dead)

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

from nxdi.effects.backends.cpu_passes import _scatter_bits_

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
    dead: tuple[fx.Node, ...]  # the run's nodes, users first


def fused_attention_blocks(gm: fx.GraphModule) -> int:
    """Replace each decode attention's glue (see the module) with `nxdi_kernels::attention_block`.
    Returns the count."""
    blocks = [b for node in gm.graph.nodes if str(node.target) == _ATTENTION and (b := _block(node)) is not None]
    for b in blocks:
        with gm.graph.inserting_before(b.last):
            fused = gm.graph.call_function(torch.ops.nxdi_kernels.attention_block.default, b.args)
        fused.meta = dict(b.last.meta)
        b.last.replace_all_uses_with(fused)
        for write, cache in b.writes:  # the op writes the cache in place, as the scatter did
            write.replace_all_uses_with(cache)
        for node in b.dead:
            gm.graph.erase_node(node)
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


def _block(att: fx.Node) -> _Block | None:
    """The run around the decode attention `att`, when it has exactly the decoder's form."""
    args = _call(att, _ATTENTION, 4)
    if args is None:
        return None
    q_fold, k_write, v_write, mask = args
    q_args = _call(q_fold, _RESHAPE, 2)
    perm = _call(q_args[0], _PERMUTE, 2) if q_args else None
    q_view = _call(perm[0], _VIEW, 2) if perm and list(perm[1]) == _FOLD else None
    q_slice = q_view[0] if q_view else None
    turned = q_slice.args[0] if isinstance(q_slice, fx.Node) and q_slice.args else None
    rope = _call(turned, _ROPE, 3)
    qk = rope[0] if rope else None
    x = qk.args[0] if isinstance(qk, fx.Node) and qk.args else None
    x_args = _call(x, _VIEW, 2)
    if not (q_args and q_view and rope and x_args):
        return None
    qkv, (batch, tokens, heads, head_dim) = x_args[0], (list(x_args[1]) + [None] * 4)[:4]
    kv_heads, group = q_view[1][2], q_view[1][3]
    q_heads = kv_heads * group
    if [batch, tokens, kv_heads, group, head_dim] != list(q_view[1]) or heads != q_heads + 2 * kv_heads:
        return None
    if list(q_args[1]) != [batch, kv_heads, group * tokens, head_dim]:
        return None
    if not (_slice(q_slice, turned, 0, q_heads) and _slice(qk, x, 0, q_heads + kv_heads)):
        return None
    k_args, v_args = _call(k_write, _scatter_bits_, 4), _call(v_write, _scatter_bits_, 4)
    if not (k_args and v_args) or k_args[1] != 2 or v_args[1] != 2 or k_args[2] is not v_args[2]:
        return None
    k_t, v_t = _call(k_args[3], _TRANSPOSE, 3), _call(v_args[3], _TRANSPOSE, 3)
    if not (k_t and v_t and tuple(k_t[1:]) == (1, 2) and tuple(v_t[1:]) == (1, 2)):
        return None
    k_slice, v_slice = k_t[0], v_t[0]
    if not (
        _slice(k_slice, turned, q_heads, q_heads + kv_heads, to_end=True)
        and _slice(v_slice, x, q_heads + kv_heads, heads, to_end=True)
    ):
        return None
    k_cache, v_cache = k_args[0], v_args[0]
    if not all(isinstance(c, fx.Node) and c.op == "placeholder" for c in (k_cache, v_cache)):
        return None
    output = next(n for n in reversed(att.graph.nodes) if n.op == "output")
    if not (set(k_write.users) <= {att, output} and set(v_write.users) <= {att, output}):
        return None
    # the unfold back to the o projection's rows
    o_view = _sole_user(att)
    o_perm = _sole_user(o_view)
    o_rows = _sole_user(o_perm)
    o_view_args, o_perm_args, o_rows_args = (
        _call(o_view, _VIEW, 2),
        _call(o_perm, _PERMUTE, 2),
        _call(o_rows, _RESHAPE, 2),
    )
    if not (o_view_args and o_perm_args and o_rows_args) or list(o_perm_args[1]) != _UNFOLD:
        return None
    if list(o_view_args[1]) != [batch, kv_heads, group, tokens, head_dim] or list(o_rows_args[1]) != [
        batch,
        tokens,
        q_heads * head_dim,
    ]:
        return None
    flat_node = _sole_user(o_rows)
    flat_args = _call(flat_node, _VIEW, 2)
    flat = flat_args is not None and list(flat_args[1]) == [-1, q_heads * head_dim]
    run = (
        o_rows,
        o_perm,
        o_view,
        att,
        q_fold,
        q_args[0],
        perm[0],
        q_slice,
        v_write,
        v_args[3],
        v_slice,
        k_write,
        k_args[3],
        k_slice,
        turned,
        qk,
        x,
    )
    inner = {
        q_fold: [att],
        q_args[0]: [q_fold],
        perm[0]: [q_args[0]],
        q_slice: [perm[0]],
        v_args[3]: [v_write],
        v_slice: [v_args[3]],
        k_args[3]: [k_write],
        k_slice: [k_args[3]],
        turned: [q_slice, k_slice],
        qk: [turned],
        x: [qk, v_slice],
    }
    if not all(_only_users(n, *users) for n, users in inner.items()):
        return None
    op_args = (
        qkv,
        rope[1],
        rope[2],
        k_cache,
        v_cache,
        k_args[2],
        mask,
        batch,
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        flat,
    )
    last = flat_node if flat else o_rows
    return _Block(
        args=op_args, last=last, writes=((k_write, k_cache), (v_write, v_cache)), dead=((last,) if flat else ()) + run
    )

"""Load-time rewrites of a traced CPU program: fast linears, cheap in-place cache writes, less per-op overhead.
Effects: allocates the packed weight copies and folded constants.
(One module past 400 lines: every rewrite walks the same bound graph with the same node helpers.)

Theory of operation. A saved program is the pure graph (weights are inputs, cache writes are
out of place). When weights are bound, these rewrites make it fast without changing its results:

1. **Prepacked linears.** `aten.linear(x, w)` with `w` a weight input becomes a oneDNN matmul on a
   copy of `w` reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`). A
   plain-layout weight is otherwise reordered on *every* call, which dominates bf16 decode on CPUs
   without AMX (2-5x per linear at batch 1, see docs/cpu-backend.md). The packed copy is opaque
   (an mkldnn tensor), so it lives in the bound module, never in a saved file.
2. **In-place cache writes.** A functional write of a cache input (`index_copy`, `scatter`,
   `index_put`) becomes its in-place twin when nothing reads the old cache (or a view of it) after
   the write, so a decode step does not copy the whole cache view per layer. The result is the
   caller's tensor itself, which is why runs treat the given cache as consumed. A float8 cache is
   scattered through a uint8 view of its bytes (`kv_cache.scatter`); that write goes in place the
   same way, and the view back to float8 of its result is the cache input itself.

3. **Less per-op overhead.** The graph runs op by op from Python, so every node costs a few
   microseconds whatever its size. Conversions to the dtype a tensor already has (48 of them in a
   12-layer Llama step) are dropped, repeated pure calls (the cache-write index each layer
   rebuilds: 73 nodes) are merged, and nodes that depend on no input (RoPE inverse frequencies,
   `arange`s) are computed once at bind time.

4. **Streamed bf16 decode linears.** A bf16 linear over 1-4 rows (1-16 on CPUs with AMX; decode,
   short prefills, speculation) calls nxdi's own kernel (`kernels/bf16_linear.cpp`) on the weight
   as stored: oneDNN's and MKL's bf16 paths read the weights well below the memory bandwidth at
   these few rows on CPUs with AMX. A weight no larger linear reads is then never packed. On CPUs
   without AVX512-BF16, where oneDNN's bf16 GEMM is slow at every size, larger bf16 linears run
   the kernel on chunks of 4 rows (up to `WIDEN_MIN_ROWS`) or torch's fp32 GEMM on the weight
   widened block by block (prefill), and no bf16 weight is packed.

5. **Quantized weights.** A linear whose weight is a dequantized int8 or float8 weight input,
   row-scaled or blockwise (`quantized=True`, `nxdi.core.programs.linear`), over a few rows
   (decode, up to 8) calls a kernel on the 1-byte values (nxdi's own, `kernels/`, on chunks of 4
   rows past 4, or torch's for row-scaled int8) instead of building the float weight every step;
   over more rows (prefill) the float weight is built in one pass by nxdi's `weight_dequantize`,
   the same bits as the three torch ops it replaces.

6. **16-bit scatters as int16.** torch's CPU scatter of a bf16 or fp16 tensor copies the whole
   destination twice per call; the same scatter on an int16 view of the bits does not. A decode
   step's cache write then costs what it writes, not the size of the cache.

All rewrites are checked against the pure form by tests (same outputs, same new cache; the int8
and float8 kernels within bf16 rounding). `cpu_fusions` holds the rewrites that fuse a decode
step's small bf16 ops (RMSNorm, RoPE, attention) into one-op kernels.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, fx

from nxdi.effects.backends import kernels
from nxdi.effects.backends.base import WeightSet

_LINEAR = torch.ops.aten.linear.default
_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
_IN_PLACE = {
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
    torch.ops.aten.scatter.src: torch.ops.aten.scatter_.src,
    torch.ops.aten.scatter.value: torch.ops.aten.scatter_.value,
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
}
"""Functional cache writes and their in-place twins (same arguments, result aliases argument 0)."""


def packable_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes this CPU's oneDNN build can prepack (empty without oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


def _on_rows(x: Tensor, linear_2d: Callable[[Tensor], Tensor]) -> Tensor:
    """A 2-D-only linear kernel applied to x [..., K]: its rows flattened, the leading dims restored."""
    y = linear_2d(x.reshape(-1, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` with a prepacked weight: x [..., K], packed [N, K] (mkldnn layout) -> [..., N]."""
    return _on_rows(x, lambda rows: _POINTWISE(rows, packed, bias, "none", [], ""))


def _rows(node: fx.Node) -> int:
    """The number of rows (product of leading dims) of a linear's input, the oneDNN packing hint."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if val is None:
        return 1
    rows = 1
    for d in val.shape[:-1]:
        rows *= int(d)
    return max(rows, 1)


def prepack_linears(
    gm: fx.GraphModule,
    weight_nodes: Sequence[fx.Node],
    names: Sequence[str],
    weights: WeightSet,
    dtypes: frozenset[torch.dtype],
) -> int:
    """Rewrite every `linear(x, w)` whose `w` is a 2-D weight input of a packable dtype. Returns the count.

    Each such weight is packed once per `WeightSet` (kept in `weights.derived` under its name, so
    every program bound to the same set shares the copy) and read by the graph as an attribute.
    """
    graph, count = gm.graph, 0
    for i, (node, name, w) in enumerate(zip(weight_nodes, names, weights.tensors, strict=True)):
        users = [u for u in node.users if u.target is _LINEAR and u.args[1] is node]
        if not users or w.dim() != 2 or w.dtype not in dtypes:
            continue
        # The row-count hint only tunes the blocked layout; one copy serves every bucket.
        rows = _rows(users[0])
        packed = weights.derive(
            f"onednn:{name}", lambda w=w, rows=rows: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
        )
        attr = f"_nxdi_packed_{i}"
        gm.register_buffer(attr, packed, persistent=False)
        with graph.inserting_after(node):
            packed = graph.get_attr(attr)
        for u in users:
            x, bias = u.args[0], (u.args[2] if len(u.args) > 2 else None)
            x_val = _val(x)
            if x_val is not None and x_val.dim() == 2:  # the common case: call oneDNN directly
                _replace_linear(u, _POINTWISE, (x, packed, bias, "none", [], ""))
            else:
                _replace_linear(u, packed_linear, (x, packed, bias))
            count += 1
    return count


def _replace_linear(u: fx.Node, target: Callable[..., object], args: tuple[object, ...]) -> None:
    """Put a call of `target(*args)` where the linear node `u` was: its place, meta and users."""
    with u.graph.inserting_before(u):
        new = u.graph.call_function(target, args)
    new.meta = dict(u.meta)
    u.replace_all_uses_with(new)
    u.graph.erase_node(u)


def streamed_bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` by nxdi's kernel (`kernels/bf16_linear.cpp`): x [..., K] bf16 of at most
    `kernels.bf16_max_rows(K)` rows, w [N, K] bf16 contiguous -> [..., N] bf16."""
    return _on_rows(x, lambda rows: torch.ops.nxdi_kernels.bf16_linear(rows, w, bias))


BF16_CHUNK_ROWS = 4
"""Rows of x per call of the bf16 kernel in `chunked_bf16_linear` (its limit without AMX)."""
WIDEN_MIN_ROWS = 33
"""On CPUs without AVX512-BF16, bf16 linears over this many rows or more run `widened_bf16_linear`;
from 5 rows up to one fewer, `chunked_bf16_linear` (each measured faster than oneDNN's bf16 GEMM,
and than the other, in its range: docs/cpu-backend.md, "bf16 linears without AVX512-BF16")."""
WIDEN_BLOCK_ROWS = 256
"""Weight rows widened to fp32 at a time by `widened_bf16_linear` (a scratch of 2-6 MB at the 1.1B
shape's widths: as fast as widening the whole weight, without its allocation)."""


def _on_row_chunks(x: Tensor, step: int, linear_2d: Callable[[Tensor], Tensor]) -> Tensor:
    """A 2-D linear kernel of at most `step` rows applied to x [..., K], `step` rows at a time."""
    return _on_rows(x, lambda rows: torch.cat([linear_2d(rows[i : i + step]) for i in range(0, rows.shape[0], step)]))


def chunked_bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` by nxdi's bf16 kernel on chunks of `BF16_CHUNK_ROWS` rows of x [..., K] bf16
    (the weight read once per chunk), w [N, K] bf16 contiguous -> [..., N] bf16."""
    return _on_row_chunks(x, BF16_CHUNK_ROWS, lambda rows: torch.ops.nxdi_kernels.bf16_linear(rows, w, bias))


def widened_bf16_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` for x [..., K] bf16, w [N, K] bf16 -> [..., N] bf16 by torch's fp32 GEMM: x and
    `WIDEN_BLOCK_ROWS` rows of w at a time widened to fp32 (exact), the products summed in fp32 and
    rounded to bf16 once, after the bias (as bf16 `F.linear` rounds)."""
    n, k = w.shape

    def rows_2d(rows: Tensor) -> Tensor:
        xf = rows.float()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        scratch = torch.empty(min(WIDEN_BLOCK_ROWS, n), k, dtype=torch.float32)
        for n0 in range(0, n, WIDEN_BLOCK_ROWS):
            n1 = min(n, n0 + WIDEN_BLOCK_ROWS)
            block = scratch[: n1 - n0].copy_(w[n0:n1]).T
            if bias is None:
                torch.mm(xf, block, out=out[:, n0:n1])
            else:
                torch.addmm(bias[n0:n1].float(), xf, block, out=out[:, n0:n1])
        return out.to(torch.bfloat16)

    return _on_rows(x, rows_2d)


def _larger_bf16_linear(rows: int) -> Callable[..., Tensor]:
    """The route of a bf16 linear over more `rows` than the kernel takes, on CPUs without AVX512-BF16."""
    return chunked_bf16_linear if rows < WIDEN_MIN_ROWS else widened_bf16_linear


def bf16_weight_linears(gm: fx.GraphModule, weight_nodes: Sequence[fx.Node], weights: WeightSet) -> int:
    """Rewrite `linear(x, w)` with `w` a contiguous 2-D bf16 weight input and x bf16 into nxdi's bf16
    kernel, which reads `w` as stored, when this CPU runs it (`kernels.bf16_supported()`):
    - x of at most `kernels.bf16_max_rows(K)` rows (16 with AMX, else 4): the kernel (it measured
      faster than oneDNN's prepacked GEMM there, docs/cpu-backend.md);
    - more rows, on CPUs without AVX512-BF16 (`kernels.bf16_native()`): `chunked_bf16_linear` up
      to `WIDEN_MIN_ROWS`, then `widened_bf16_linear`; with AVX512-BF16 they stay for oneDNN.
    Run before `prepack_linears`: a weight only such linears read is then never packed. Returns the
    count."""
    if not kernels.bf16_supported():
        return 0
    native, count = kernels.bf16_native(), 0
    for node, w in zip(weight_nodes, weights.tensors, strict=True):
        if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous():
            continue
        for u in [u for u in node.users if u.target is _LINEAR and u.args[1] is node]:
            x_val = _val(u.args[0])
            if x_val is None or x_val.dtype != torch.bfloat16:
                continue
            rows = _rows(u)
            call: Callable[..., object]
            if rows <= kernels.bf16_max_rows(w.shape[1]):
                # 2-D x (the decoder's [N, E]) calls the op itself: no Python frame per call.
                call = torch.ops.nxdi_kernels.bf16_linear.default if x_val.dim() == 2 else streamed_bf16_linear
            elif native:
                continue
            else:
                call = _larger_bf16_linear(rows)
            _replace_linear(u, call, (u.args[0], node, u.args[2] if len(u.args) > 2 else None))
            count += 1
    return count


_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_MUL = torch.ops.aten.mul.Tensor
_UNSQUEEZE = torch.ops.aten.unsqueeze.default
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)
KERNEL_MAX_ROWS = 4
"""Linears over at most this many rows run nxdi's int8 or float8 kernel (it streams the weights;
with its rows interleaved it measured faster than torch's int8 kernel at 1-4 rows, and torch has
no float8 one, docs/cpu-backend.md)."""
INT8_MAX_ROWS = 8
"""Linears over at most this many rows run torch's int8 kernel otherwise (row-scaled int8, bf16 x)
or nxdi's on chunks of `KERNEL_MAX_ROWS` rows (the rest); larger ones (prefill) dequantize, which
measured faster there (docs/cpu-backend.md, "Quantized weights")."""


def int8_linear(x: Tensor, values: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """`linear(x, values * scale[:, None], bias)` by torch's weight-only int8 kernel: x [..., K] bf16,
    values [N, K] int8, scale [N] bf16 -> [..., N] bf16."""
    y = _on_rows(x, lambda rows: _INT8_MM(rows, values, scale))
    return y if bias is None else y + bias


def streamed_quantized_linear(x: Tensor, values: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same by nxdi's kernels (`kernels/quantized_linear.cpp`): x [..., K] of at most
    `KERNEL_MAX_ROWS` rows in bf16, fp16 or fp32, values [N, K] int8, float8_e4m3fn or
    float8_e5m2, scale [N] float32."""
    op = _quantized_kernel(values.dtype)
    return _on_rows(x, lambda rows: op(rows, values, scale, bias))


def chunked_quantized_linear(x: Tensor, values: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same for more rows: nxdi's kernel on chunks of `KERNEL_MAX_ROWS` rows of x [..., K]
    (the weights read once per chunk), for the routes torch's int8 kernel does not take."""
    op = _quantized_kernel(values.dtype)
    return _on_row_chunks(x, KERNEL_MAX_ROWS, lambda rows: op(rows, values, scale, bias))


def _quantized_kernel(dtype: torch.dtype) -> torch._ops.OpOverloadPacket:
    """nxdi's decode kernel for weight values of `dtype` (the op packet; `.default` is its overload)."""
    return torch.ops.nxdi_kernels.int8_linear if dtype == torch.int8 else torch.ops.nxdi_kernels.fp8_linear


def _through_conversions(node: object) -> object:
    while isinstance(node, fx.Node) and node.target in _CONVERSIONS:
        node = node.args[0]
    return node


def _dequantized(w: object) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(values, scale, chain) when `w` is `programs.linear.dequantize` of a quantized weight:
    row-scaled, `to(mul(to(values, f32), unsqueeze(to(scale, f32), 1)), dtype)`, or blockwise,
    `to(view(mul(view(to(values, f32), blocks), unsqueeze(unsqueeze(to(scale, f32), 1), 3)),
    shape), dtype)` (views or reshapes; no outer `to` for fp32, no inner one for a float32 scale);
    chain = the nodes it made, outermost first."""
    if not isinstance(w, fx.Node):
        return None
    inner = w.args[0] if w.target in _CONVERSIONS else w
    blockwise = isinstance(inner, fx.Node) and inner.target in _RESHAPES
    mul = inner.args[0] if blockwise else inner
    if not (isinstance(mul, fx.Node) and mul.target is _MUL and len(mul.args) == 2):
        return None
    conv, unsq = mul.args
    chain = [*((w,) if w is not inner else ()), *((inner,) if blockwise else ()), mul]
    if blockwise:  # the values seen as blocks, the scales with the blocks' two unit dims
        if not (isinstance(conv, fx.Node) and conv.target in _RESHAPES):
            return None
        if not (isinstance(unsq, fx.Node) and unsq.target is _UNSQUEEZE and unsq.args[1] == 3):
            return None
        chain += [conv, unsq]
        conv, unsq = conv.args[0], unsq.args[0]
    if not (isinstance(conv, fx.Node) and conv.target in _CONVERSIONS):
        return None
    if not (isinstance(unsq, fx.Node) and unsq.target is _UNSQUEEZE and unsq.args[1] == 1):
        return None
    values, scale = conv.args[0], _through_conversions(unsq.args[0])
    if not (isinstance(values, fx.Node) and isinstance(scale, fx.Node)):
        return None
    chain += [conv, unsq, *(n for n in (unsq.args[0],) if isinstance(n, fx.Node) and n is not scale)]
    return values, scale, chain


BLOCK_COLUMNS = 32
"""Blockwise scales run nxdi's kernels when each block spans a multiple of this many columns (the
widest chunk a kernel reads at once, which must not straddle two blocks); others stay dequantized
by torch's ops."""


def _scales_fit(values: Tensor, scale: Tensor) -> bool:
    """Whether `scale` is one per row of `values` [N, K], or a grid of whole blocks nxdi's kernels take."""
    (n, k), grid = values.shape, scale.shape
    if scale.dim() == 1:
        return grid[0] == n
    if scale.dim() != 2 or 0 in grid:
        return False
    return n % grid[0] == 0 and k % (grid[1] * BLOCK_COLUMNS) == 0


def quantized_weight_linears(
    gm: fx.GraphModule, weight_nodes: Sequence[fx.Node], names: Sequence[str], weights: WeightSet
) -> int:
    """Rewrite `linear(x, dequantize(values, scale))` with int8 or float8 weight inputs, row-scaled
    or blockwise (`BLOCK_COLUMNS`), into a kernel call that reads the 1-byte values and never builds
    the float weight: nxdi's kernels for at most `KERNEL_MAX_ROWS` rows when they load
    (`kernels.load()`); up to `INT8_MAX_ROWS` rows torch's for row-scaled int8 and bf16 x (its bf16
    scale copy made once per `WeightSet`), else nxdi's on chunks of rows. Larger linears (prefill)
    keep the GEMM; their float weight is built by nxdi's one-pass `weight_dequantize` (the same
    bits) where the kernels load, and a bf16 one goes to `chunked_bf16_linear` or
    `widened_bf16_linear` on CPUs without AVX512-BF16 (as `bf16_weight_linears` sends a bf16
    weight). Returns the count of linears rewritten (the GEMMs not counted)."""
    index = {n: i for i, n in enumerate(weight_nodes)}
    graph, count = gm.graph, 0
    for u in [n for n in graph.nodes if n.target is _LINEAR]:
        x_val, found = _val(u.args[0]), _dequantized(u.args[1])
        if x_val is None or found is None or found[0] not in index or found[1] not in index:
            continue
        values, scale, chain = found
        v, sc = weights.tensors[index[values]], weights.tensors[index[scale]]
        if v.dtype not in _QUANTIZED_DTYPES or v.dim() != 2 or not _scales_fit(v, sc):
            continue
        rows, bias = _rows(u), u.args[2] if len(u.args) > 2 else None
        with graph.inserting_before(u):  # the scale attributes are read before the linear
            if rows <= KERNEL_MAX_ROWS and x_val.dtype in _KERNEL_DTYPES and kernels.load():
                # 2-D x (the decoder's [N, E]) calls the op itself: no Python frame per call.
                call = _quantized_kernel(v.dtype).default if x_val.dim() == 2 else streamed_quantized_linear
                args = (u.args[0], values, _f32_scale(gm, weights, names, index[scale], sc), bias)
            elif rows <= INT8_MAX_ROWS and x_val.dtype == torch.bfloat16 and v.dtype == torch.int8 and sc.dim() == 1:
                bf16 = weights.derive(
                    f"int8-scale:{names[index[scale]]}", lambda sc=sc: sc.to(torch.bfloat16).contiguous()
                )
                call, args = int8_linear, (u.args[0], values, _attr(gm, "bf16", index[scale], bf16), bias)
            elif rows <= INT8_MAX_ROWS and x_val.dtype in _KERNEL_DTYPES and kernels.load():
                f32 = _f32_scale(gm, weights, names, index[scale], sc)
                call, args = chunked_quantized_linear, (u.args[0], values, f32, bias)
            else:
                w_val = _val(u.args[1])
                if w_val is not None and w_val.dtype in _KERNEL_DTYPES and kernels.load():
                    f32 = _f32_scale(gm, weights, names, index[scale], sc)
                    deq = graph.call_function(
                        torch.ops.nxdi_kernels.weight_dequantize.default, (values, f32, w_val.dtype)
                    )
                    deq.meta = dict(u.args[1].meta)
                    u.replace_input_with(u.args[1], deq)
                    _erase_unused(graph, chain)
                    if w_val.dtype == x_val.dtype == torch.bfloat16 and not kernels.bf16_native():
                        _replace_linear(u, _larger_bf16_linear(rows), (u.args[0], deq, bias))
                continue
        _replace_linear(u, call, args)
        _erase_unused(graph, chain)
        count += 1
    return count


_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _f32_scale(gm: fx.GraphModule, weights: WeightSet, names: Sequence[str], i: int, scale: Tensor) -> fx.Node:
    """A get_attr node of the float32 copy of the scale weight `i` (made once per `WeightSet`)."""
    f32 = weights.derive(f"f32-scale:{names[i]}", lambda: scale.float().contiguous())
    return _attr(gm, "f32", i, f32)


def _erase_unused(graph: fx.Graph, chain: Sequence[fx.Node]) -> None:
    """Erase the nodes of a dequantize `chain` (outermost first) that nothing reads any more."""
    for node in chain:
        if not node.users:
            graph.erase_node(node)


def _attr(gm: fx.GraphModule, kind: str, i: int, tensor: Tensor) -> fx.Node:
    """A get_attr node of `tensor`, registered on `gm` once per (kind, weight index)."""
    name = f"_nxdi_{kind}_scale_{i}"
    if not hasattr(gm, name):
        gm.register_buffer(name, tensor, persistent=False)
    return gm.graph.get_attr(name)


def _is_view(node: fx.Node) -> bool:
    """True for ops whose result may alias their first argument (views, getitem of split/unbind)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _aliases(node: fx.Node) -> set[fx.Node]:
    """`node` and every node that may be a view of it."""
    seen, stack = {node}, [node]
    while stack:
        for u in stack.pop().users:
            if u not in seen and _is_view(u) and u.args and u.args[0] in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _safe_to_mutate(cache: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Nothing reads `cache` (or a view of it) after `write` or inside it, and no view of it is an output."""
    aliases = _aliases(cache)
    if any(n in aliases for a in write.args[1:] for n in _flat_nodes(a)):
        return False  # the write's index or source reads the memory it overwrites
    for alias in aliases:
        for u in alias.users:
            if u is write or (_is_view(u) and u.args[0] is alias):
                continue
            if u.op == "output" or order[u] > order[write]:
                return False
    return True


def _flat_nodes(arg: object) -> list[fx.Node]:
    """The nodes inside an argument (which may be a list or tuple of nodes, e.g. index_put's indices)."""
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flat_nodes(a)]
    return []


def _same_bytes_views(node: fx.Node) -> list[fx.Node]:
    """The `view(dtype)` users of `node` to a dtype of the same size (a float8 cache's uint8 bytes)."""
    val = _val(node)
    return [
        u
        for u in node.users
        if u.target is _DTYPE_VIEW
        and val is not None
        and isinstance(u.args[1], torch.dtype)
        and u.args[1].itemsize == val.dtype.itemsize
    ]


def reinplace_cache_writes(gm: fx.GraphModule, cache_nodes: Sequence[fx.Node]) -> tuple[bool, ...]:
    """Turn each cache input's single functional write into its in-place twin where that is safe.

    The write may be on the cache or on a same-size dtype view of it (the bytes of a float8 cache);
    then the view of its result back to the cache's dtype is replaced by the cache input itself.

    Returns, per cache input, whether it is now written in place.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = []
    for cache in cache_nodes:
        targets = [cache, *_same_bytes_views(cache)]
        writes = [u for t in targets for u in t.users if u.target in _IN_PLACE and u.args[0] is t]
        ok = len(writes) == 1 and _safe_to_mutate(cache, writes[0], order)
        if ok:
            write = writes[0]
            write.target = _IN_PLACE[write.target]  # type: ignore[index]  # filtered to _IN_PLACE keys above
            cache_val = _val(cache)
            for back in _same_bytes_views(write) if write.args[0] is not cache else []:
                if cache_val is not None and back.args[1] == cache_val.dtype:
                    back.replace_all_uses_with(cache)  # the written bytes, seen as the cache: the cache itself
                    gm.graph.erase_node(back)
        done.append(ok)
    return tuple(done)


_SCATTERS = (torch.ops.aten.scatter.src, torch.ops.aten.scatter_.src)
_HALF_FLOATS = (torch.bfloat16, torch.float16)


def scatter_bits(t: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """`t.scatter(dim, index, src)` for a 16-bit float `t`, moving the values' bits as int16."""
    return t.view(torch.int16).scatter(dim, index, src.view(torch.int16)).view(t.dtype)


def scatter_bits_(t: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """`t.scatter_(dim, index, src)` for a 16-bit float `t`, moving the values' bits as int16; returns `t`."""
    t.view(torch.int16).scatter_(dim, index, src.view(torch.int16))
    return t


def scatter_half_floats_as_bits(gm: fx.GraphModule) -> int:
    """Make each scatter of a bf16 or fp16 tensor scatter its bits as int16 (the same result). Returns
    the count.

    torch's CPU scatter of a 16-bit float copies the whole destination twice per call, whatever the
    slots written: a decode step's cache write then costs O(cache) (65 us for a 1x4x256x64 bf16 cache,
    1 ms at 4x4x2048x64), where the int16 scatter costs 8-10 us (docs/cpu-backend.md). Run after
    `reinplace_cache_writes`, which picks the in-place twins this keeps in place.
    """
    count = 0
    for node in list(gm.graph.nodes):
        val = _val(node.args[0]) if node.target in _SCATTERS else None
        if val is not None and val.dtype in _HALF_FLOATS:
            node.target = scatter_bits_ if node.target is torch.ops.aten.scatter_.src else scatter_bits
            count += 1
    return count


_CONVERSIONS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)
_DTYPE_VIEW = torch.ops.aten.view.dtype
_FOLD_LIMIT = 1 << 20
"""Bytes: a folded constant larger than this stays computed per call (it would cost memory)."""


def _val(node: object) -> Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, Tensor) else None


def drop_identity_conversions(gm: fx.GraphModule) -> int:
    """Remove `to(dtype)` nodes whose input already has that dtype (they return their input). Returns the count."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target not in _CONVERSIONS:
            continue
        src, out = _val(node.args[0]), _val(node)
        same = (
            src is not None
            and out is not None
            and (src.dtype, src.device, src.layout) == (out.dtype, out.device, out.layout)
        )
        # _to_copy always copies; only `to` without copy/memory_format options may alias its input.
        if same and node.target is torch.ops.aten.to.dtype and not node.kwargs and len(node.args) == 2:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            count += 1
    return count


def _foldable(node: fx.Node, constant: dict[fx.Node, Tensor]) -> bool:
    """A pure, deterministic op whose inputs are all constants (and not an uninitialized `empty`)."""
    return _pure(node) and all(n in constant for n in node.all_input_nodes)


def _shareable(node: fx.Node) -> bool:
    """No user returns the value or writes it: one tensor can then serve every call."""
    mutating = (u for u in node.users if isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable)
    return all(u.op != "output" for u in node.users) and next(mutating, None) is None


def fold_constants(gm: fx.GraphModule) -> int:
    """Compute once the nodes that depend on no graph input, and read them as attributes. Returns the count."""
    constant: dict[fx.Node, Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), Tensor):
            constant[node] = getattr(gm, str(node.target))
        elif _foldable(node, constant):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: constant[n])
            value = node.target(*args, **kwargs)
            if isinstance(value, Tensor) and value.nbytes <= _FOLD_LIMIT:
                constant[node] = value
    count = 0
    for node, value in constant.items():
        frontier = any(u not in constant for u in node.users)
        if node.op != "call_function" or not frontier or not _shareable(node):
            continue
        attr = f"_nxdi_folded_{count}"
        gm.register_buffer(attr, value, persistent=False)
        with gm.graph.inserting_before(node):
            new = gm.graph.get_attr(attr)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        count += 1
    for node in reversed(list(constant)):  # the folded region is now unused
        if node.op == "call_function" and not node.users:
            gm.graph.erase_node(node)
    return count


def _key(node: fx.Node) -> tuple[object, ...] | None:
    """A hashable identity of a pure call (target and arguments), or None when the node must stay."""
    if not _pure(node):
        return None
    try:
        key = (node.target, _freeze(node.args), _freeze(tuple(sorted(node.kwargs.items()))))
        hash(key)
    except TypeError:
        return None
    return key


COMMUNICATING = frozenset({"nxdi"})
"""Namespaces of ops that talk to other ranks (`nxdi.effects.distributed.ops`): never folded or
merged, since every rank must call every collective, in the same order."""


def _pure(node: fx.Node) -> bool:
    """A deterministic op that writes nothing, allocates no uninitialized memory and talks to no rank."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace in COMMUNICATING:
        return False
    schema = node.target._schema
    return not (schema.is_mutable or "empty" in schema.name or torch.Tag.nondeterministic_seeded in node.target.tags)


def _freeze(value: object) -> object:
    """Arguments as a hashable key that tells apart values Python calls equal (1, 1.0, True)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, fx.Node):
        return value
    return (type(value).__name__, str(value) if isinstance(value, (torch.dtype, torch.device)) else value)


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Compute each pure call once (e.g. the cache-write index every layer rebuilds). Returns the count.

    Run on the pure graph, before `reinplace_cache_writes`: in a pure graph equal calls on equal
    arguments give equal values, which stops being true once a cache is written in place.
    """
    seen: dict[tuple[object, ...], fx.Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        key = _key(node)
        if key is None:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            count += 1
        else:
            seen[key] = node
    return count


def constants_as_inputs(gm: fx.GraphModule) -> tuple[Tensor, ...]:
    """Turn each tensor the graph reads as a module attribute (`get_attr`: packed weights, float32
    scales, folded constants) into a graph input placed before the others; returns those tensors in
    input order, to bind as the weights are (`functools.partial`).

    Why: each `self.<buffer>` read goes through `nn.Module.__getattr__`, a Python call per read;
    the int8 1.1B decode step read 113 of them per step."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op == "placeholder")
    inputs: dict[str, fx.Node] = {}
    bound: list[Tensor] = []
    for node in list(graph.nodes):
        value = functools.reduce(getattr, str(node.target).split("."), gm) if node.op == "get_attr" else None
        if not isinstance(value, Tensor):
            continue
        if node.target not in inputs:
            with graph.inserting_before(first):
                inputs[str(node.target)] = graph.placeholder(str(node.target))  # the attribute's name
            inputs[str(node.target)].meta = dict(node.meta)
            bound.append(value)
        node.replace_all_uses_with(inputs[str(node.target)])
        graph.erase_node(node)
    return tuple(bound)

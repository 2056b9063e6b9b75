"""The CPU backend: the load-time fast paths (prepacked weights, in-place cache) agree with the pure form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nxdi.effects.backends import cpu_passes, kernels
from nxdi.effects.backends.base import FlatProgram, LoadedProgram, WeightSet
from nxdi.effects.backends.cpu import CpuBackend
from tests.support import cpu_programs as cp

FAST, PURE = CpuBackend(), CpuBackend(pack_weights=False, in_place_cache=False)
READABLE = CpuBackend(cpp_runner=False)
"""The rewrites left as Python code (no runs handed to C++), for tests that read the bound graph."""
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.bfloat16 in cpu_passes.packable_dtypes() else [])


def bound(fn: FlatProgram, backend: CpuBackend, s: int, dtype: torch.dtype = torch.float32) -> LoadedProgram:
    program = backend.compile(fn, cp.SIGNATURE, cp.example(s, dtype), name=f"p{s}")
    return backend.bind(program, WeightSet(tensors=cp.weights(0, dtype))).unwrap()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [cp.step, cp.scatter_step, cp.flat_step], ids=["index_copy", "scatter", "2d"])
def test_in_place_fast_path_agrees_with_the_pure_form_over_a_decode(fn: FlatProgram, dtype: torch.dtype) -> None:
    """Prefill 4 tokens then decode 5, three ways: eager program, pure graph, fast graph."""
    w = cp.weights(0, dtype)
    prefill = {b: bound(fn, b, 4, dtype) for b in (FAST, PURE)}
    decode = {b: bound(fn, b, 1, dtype) for b in (FAST, PURE)}
    assert prefill[FAST].in_place == (True,) and prefill[PURE].in_place == (False,)
    caches = {b: (torch.zeros(cp.B, cp.T, cp.E, dtype=dtype),) for b in (FAST, PURE)}
    eager_cache = torch.zeros(cp.B, cp.T, cp.E, dtype=dtype)
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for i, (s, start) in enumerate([(4, 0)] + [(1, 4 + j) for j in range(5)]):
        x = cp.inputs(i, s, start, dtype)
        want_y, eager_cache = fn(*w, eager_cache, *x)
        for b in (FAST, PURE):
            given_cache = caches[b]
            (y, *_), caches[b] = b.run((prefill if s > 1 else decode)[b], given_cache, x)
            torch.testing.assert_close(y, want_y, **(tol if b is FAST else {"rtol": 0, "atol": 0}))
            torch.testing.assert_close(caches[b][0], eager_cache, **(tol if b is FAST else {"rtol": 0, "atol": 0}))
            assert (caches[b][0] is given_cache[0]) == (b is FAST)


def test_compiling_builds_the_kernels_library_so_load_need_not(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(kernels, "load", lambda: built.append("load") or True)
    plain = CpuBackend(pack_weights=False, in_place_cache=False, cpp_runner=False)
    for backend in (READABLE, plain):
        backend.compile(cp.step, cp.SIGNATURE, cp.example(1, torch.float32), name="fp32")
    assert built == []  # fp32 linears use no kernel of nxdi's, and without the runner nothing else does
    plain.compile(cp.step, cp.SIGNATURE, cp.example(1, torch.bfloat16), name="pure")
    assert built == []  # without the fast linears nothing would use them
    READABLE.compile(cp.step, cp.SIGNATURE, cp.example(1, torch.bfloat16), name="bf16")
    assert built == ["load"]
    FAST.compile(cp.step, cp.SIGNATURE, cp.example(1, torch.float32), name="fp32")
    assert built == ["load", "load"]  # the graph runner, in the same library, runs every dtype


def test_pure_graph_leaves_the_given_cache_untouched() -> None:
    cache = torch.zeros(cp.B, cp.T, cp.E)
    _, (new,) = PURE.run(bound(cp.step, PURE, 1), (cache,), cp.inputs(0, 1, 3))
    assert torch.count_nonzero(cache) == 0 and torch.count_nonzero(new) > 0


def test_a_cache_read_after_its_write_stays_out_of_place() -> None:
    loaded = bound(cp.reread_step, FAST, 1)
    assert loaded.in_place == (False,)
    cache = torch.randn(cp.B, cp.T, cp.E)
    (y,), (new,) = FAST.run(loaded, (cache.clone(),), cp.inputs(1, 1, 2))
    want_y, want_new = cp.reread_step(*cp.weights(0), cache, *cp.inputs(1, 1, 2))
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, want_new)


def test_in_place_refuses_a_write_whose_source_views_the_cache() -> None:
    def shift(
        w: torch.Tensor, w_out: torch.Tensor, cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = cache.index_copy(1, pos + 1, cache[:, : pos.shape[0]])  # the source is a view of the cache
        return F.linear(new.sum(1, keepdim=True) + F.linear(x, w)[:, -1:], w_out), new

    loaded = bound(shift, FAST, 2)
    assert loaded.in_place == (False,)
    cache = torch.randn(cp.B, cp.T, cp.E)
    (y,), (new,) = FAST.run(loaded, (cache.clone(),), cp.inputs(2, 2, 3))
    want_y, want_new = shift(*cp.weights(0), cache, *cp.inputs(2, 2, 3))
    torch.testing.assert_close(new, want_new)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=20)
@given(
    rows=st.integers(1, 9),
    k=st.sampled_from([8, 64, 96]),
    n=st.sampled_from([8, 96, 256]),
    lead=st.sampled_from([(), (2,), (2, 3)]),
    bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_packed_linear_matches_linear(
    rows: int, k: int, n: int, lead: tuple[int, ...], bias: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(*lead, rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
    torch.testing.assert_close(cpu_passes.packed_linear(x, packed, b), F.linear(x, w, b), **tol)


def test_bind_names_every_weight_that_does_not_fit() -> None:
    program = FAST.compile(cp.step, cp.SIGNATURE, cp.example(1), name="p")
    w, w_out = cp.weights(0)
    error = FAST.bind(program, WeightSet(tensors=(w[:, :8], w_out.double()))).failure()
    assert error.fields() == {"proj.weight", "out.weight"}
    assert "recompile" in error.render()
    assert FAST.bind(program, WeightSet(tensors=(w,))).failure().fields() == {"weights"}


def test_compile_rejects_a_signature_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="arity"):
        FAST.compile(cp.step, cp.SIGNATURE, cp.example(1)[:-1], name="p")

    def drops_cache(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cp.step(*flat)[:1]

    with pytest.raises(ValueError, match="outputs"):
        FAST.compile(drops_cache, cp.SIGNATURE, cp.example(1), name="p")


def test_programs_bound_to_one_weight_set_share_one_packed_copy() -> None:
    weights = WeightSet(tensors=cp.weights(0))
    loaded = [
        FAST.bind(FAST.compile(cp.step, cp.SIGNATURE, cp.example(s), name=f"p{s}"), weights).unwrap() for s in (1, 4)
    ]
    if torch.float32 not in cpu_passes.packable_dtypes():
        assert weights.derived == {}
        return
    assert sorted(weights.derived) == ["onednn:out.weight", "onednn:proj.weight"]
    modules = [lp.call.func.__self__ for lp in loaded]  # type: ignore[attr-defined]
    assert modules[0]._nxdi_packed_0 is modules[1]._nxdi_packed_0 is weights.derived["onednn:proj.weight"]


def test_bind_drops_identity_conversions_and_folds_input_free_constants() -> None:
    program = READABLE.compile(cp.flat_step, cp.SIGNATURE, cp.example(2), name="p")
    loaded = READABLE.bind(program, WeightSet(tensors=cp.weights(0))).unwrap()
    code = loaded.call.func.__self__.code  # type: ignore[attr-defined]
    assert "_nxdi_folded_0" in code and "aten.pow" not in code  # the [E] scale is computed once
    assert "_linear_pointwise" in code or not cpu_passes.packable_dtypes()  # 2-D inputs call oneDNN directly
    pure = program.payload.module().code
    assert code.count("aten.to.dtype") < pure.count("aten.to.dtype")
    for step in range(3):  # folded constants are shared across calls, so check several
        x = cp.inputs(step, 2, 2 * step)
        (y,), _ = READABLE.run(loaded, (torch.zeros(cp.B, cp.T, cp.E),), x)
        want, _ = cp.flat_step(*cp.weights(0), torch.zeros(cp.B, cp.T, cp.E), *x)
        torch.testing.assert_close(y, want, rtol=1.3e-6, atol=1e-5)


def test_a_constant_returned_as_an_output_is_fresh_on_every_call() -> None:
    def const_out(
        w: torch.Tensor, w_out: torch.Tensor, cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(cp.V, dtype=torch.float32).expand(x.shape[0], 1, cp.V) * 2.0  # needs no input
        return y, cache.index_copy(1, pos, F.linear(x, w))

    loaded = bound(const_out, FAST, 1)
    (first,), _ = FAST.run(loaded, (torch.zeros(cp.B, cp.T, cp.E),), cp.inputs(0, 1, 0))
    first.add_(1.0)  # the caller owns its outputs
    (second,), _ = FAST.run(loaded, (torch.zeros(cp.B, cp.T, cp.E),), cp.inputs(0, 1, 0))
    torch.testing.assert_close(second[0, 0], torch.arange(cp.V, dtype=torch.float32) * 2.0)


def test_common_subexpressions_merge_only_equal_calls() -> None:
    def repeats(
        w: torch.Tensor, w_out: torch.Tensor, cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = pos[None, :, None].expand(x.shape[0], x.shape[1], x.shape[2])  # built twice, as per layer
        h = F.linear(x, w)
        cache = cache.scatter(1, idx, h).scatter(1, pos[None, :, None].expand(x.shape[0], x.shape[1], x.shape[2]), h)
        as_float, as_int = pos * 1.0, pos * 1  # equal in Python, different dtypes: must stay apart
        y = F.linear(cache.sum(1, keepdim=True), w_out) + as_float.sum() + as_int.sum()
        return y, cache

    loaded = bound(repeats, READABLE, 2)
    code = loaded.call.func.__self__.code  # type: ignore[attr-defined]
    assert code.count("aten.expand") == 1 and code.count("aten.mul.Tensor") == 2
    (y,), (new,) = READABLE.run(loaded, (torch.zeros(cp.B, cp.T, cp.E),), cp.inputs(3, 2, 5))
    want_y, want_new = repeats(*cp.weights(0), torch.zeros(cp.B, cp.T, cp.E), *cp.inputs(3, 2, 5))
    torch.testing.assert_close(new, want_new, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(y, want_y, rtol=1.3e-6, atol=1e-4)


_BOUND: dict[tuple[int, bool], LoadedProgram] = {}


def _bound_once(s: int, fast: bool) -> LoadedProgram:
    """Programs compiled once per module run (hypothesis calls the test many times)."""
    if (s, fast) not in _BOUND:
        _BOUND[(s, fast)] = bound(cp.scatter_step, FAST if fast else PURE, s)
    return _BOUND[(s, fast)]


@settings(deadline=None, max_examples=25)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([1, 3]), st.integers(0, cp.T - 3), st.integers(0, 2**16)), min_size=1, max_size=6
    )
)
def test_in_place_and_pure_agree_for_any_sequence_of_writes(steps: list[tuple[int, int, int]]) -> None:
    """Whatever slots are written, in any order and overlap, both forms give the same outputs and cache."""
    fast_cache = (torch.zeros(cp.B, cp.T, cp.E),)
    pure_cache = (torch.zeros(cp.B, cp.T, cp.E),)
    for s, start, seed in steps:
        x = cp.inputs(seed, s, start)
        (y_fast,), fast_cache = FAST.run(_bound_once(s, True), fast_cache, x)
        (y_pure,), pure_cache = PURE.run(_bound_once(s, False), pure_cache, x)
        torch.testing.assert_close(y_fast, y_pure, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(fast_cache[0], pure_cache[0], rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [FAST, PURE], ids=["in_place", "pure"])
def test_a_16_bit_cache_is_scattered_as_int16_bits_with_torchs_exact_result(
    backend: CpuBackend, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's scatter of a bf16/fp16 tensor copies all of it twice per call; the bound program scatters
    int16 bits instead (in place, or out of place in the pure form) and gives the same bits as the
    same program bound without that rewrite."""
    loaded = {s: bound(cp.scatter_step, backend, s, dtype) for s in (3, 1)}
    gm = loaded[1].call.func.__self__  # type: ignore[attr-defined]  # functools.partial(gm.forward, ...)
    targets = {n.target for n in gm.graph.nodes}
    want = cpu_passes.scatter_bits_ if backend is FAST else cpu_passes.scatter_bits
    assert want in targets and torch.ops.aten.scatter.src not in targets and torch.ops.aten.scatter_.src not in targets
    monkeypatch.setattr(cpu_passes, "scatter_half_floats_as_bits", lambda gm: 0)
    torchs = {s: bound(cp.scatter_step, backend, s, dtype) for s in (3, 1)}
    ours, theirs = (torch.zeros(cp.B, cp.T, cp.E, dtype=dtype),), (torch.zeros(cp.B, cp.T, cp.E, dtype=dtype),)
    for i, (s, start) in enumerate([(3, 0), (1, 3), (1, 4), (3, 9)]):
        x = cp.inputs(i, s, start, dtype)
        (y,), ours = backend.run(loaded[s], ours, x)
        (want_y,), theirs = backend.run(torchs[s], theirs, x)
        assert torch.equal(ours[0].view(torch.int16), theirs[0].view(torch.int16)) and torch.equal(y, want_y)
        assert torch.count_nonzero(ours[0]) > 0

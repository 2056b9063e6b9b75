"""KV-cache quantization, piece by piece: the saturating cast, float8 cache writes (contiguous, block,
flash decoding), the CPU backend's in-place write of a float8 cache, and the config checks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nxdi.core.config import cpu_support
from nxdi.core.programs import block_kv, flash_decoding, kv_cache, layers
from nxdi.core.programs.collectives import SINGLE
from nxdi.effects.backends.base import Signature, WeightSet
from nxdi.effects.backends.cpu import CpuBackend
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError

F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(kv_cache.bits(a), kv_cache.bits(b))


# --- the cast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", F8)
def test_store_saturates_at_the_largest_finite_value(dtype: torch.dtype) -> None:
    top = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
    x = torch.tensor([1.5, -0.25, 2 * top, -2 * top, float("inf"), -float("inf")])
    assert kv_cache.store(x, dtype).float().tolist() == [1.5, -0.25, top, -top, top, -top]
    assert kv_cache.store(x.bfloat16(), dtype).float().tolist() == [1.5, -0.25, top, -top, top, -top]
    assert kv_cache.store(torch.tensor([float("nan")]), dtype).float().isnan().all()


def test_store_is_a_plain_cast_to_any_other_dtype() -> None:
    x = torch.randn(64) * 1000
    assert torch.equal(kv_cache.store(x, torch.bfloat16), x.to(torch.bfloat16))
    assert kv_cache.store(x, torch.float32) is x


# --- the writes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", F8)
def test_a_contiguous_write_stores_the_float8_cast_out_of_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 2, 8, 4, dtype=dtype)  # [B, K, T, D]
    new = torch.randn(2, 2, 3, 4, generator=g) * 300  # past e4m3fn's 448 in places
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]])
    out = kv_cache.write(cache, new, slots)
    want = kv_cache.store(kv_cache.write(torch.zeros(2, 2, 8, 4), new, slots), dtype)
    assert _same_bytes(out, want)
    assert torch.count_nonzero(kv_cache.bits(cache)) == 0, "the given cache is unchanged"
    assert not out.float().isnan().any()


@pytest.mark.parametrize("dtype", F8)
def test_a_block_write_stores_the_float8_cast_and_sends_padding_to_the_garbage_block(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(5, 4, 2, 3, dtype=dtype)  # [N+1, bs, K, D]: block 4 is garbage
    new = torch.randn(2, 3, 2, 3, generator=g) * 10  # [B, S, K, D]
    slot_mapping = torch.tensor([[0, 1, 9], [13, -1, 2]])
    out = block_kv.write(cache, new, slot_mapping)
    want = kv_cache.store(block_kv.write(torch.zeros(5, 4, 2, 3), new, slot_mapping), dtype)
    assert _same_bytes(out, want)
    gathered = block_kv.gather(out, torch.tensor([[[0, 2]], [[3, 0]]]))  # [B, K, R*NB*bs, D], float8
    assert gathered.dtype == dtype


@pytest.mark.parametrize("dtype", F8)
def test_flash_decoding_writes_and_reads_a_float8_cache(dtype: torch.dtype) -> None:
    """One rank owning every position (a group of 1): the decode path's gather/where/scatter of the
    owned slot run on the float8 cache and attend over its dequantized values."""
    g = torch.Generator().manual_seed(2)
    b, t, h, d = 2, 6, 2, 4
    k_cache = kv_cache.store(torch.randn(b, 1, t, d, generator=g), dtype)
    v_cache = kv_cache.store(torch.randn(b, 1, t, d, generator=g), dtype)
    q, k, v = (torch.randn(b, 1, n, d, generator=g) for n in (h, 1, 1))
    slots = torch.tensor([[3], [5]])
    o, k_new, v_new = flash_decoding.attend(q, k, v, k_cache, v_cache, slots=slots, window=None, group=1, coll=SINGLE)
    assert _same_bytes(k_new, kv_cache.write(k_cache, k.transpose(1, 2), slots))
    assert _same_bytes(v_new, kv_cache.write(v_cache, v.transpose(1, 2), slots))
    mask = layers.fold_mask(layers.visible_mask(slots, t, window=None), h)
    torch.testing.assert_close(o, layers.attend(q, k_new, v_new, mask), rtol=1e-5, atol=1e-5)


# --- the CPU backend writes a float8 cache in place ---------------------------------------------

_SIG = Signature(weights=("w",), cache=("cache",), inputs=("x", "slots"), outputs=("y",))


def _program(w: Tensor, cache: Tensor, x: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, 1, S, D] projected and written at slots [B, S] of cache [B, 1, T, D]; y reads the new cache."""
    cache = kv_cache.write(cache, x @ w, slots)
    return cache.float().sum((1, 2)), cache


@pytest.mark.parametrize("dtype", F8)
def test_the_cpu_backend_writes_a_float8_cache_in_place(dtype: torch.dtype) -> None:
    w = torch.eye(4) * 3
    example = (w, torch.zeros(2, 1, 8, 4, dtype=dtype), torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, dtype=torch.long))
    fast, pure = CpuBackend(), CpuBackend(pack_weights=False, in_place_cache=False)
    loaded = {
        b: b.bind(b.compile(_program, _SIG, example, name="p"), WeightSet(tensors=(w,))).unwrap() for b in (fast, pure)
    }
    assert loaded[fast].in_place == (True,) and loaded[pure].in_place == (False,)
    g = torch.Generator().manual_seed(3)
    caches = {b: torch.zeros(2, 1, 8, 4, dtype=dtype) for b in (fast, pure)}
    eager = torch.zeros(2, 1, 8, 4, dtype=dtype)
    for step in range(4):
        x, slots = torch.randn(2, 1, 1, 4, generator=g) * 200, torch.tensor([[step], [7 - step]])
        want_y, eager = _program(w, eager, x, slots)
        for b in (fast, pure):
            given = caches[b]
            (y,), (caches[b],) = b.run(loaded[b], (given,), (x, slots))
            assert (caches[b] is given) == (b is fast), "the fast graph returns the given cache itself"
            assert _same_bytes(caches[b], eager)
            torch.testing.assert_close(y, want_y)


# --- configuration -----------------------------------------------------------------------------


def test_kv_quant_config_takes_nxd_names_and_torch_dtypes() -> None:
    spec = NeuronConfig(
        kv_quant_config={"quant_dtype": torch.float8_e5m2, "k_quant_method": "per_tensor_symmetric"}
    ).spec
    assert spec.kv_dtype == "float8_e5m2" and spec.kv_quant_config is not None
    assert NeuronConfig(kv_cache_quant=True).spec.kv_dtype == "float8_e4m3fn"
    assert NeuronConfig(kv_quant_config={}).spec.kv_dtype == "float8_e4m3fn"  # a config alone quantizes
    assert cpu_support.check_cpu_support(spec).unwrap() == spec


def test_bad_kv_quant_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(IncompatibleConfigError) as caught:
        NeuronConfig(kv_quant_config={"quant_dtype": "int8", "k_quantization_type": "x"})
    fields = {p.field for p in caught.value.error.problems}
    assert fields == {"kv_quant_config.quant_dtype", "kv_quant_config.k_quantization_type"}
    assert "'float8_e4m3fn' | 'float8_e5m2'" in str(caught.value)
    with pytest.raises(IncompatibleConfigError, match=r"k_quant_method='per_channel_symmetric': must be per_tensor"):
        NeuronConfig(kv_quant_config={"k_quant_method": "per_channel_symmetric"})  # NxD asserts the same


def test_scaled_kv_quantization_is_refused_on_cpu_with_the_reason() -> None:
    spec = NeuronConfig(kv_quant_config={"direct_cast": False, "v_quant_method": "per_key_symmetric"}).spec
    problems = cpu_support.check_cpu_support(spec).failure().problems
    assert {p.field for p in problems} == {"kv_quant_config.direct_cast", "kv_quant_config.v_quant_method"}
    assert all("K/V scales" in p.reason for p in problems)
    assert problems[0].fix == "set kv_quant_config.direct_cast=True"


@pytest.mark.parametrize("backend", ["cpu", "xla", "neuron"])
def test_a_float8_cache_runs_on_every_backend(backend: str) -> None:
    """The HLO backends lower a float8 cache as a float8 parameter (tests/xla runs it)."""
    for kwargs in ({"kv_cache_quant": True}, {"kv_quant_config": {}}):
        spec = NeuronConfig(**kwargs).spec
        assert cpu_support.check_backend_support(spec, backend).unwrap() == spec


def test_the_cache_bytes_are_viewed_on_the_cpu_only() -> None:
    """CPU torch scatters a float8 cache through its uint8 bytes; elsewhere the float8 tensor itself
    is written (a dtype view is no HLO op: torch-xla would run it on the host)."""
    cache = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
    assert kv_cache.bits(cache).dtype == torch.uint8 and kv_cache.bits(cache).data_ptr() == cache.data_ptr()
    assert kv_cache.bits(torch.zeros(2, 3, dtype=torch.float8_e4m3fn, device="meta")).dtype == torch.float8_e4m3fn
    assert kv_cache.bits(torch.zeros(2, 3)).dtype == torch.float32

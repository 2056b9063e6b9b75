"""The order in which the decode linears read weight rows (`kernels.read_order`): a speed choice
per CPU that never changes a result.

- Every linear kernel (bf16 on this CPU's path and the widened one, int8, both float8 formats,
  per-row and blockwise scales, the fused int8 and bf16 SwiGLUs) gives the same bits under each preset
  ("intel", "amd", "auto"), for 1-4 rows of x and row counts that end in partial groups and blocks,
  and the same as F.linear in float64 up to the output's rounding.
- The default is "auto"; a preset is set for the process and the previous one returned; an
  unknown one is refused with the accepted ones, and leaves the setting as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from nxdi.effects.backends import kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"nxdi's kernels cannot run here: {kernels.why_not()}")


@pytest.fixture
def restore_preset() -> Iterator[None]:
    before = kernels.read_order()
    yield
    kernels.read_order(before)


def _calls(m: int, k: int, n: int) -> dict[str, tuple[Any, tuple[Tensor, ...]]]:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    wb = torch.randn(n, k, generator=g).bfloat16()
    wi = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wi2 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale, scale2 = torch.rand(n, generator=g), torch.rand(n, generator=g)
    blocks = torch.rand(1, k // 32, generator=g)  # one block row, 32-column blocks
    ops = torch.ops.nxdi_kernels
    return {
        "bf16": (ops.bf16_linear, (x[: min(m, 4)], wb)),
        "bf16 widened": (ops.bf16_linear_widened, (x, wb)),
        "int8": (ops.int8_linear, (x, wi, scale)),
        "int8 blockwise": (ops.int8_linear, (x, wi, blocks)),
        "float8 e4m3": (ops.fp8_linear, (x, (wb.float() / 4).to(torch.float8_e4m3fn), scale)),
        "float8 e5m2": (ops.fp8_linear, (x, wb.to(torch.float8_e5m2), scale)),
        "int8 swiglu": (ops.int8_swiglu, (x, wi, scale, wi2, scale2)),
        "bf16 swiglu": (ops.bf16_swiglu, (x[: min(m, 4)], wb, (wb.float() / 2).bfloat16())),
        "bf16 swiglu widened": (ops.bf16_swiglu_widened, (x, wb, (wb.float() / 2).bfloat16())),
    }


@pytest.mark.usefixtures("restore_preset")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
# n: 37 rows: a group of blocks 4 rows apart ("intel") or blocks of adjacent rows only ("amd"'s
# groups are 64-128 rows); 301 and 1031: split over two threads at an odd row, each part read in
# whole groups (with the prefetched next blocks), then blocks of adjacent rows, then single rows.
@pytest.mark.parametrize("n", [37, 301, 1031])
def test_every_preset_gives_the_same_bits(m: int, n: int) -> None:
    calls = _calls(m, 256, n)
    results: dict[str, dict[str, Tensor]] = {}
    for preset in kernels.READ_ORDERS:
        kernels.read_order(preset)
        results[preset] = {name: op(*args) for name, (op, args) in calls.items()}
    for preset in ("amd", "auto"):
        for name, got in results[preset].items():
            assert torch.equal(got, results["intel"][name]), (preset, name)
    # and right: the bf16 kernel against float64 (the other kernels' own tests hold them to theirs)
    x, w = calls["bf16"][1]
    want = x.double() @ w.double().T
    got = results["amd"]["bf16"].double()
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-5 * want.abs().max()).all()


@pytest.mark.usefixtures("restore_preset")
def test_presets_are_set_and_returned_and_a_bad_one_refused() -> None:
    kernels.read_order("auto")
    assert kernels.read_order() == "auto"
    assert kernels.read_order("amd") == "auto"
    assert kernels.read_order("intel") == "amd"
    assert kernels.read_order() == "intel"
    with pytest.raises(ValueError, match=r"one of \('auto', 'intel', 'amd'\), not 'arm'"):
        kernels.read_order("arm")
    assert kernels.read_order() == "intel"


def test_the_default_is_auto() -> None:
    # A fresh process: the tests above restore what they set, but another test file may not have run.
    import subprocess
    import sys

    code = "from nxdi.effects.backends import kernels; print(kernels.read_order())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "auto"

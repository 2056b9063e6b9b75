"""The decode linears' next-block prefetch (`kernels.next_block_prefetch`): a speed choice per CPU
that never changes a result.

- Every linear kernel (bf16 on this CPU's path and the widened one, int8, both float8 formats,
  per-row and blockwise scales, the fused int8 SwiGLU) gives the same bits with the prefetch "on",
  "off" and "auto", for 1-4 rows of x and row counts that end in partial groups and blocks.
- The default is "auto"; a mode is set for the process and the previous one returned; an unknown
  mode is refused with the accepted ones, and leaves the setting as it was.
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
def restore_mode() -> Iterator[None]:
    before = kernels.next_block_prefetch()
    yield
    kernels.next_block_prefetch(before)


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
    }


@pytest.mark.usefixtures("restore_mode")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
# n: 37 rows end in a partial group; 301 split over two threads at an odd row, with whole groups
# of 8 rows read 4 apart (the prefetched next blocks) on each side.
@pytest.mark.parametrize("n", [37, 301])
def test_every_mode_gives_the_same_bits(m: int, n: int) -> None:
    calls = _calls(m, 256, n)
    results: dict[str, dict[str, Tensor]] = {}
    for mode in ("off", "on", "auto"):
        kernels.next_block_prefetch(mode)
        results[mode] = {name: op(*args) for name, (op, args) in calls.items()}
    for mode in ("on", "auto"):
        for name, got in results[mode].items():
            assert torch.equal(got, results["off"][name]), (mode, name)


@pytest.mark.usefixtures("restore_mode")
def test_modes_are_set_and_returned_and_a_bad_one_refused() -> None:
    kernels.next_block_prefetch("auto")
    assert kernels.next_block_prefetch() == "auto"
    assert kernels.next_block_prefetch("off") == "auto"
    assert kernels.next_block_prefetch("on") == "off"
    assert kernels.next_block_prefetch() == "on"
    with pytest.raises(ValueError, match=r"one of \('auto', 'on', 'off'\), not 'fast'"):
        kernels.next_block_prefetch("fast")
    assert kernels.next_block_prefetch() == "on"


def test_the_default_is_auto() -> None:
    # A fresh process: the tests above restore what they set, but another test file may not have run.
    import subprocess
    import sys

    code = "from nxdi.effects.backends import kernels; print(kernels.next_block_prefetch())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "auto"

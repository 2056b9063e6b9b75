"""nxdi's own CPU kernels, built ahead of time or on first use. Effects: runs the C++ compiler, writes a cache folder.

Five source files, one library (torch ops `nxdi_kernels::*`), mostly for decode steps:
- `quantized_linear.cpp`: the weight-only int8 and float8 linears of quantized models
  (`cpu_passes.quantized_weight_linears`), 1-4 rows of x, per-row or blockwise scales. They read
  each weight byte once, near the memory bandwidth for int8, where torch's own
  `_weight_int8pack_mm` is compute-bound at batch 1 and torch has no float8 one
  (docs/cpu-backend.md). Prefill's GEMMs get their float weight from its one-pass
  `weight_dequantize`. The MLP's gate and up linears with their SwiGLU take one op
  (`cpu_fusions.fused_swiglus`), calling torch's own SLEEF exp so silu keeps torch's bits.
- `bf16_linear.cpp`: the bf16 linear (`cpu_passes.bf16_weight_linears`), 1-4 rows (on AVX512-BF16,
  or widened to fp32 on AVX-512 CPUs without it, `bf16_native()`), 1-16 on CPUs with AMX
  (`bf16_max_rows`): oneDNN's and MKL's bf16 paths read the weights well below the memory
  bandwidth at decode's few rows, and far below it without AVX512-BF16. Over two such linears, a
  decode MLP's gate, up and SwiGLU in one op (`bf16_swiglu`, `cpu_fusions.fused_swiglus`).
- `bf16_pointwise.cpp`: a bf16 RMSNorm and its weight product in one op
  (`cpu_fusions.fused_rms_norms`), with the residual sum before it (`fused_residual_norms`), and
  RoPE in one op (`cpu_fusions.fused_ropes`), where torch dispatches seven and four ops, each slow
  just after a linear has streamed its weights (`bf16_lanes.h`: their shared bf16 lanes).
- `decode_attention.cpp`: bf16 attention with a bool mask over a decode step's few query rows in
  one op (`cpu_fusions.decode_attentions`), where torch's cost 120-230 us per call in the step; and
  the whole run between a decode step's qkv and o projections (RoPE, cache writes, the GQA fold,
  attention) as one op called from C++ (`cpu_attention_blocks`).
- `graph_runner.cpp`: `GraphRunner`, which calls a bound graph's long runs of ops from C++
  (`cpu_runner.run_in_cpp`), without a Python frame per node.

It is compiled with torch's C++ extension tooling (the system's g++, and ninja, a dependency) when
the CPU backend first compiles a model (40-60 s on 2 cores; or at the first
bind, if the model was compiled elsewhere), or ahead of time by `nxdi kernels` (the set-up step
runs it), into a folder keyed by the torch version and the sources' hash (`NXDI_KERNEL_DIR`,
default `~/.cache/nxdi/kernels`); later loads only load the library. Where it cannot be built or
run (no AVX-512, no compiler), `load()` warns once with the reason and the CPU backend falls back
to torch's int8 kernel (float8 and blockwise weights then dequantize with torch's ops) and keeps
oneDNN's GEMM for bf16.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from nxdi.effects import env

SOURCES = tuple(
    Path(__file__).with_name(f)
    for f in (
        "quantized_linear.cpp",
        "bf16_linear.cpp",
        "bf16_pointwise.cpp",
        "decode_attention.cpp",
        "graph_runner.cpp",
    )
)
HEADERS = tuple(Path(__file__).with_name(h) for h in ("bf16_lanes.h", "read_order.h"))
"""Included by the sources: part of what a build is keyed by."""
LIBRARY = "nxdi_kernels"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-fopenmp"]
_loaded: bool | None = None
_why_not: str | None = None


def kernel_dir() -> Path:
    """The folder holding the built library for this torch version and these sources."""
    hashed = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(_FLAGS).encode()
    digest = hashlib.sha256(hashed).hexdigest()[:16]
    root = Path(env.read_env().kernel_dir or Path.home() / ".cache" / "nxdi" / "kernels")
    return root / f"torch-{torch.__version__}-{digest}"


def library_file() -> Path:
    """The built library's path (present once `build()` ran for this torch version and these sources)."""
    return kernel_dir() / f"{LIBRARY}.so"


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the kernels (they need AVX-512), or None when it can."""
    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability.startswith("AVX512") else f"they need AVX-512 and this CPU offers {capability}"


def build() -> Path:
    """Compile the kernels into `kernel_dir()` (built beside it, then renamed in) and load them into
    this process; the library file.

    Raises:
        RuntimeError / OSError: the compiler or the build failed (torch's message says why).
    """
    from torch.utils import cpp_extension

    target = library_file()
    if target.is_file():
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent.parent))
    try:
        with env.path_prepended(Path(sys.executable).parent):  # the `ninja` nxdi depends on
            cpp_extension.load(
                name=LIBRARY,
                sources=[str(s) for s in SOURCES],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(work),
                is_python_module=False,
                verbose=False,
            )
        with contextlib.suppress(OSError):  # another process published the same build first
            os.replace(work, target.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def load() -> bool:
    """Make `torch.ops.nxdi_kernels` available, building it on first use; False (see `why_not`)
    when this CPU or machine cannot run or build it."""
    global _loaded, _why_not
    if _loaded is None:
        _loaded, _why_not = _try_load()
        if not _loaded:  # once per process: a slower fallback is reported, not silent
            warnings.warn(
                f"nxdi's CPU kernels are not used: {_why_not}; decode linears use torch's kernels", stacklevel=2
            )
    return _loaded


def why_not() -> str | None:
    """Why `load()` returned False (None when it did not, or was not called)."""
    return _why_not


def _try_load() -> tuple[bool, str | None]:
    unsupported = cpu_unsupported()
    if unsupported is not None:
        return False, unsupported
    try:
        library = library_file()
        if library.is_file():
            torch.ops.load_library(str(library))
        else:
            build()  # torch's extension loader loads the library it builds
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        return False, f"building it in {kernel_dir()} failed: {last}"
    return True, None


def bf16_supported() -> bool:
    """Whether `nxdi_kernels::bf16_linear` can run here: the library loads (any AVX-512 CPU)."""
    return load()


def bf16_native() -> bool:
    """Whether the bf16 kernel runs on AVX512-BF16's `vdpbf16ps` here; without it, it widens bf16
    to fp32 in registers and uses FMAs (equally exact, more instructions per weight)."""
    return bf16_supported() and bool(torch.ops.nxdi_kernels.bf16_dot_supported())


def bf16_max_rows(k: int) -> int:
    """The most rows of x `nxdi_kernels::bf16_linear` takes for a weight of `k` input columns here:
    16 on the AMX tiles (a CPU with AMX whose OS grants the tile state, and `k` a multiple of 32),
    else 4; 0 where the kernel cannot run."""
    return int(torch.ops.nxdi_kernels.bf16_max_rows(k)) if bf16_supported() else 0


READ_ORDERS = ("auto", "intel", "amd")


def read_order(preset: str | None = None) -> str:
    """The order in which the decode linears read weight rows (how far apart the rows read at once
    lie, and whether the next block is prefetched in software), a preset chosen per CPU by
    measurement: "auto" (the default: "amd" on AMD CPUs, "intel" elsewhere), "intel" or "amd"
    (kernels/read_order.h; docs/cpu-backend.md, "Decode linears on AMD CPUs"). With `preset`, sets
    it for this process and returns the previous one; without, the current one. Results do not
    depend on it.

    Raises:
        ValueError: `preset` is not one of READ_ORDERS.
        RuntimeError: the kernels cannot run here (`load()` returned False; `why_not()` says why).
    """
    if preset is not None and preset not in READ_ORDERS:
        raise ValueError(f"read_order: the preset must be one of {READ_ORDERS}, not {preset!r}")
    if not load():
        raise RuntimeError(f"nxdi's CPU kernels are not available: {why_not()}")
    return str(torch.ops.nxdi_kernels.read_order(preset))

"""`nxdi kernels`: build nxdi's CPU decode kernels now (the set-up step runs it) and say what runs here.

    nxdi kernels [--check]

Builds the kernel library (`nxdi.effects.backends.kernels`: the quantized and bf16 decode linears)
into its cache folder when it is not there yet (about 40 s on 2 cores, once per machine, torch
version and kernel sources), then prints the folder and which kernels this CPU runs. `make setup` runs it, so
`compile()` and `load()` find the library built. `--check` builds nothing: it only reports.

Exit status: 0 when the library is built and loads, or when this CPU cannot run it at all (no
AVX-512: there is nothing to build, and the CPU backend uses torch's kernels); 1 when the build
failed on a CPU that could run it (the message says why; the CPU backend then falls back too).
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "kernels",
        help="build nxdi's CPU decode kernels (the set-up step runs this) and report which run here",
        allow_abbrev=False,
    )
    p.add_argument("--check", action="store_true", help="build nothing; report whether the library is built")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nxdi.effects.backends import kernels

    unsupported = kernels.cpu_unsupported()
    if unsupported is not None:
        print(f"nxdi kernels: not built: {unsupported}; the CPU backend uses torch's kernels")
        return 0
    folder = kernels.kernel_dir()
    if args.check:
        built = kernels.library_file().is_file()
        print(f"nxdi kernels: {'built' if built else 'not built yet'} in {folder}")
        return 0 if built else 1
    print(f"nxdi kernels: building (if needed) in {folder} ...", flush=True)
    if not kernels.load():
        print(f"nxdi kernels: not available: {kernels.why_not()}; the CPU backend falls back to torch's kernels")
        return 1
    rows = kernels.bf16_max_rows(32)  # 16: AMX tiles
    if not kernels.bf16_native():
        bf16 = f"bf16 decode linears (widened to fp32 with AVX-512 FMAs, up to {rows} rows: no AVX512-BF16)"
    elif rows > 4:
        bf16 = f"bf16 decode linears (AVX512-BF16, AMX tiles up to {rows} rows)"
    else:
        bf16 = f"bf16 decode linears (AVX512-BF16, up to {rows} rows: no AMX)"
    print(
        f"nxdi kernels: ready in {folder}: int8 and float8 decode linears, their SwiGLU and dequantize, bf16 RMSNorm (with its residual sum), RoPE and decode attention; {bf16}"
    )
    return 0

#!/usr/bin/env bash
# The CPU benchmarks behind docs/cpu-backend.md's targets, on a lent device machine's CPU pinned to
# two idle cores (the second machine the performance targets are held on).
#
# That machine has torch, transformers, attrs, safetensors and ninja but not `returns`, and no
# network, so carry it as a wheel. Here, once, in the repository root:
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: -d .whl \
#     "returns==$(.venv/bin/python -c 'from importlib.metadata import version; print(version("returns"))')"
# (a pure-Python wheel: the device's Python 3.12 takes it as it is; `.whl/` is ignored by git).
# Then one device call (about 8 minutes of benchmarks; the results come back under $OUT):
#   run(command="bash tools/device-cpu-bench.sh", carry=[".whl"], timeout_s=590)
# On any other machine, to check the script: PYTHON=.venv/bin/python CORES=0,1 OUT=/tmp/out bash tools/device-cpu-bench.sh
set -euo pipefail
PYTHON=${PYTHON:-python3}
CORES=${CORES:-2,3}
OUT=${OUT:?set OUT to the folder the results go to}
WORK=${WORK:-/tmp/nxdi-bench}
mkdir -p "$OUT" "$WORK"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nxdi-site .whl/*.whl
  export PYTHONPATH="/tmp/nxdi-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
{ lscpu; "$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } > "$OUT/machine.txt"

nxdi() {  # the `nxdi` command, on the two cores
  taskset -c "$CORES" "$PYTHON" -c 'import sys; from nxdi.shell.cli.main import main; sys.exit(main())' "$@" --threads 2 --work-dir "$WORK"
}
# 1.1B shape: TTFT and TPOT against transformers at batch 1 and 4; compile() and load() times.
nxdi bench generate --shape tiny --batch-size 1 4 --prompt-len 128 --new-tokens 16 --repeat 3 --compare-hf 2>&1 | grep -v "Loading weights" | tee "$OUT/generate-tiny.txt"
# 1.1B shape, batch 1: int8 and bf16 decode against the measured roofline and transformers.
nxdi bench roofline --shape tiny --batch-size 1 --weights int8-per-channel --new-tokens 128 --repeat 3 2>&1 | grep -v "Loading weights" | tee "$OUT/roofline-tiny.txt"
# ~120M shape, batch 1.
nxdi bench generate --shape small --batch-size 1 --prompt-len 128 --new-tokens 128 --repeat 3 --compare-hf 2>&1 | grep -v "Loading weights" | tee "$OUT/generate-small.txt"

"""A process that compiles a tiny model into one folder on request, in forked children it can kill.

Run as `python -m tests.support.compile_server CHECKPOINT FOLDER` (cwd: the repository). Importing
torch and nxdi, and a process's first compile, take longer than compiling the tiny model, so this
process warms up once (a compile and a load beside FOLDER, on one torch thread, so that no thread
pool exists to break a fork) and forks a child per request. One request per stdin line, one
answer per stdout line:

    compile A|B SECONDS   -> `compiled exit0|exit1|killed ELAPSED`: compile variant A or B in a child,
                             SIGKILLed after SECONDS unless it finished first
    swapkill A|B SECONDS  -> the same, the folder swap slowed down (0.2 s before the exchange and
                             0.2 s after it) and the kill SECONDS after the swap started
    check                 -> `checked BUCKETS` (the token buckets of what loaded) or `checkfail ERROR`
    quit
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from nxdi import NeuronConfig, load_pretrained_config
from nxdi.effects import staging
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM

VARIANTS: dict[str, list[int]] = {"A": [32], "B": [24, 32]}
"""Token-generation buckets of each variant: different programs, so a re-compile traces again."""


def config(checkpoint: str | os.PathLike[str], variant: str) -> LlamaInferenceConfig:
    """The tiny model's configuration of `variant` (weights saved in the folder too)."""
    neuron = NeuronConfig(
        batch_size=1,
        max_context_length=16,
        seq_len=32,
        torch_dtype="float32",
        enable_bucketing=True,
        context_encoding_buckets=[16],
        token_generation_buckets=VARIANTS[variant],
        save_sharded_checkpoint=True,
        skip_warmup=True,
    )
    return LlamaInferenceConfig(neuron, load_config=load_pretrained_config(checkpoint))


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when the server dies (no orphan compiles)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _fork(action: Callable[[], object]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _die_with_parent()
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _slow_swap(marker: Path) -> None:
    """In a child: make the folder swap take 0.4 s, touching `marker` when it starts (the exchange
    itself happens 0.2 s later), so a kill can land on either side of it."""
    exchange = staging.exchange

    def slow(a: Path, b: Path) -> bool:
        marker.touch()
        time.sleep(0.2)
        done = exchange(a, b)
        time.sleep(0.2)
        return done

    staging.exchange = slow


def _started(pid: int, marker: Path) -> bool:
    """Wait for `marker` to appear; False when `pid` ended first."""
    while not marker.exists():
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
        time.sleep(0.002)
    return True


def _wait(pid: int, limit: float) -> str:
    """Reap `pid`, SIGKILLing it after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return f"exit{os.waitstatus_to_exitcode(status)}"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return "killed" if code == -signal.SIGKILL else f"exit{code}"


def main(checkpoint: str, folder: str) -> None:
    marker = Path(folder).parent / ".swap-started"

    def compile_variant(variant: str, *, slow: bool = False) -> None:
        if slow:
            _slow_swap(marker)
        NeuronLlamaForCausalLM(checkpoint, config(checkpoint, variant)).compile(folder)

    def check() -> None:
        model = NeuronLlamaForCausalLM(folder)
        model.load(folder)
        print("checked", ",".join(map(str, model.neuron_config.token_generation_buckets)), flush=True)

    # Warm up here, once: the first compile and load of a process import and initialize much
    # more than later ones. One torch thread keeps this process safe to fork afterwards.
    torch.set_num_threads(1)
    scratch = Path(folder).parent / ".warm-up"
    NeuronLlamaForCausalLM(checkpoint, config(checkpoint, "A")).compile(scratch)
    NeuronLlamaForCausalLM(scratch).load(scratch)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "compile":
            start = time.monotonic()
            pid = _fork(functools.partial(compile_variant, words[1]))
            status = _wait(pid, float(words[2]))
            print("compiled", status, f"{time.monotonic() - start:.3f}", flush=True)
        elif words[0] == "swapkill":
            marker.unlink(missing_ok=True)
            start = time.monotonic()
            pid = _fork(functools.partial(compile_variant, words[1], slow=True))
            status = _wait(pid, float(words[2])) if _started(pid, marker) else "exit-before-swap"
            print("compiled", status, f"{time.monotonic() - start:.3f}", flush=True)
        elif words[0] == "check":
            if _wait(_fork(check), 120.0) != "exit0":
                print("checkfail", flush=True)
        else:
            return


if __name__ == "__main__":
    main(*sys.argv[1:3])

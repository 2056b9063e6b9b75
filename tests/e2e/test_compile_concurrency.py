"""A compiled-model folder under concurrency and interruption: always one complete compile.

- A re-compile SIGKILLed at moments spread over its run leaves the old compile or the new one,
  loadable, never a mix or nothing.
- Two processes compiling one folder at once take turns; the folder ends as the last one wrote it.
- NXDI_LOCK_TIMEOUT=0 fails at once, naming the process that holds the folder; a dead holder
  holds nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nxdi.effects import staging
from nxdi.shell.exceptions import FolderLockedError
from nxdi.shell.models import NeuronLlamaForCausalLM
from nxdi.testing import checkpoints
from tests.support import compile_server

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = checkpoints.build_checkpoint(
        tmp_path_factory.mktemp("llama"), "llama", checkpoints.SaveFormat.SAFETENSORS
    )
    return path


def _buckets(folder: Path) -> list[int]:
    """The token buckets of the configuration compiled in `folder`."""
    doc = json.loads((folder / "neuron_config.json").read_text())
    return list(doc["neuron_config"]["token_generation_buckets"])


class Server:
    """`tests.support.compile_server` in a subprocess (killed, with its children, when done)."""

    def __init__(self, checkpoint: Path, folder: Path, log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.compile_server", str(checkpoint), str(folder)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.ask(None) == "ready"

    def ask(self, request: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request is not None:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        assert line, f"the compile server died; its log: {self.log.name}"
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def server(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    folder = tmp_path / "compiled"
    srv = Server(checkpoint, folder, tmp_path / "server.log")
    try:
        yield srv, folder
    finally:
        srv.close()


def _check(srv: Server) -> list[int]:
    answer = srv.ask("check")
    assert answer.startswith("checked "), f"the folder does not load: {answer} (see {srv.log.name})"
    return [int(b) for b in answer.split()[1].split(",")]


def test_a_recompile_killed_at_any_moment_leaves_the_old_or_the_new_compile(server: tuple[Server, Path]) -> None:
    srv, folder = server
    variants = compile_server.VARIANTS
    run_s = {}  # how long a whole compile of each variant takes
    for variant in ("A", "B"):
        done = srv.ask(f"compile {variant} 60").split()
        assert done[1] == "exit0"
        run_s[variant] = float(done[2])
        assert _check(srv) == variants[variant]
    current, rng, outcomes = "B", random.Random(7), []
    moments = 8
    for i in range(moments):
        target = "A" if current == "B" else "B"
        at = run_s[target] * (i + rng.random()) / moments * 1.3  # spread over its run, and past it
        status = srv.ask(f"compile {target} {at:.3f}").split()[1]
        assert status in ("killed", "exit0"), f"the compile failed (see {srv.log.name})"
        found = _check(srv)
        assert found in (variants[current], variants[target]), found
        if status == "exit0":
            assert found == variants[target], "a compile that returned left the old folder"
        outcomes.append((status, at, found == variants[target]))
        current = target if found == variants[target] else current
    assert sum(s == "killed" for s, _, _ in outcomes) >= moments // 3, outcomes
    # Killed on either side of the exchange itself (slowed down to make room for the kill).
    target = "A" if current == "B" else "B"
    assert srv.ask(f"swapkill {target} 0.1").split()[1] == "killed"
    assert _check(srv) == variants[current]
    assert srv.ask(f"swapkill {target} 0.3").split()[1] == "killed"
    assert _check(srv) == variants[target]
    leftovers = [p for p in folder.parent.iterdir() if p.name.startswith(".compiled.nxdi-build-")]
    assert leftovers  # the old folder, killed before it was deleted
    # The next compile deletes what the killed ones left beside the folder.
    assert srv.ask("compile A 60").split()[1] == "exit0"
    leftovers = [p for p in folder.parent.iterdir() if p.name.startswith(".compiled.nxdi-") and p.is_dir()]
    assert leftovers == []
    assert _buckets(folder) == variants["A"]


_COMPILER = textwrap.dedent(
    """
    import json, sys, time, warnings
    from pathlib import Path
    from nxdi.effects import staging
    from nxdi.shell.models import NeuronLlamaForCausalLM
    from tests.support.compile_server import config
    checkpoint, folder, variant, ready, other = sys.argv[1:6]
    warnings.simplefilter("always")
    Path(ready).touch()
    deadline = time.monotonic() + 60
    while not Path(other).exists() and time.monotonic() < deadline:  # start together
        time.sleep(0.005)
    NeuronLlamaForCausalLM(checkpoint, config(checkpoint, variant)).compile(folder)
    returned = time.time()
    with staging.reading(folder):  # what compile() left, before anyone else can replace it
        doc = json.loads((Path(folder) / "neuron_config.json").read_text())
    found = doc["neuron_config"]["token_generation_buckets"]
    print(json.dumps({"returned": returned, "checked": time.time(), "found": found}))
    """
)


def test_two_processes_compiling_one_folder_take_turns(checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    ready = {v: tmp_path / f"ready-{v}" for v in "AB"}
    procs = {
        v: subprocess.Popen(
            [sys.executable, "-c", _COMPILER, str(checkpoint), str(folder), v, str(ready[v]), str(ready[o])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for v, o in (("A", "B"), ("B", "A"))
    }
    try:
        outs = {v: p.communicate(timeout=TIMEOUT) for v, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    for v, (_, err) in outs.items():
        assert procs[v].returncode == 0, err
    report = {v: json.loads(out.strip().splitlines()[-1]) for v, (out, _) in outs.items()}
    variants = compile_server.VARIANTS
    for v, o in (("A", "B"), ("B", "A")):
        # Each compile() that returned left its own compile, unless the other finished in between.
        mine, theirs = report[v], report[o]
        assert mine["found"] == variants[v] or (
            mine["found"] == variants[o] and mine["returned"] < theirs["returned"] <= mine["checked"]
        ), report
    last = max(report, key=lambda v: report[v]["returned"])
    assert _buckets(folder) == variants[last]
    waited = [v for v, (_, err) in outs.items() if "is locked by pid" in err]
    assert len(waited) == 1, {v: err[-2000:] for v, (_, err) in outs.items()}
    other = "B" if waited[0] == "A" else "A"
    assert f"pid {procs[other].pid} " in outs[waited[0]][1] and "(compile, since" in outs[waited[0]][1]
    model = NeuronLlamaForCausalLM(folder)
    model.load(folder)
    assert list(model.neuron_config.token_generation_buckets) == variants[last]


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from nxdi.effects import folder_lock
    with folder_lock.locked(sys.argv[1], shared=sys.argv[2] == "shared", purpose=sys.argv[3]):
        print("held", flush=True)
        time.sleep(120)
    """
)


def _hold(folder: Path, mode: str, purpose: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder), mode, purpose], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_lock_timeout_zero_fails_at_once_naming_the_holder_and_a_dead_holder_holds_nothing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "compiled"
    model = NeuronLlamaForCausalLM(checkpoint, compile_server.config(checkpoint, "A"))
    model.compile(folder)
    monkeypatch.setenv("NXDI_LOCK_TIMEOUT", "0")
    compiler = _hold(folder, "exclusive", "compile")
    loader = None
    try:
        start = time.monotonic()
        with pytest.raises(FolderLockedError, match=rf"{folder} is locked by pid {compiler.pid} on .*\(compile, since"):
            model.compile(folder)
        with pytest.raises(FolderLockedError, match=r"NXDI_LOCK_TIMEOUT=0.*Fix: wait for that process"):
            NeuronLlamaForCausalLM(folder).load(folder)
        assert time.monotonic() - start < 10
        # SIGKILL: the kernel drops its lock. Its record stays in the lock file, but names nobody.
        compiler.send_signal(signal.SIGKILL)
        compiler.wait(timeout=30)
        loader = _hold(folder, "shared", "load")
        with pytest.raises(FolderLockedError) as info:
            model.compile(folder)
        message = str(info.value)
        assert f"pid {loader.pid} " in message and "(load, since" in message
        assert f"pid {compiler.pid} " not in message
        NeuronLlamaForCausalLM(folder).load(folder)  # loads share the folder
    finally:
        for proc in (compiler, loader):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)
    model.compile(folder)  # nobody holds it now
    assert staging.recover(folder) is False

"""The neuron backend up to its last step, with a stand-in Neuron toolchain on XLA:CPU.

The stand-in `neuronx-cc` records how it was called and "compiles" a module into a NEFF that is its
input behind a marker; the stand-in torch-neuronx registers no device, so the programs run on
XLA:CPU. That checks everything but the Neuron compiler and device (tests/hardware has those):

- compile() lowers every program as the xla backend does and hands neuronx-cc exactly the module
  saved in the folder (`--framework XLA`, the compiler arguments after it), and saves its NEFF;
- load() then generates the CPU engine's tokens, at tp 1 and at tp 2 (SPMD over two devices);
- a compiler failure names the program and quotes the compiler.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.effects.backends.neuron import NeuronCompileError
from tests.support.engine_fixtures import PROMPTS, nxdi_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MARKER = b"STANDIN-NEFF\n"

COMPILER = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("STANDIN_FAIL"):
    print("ERROR: unsupported operator in the module", file=sys.stderr)
    sys.exit(70)
module, neff = args[3], args[args.index("--output") + 1]
with open(neff, "wb") as out:
    out.write({MARKER!r} + open(module, "rb").read())
"""


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in toolchain on PATH and sys.path (for this process and the rank processes);
    returns the compiler's log."""
    root = tmp_path / "toolchain"
    for package in ("torch_neuronx", "neuronxcc"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text('__version__ = "0.0+standin"\n')
    (root / "bin").mkdir()
    compiler = root / "bin" / "neuronx-cc"
    compiler.write_text(COMPILER)
    compiler.chmod(0o755)
    log = tmp_path / "neuronx-cc.log"
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.syspath_prepend(str(root))
    for package in ("torch_neuronx", "neuronxcc"):
        monkeypatch.delitem(sys.modules, package, raising=False)
    return log


@pytest.fixture
def neuron_model(backend_model: Callable[..., Any]) -> Callable[..., Any]:
    """`neuron_model(variant, **neuron_config)`: compiled for neuron, loaded, closed after the test."""
    return functools.partial(backend_model, "neuron")


def test_neuronx_cc_gets_the_saved_module_and_the_programs_give_the_cpu_engine_tokens(
    standin: Path,
    neuron_model: Callable[..., Any],
    loaded_model: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nxdi.shell.application import NeuronApplicationBase

    # a model class's compiler arguments (the documented override)
    monkeypatch.setattr(NeuronApplicationBase, "get_compiler_args", lambda self: "--target=trn2 --auto-cast=none")
    model = neuron_model("qwen3", batch_size=4)
    assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(loaded_model("qwen3", batch_size=4), PROMPTS))

    calls = [json.loads(line) for line in standin.read_text().splitlines()]
    programs = sorted(tmp_path.rglob("*.neuron"))
    assert len(calls) == len(programs) == 2  # one context-encoding and one token-generation program
    for call in calls:
        assert call[:3] == ["compile", "--framework", "XLA"] and call[3].endswith("module.hlo.pb")
        assert call[-2:] == ["--target=trn2", "--auto-cast=none"]
    for path in programs:
        with zipfile.ZipFile(path) as z:
            assert z.read("model.neff") == MARKER + z.read("module.hlo.pb"), path.name


def test_tensor_parallel_programs_run_spmd_through_the_neuron_backend(
    standin: Path,
    neuron_model: Callable[..., Any],
    loaded_model: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")  # the rank process's "NeuronCores"
    model = neuron_model("llama", tp_degree=2, batch_size=4, sequence_parallel_enabled=True)
    assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(loaded_model("llama", batch_size=4), PROMPTS))


def test_a_compiler_failure_names_the_program_and_quotes_the_compiler(
    standin: Path, neuron_model: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_FAIL", "1")
    with pytest.raises(NeuronCompileError, match=r"(?s)context_encoding.*exit 70.*unsupported operator"):
        neuron_model("llama")

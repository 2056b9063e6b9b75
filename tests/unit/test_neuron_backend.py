"""The Neuron backend without torch-neuronx: a clear, actionable error, and nothing imported eagerly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nxdi.effects.backends import neuron
from tests.support import cpu_programs as cp


@pytest.fixture
def no_neuron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import torch_neuronx` / `import neuronxcc` fail, whatever is installed."""
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    monkeypatch.setitem(sys.modules, "neuronxcc", None)


@pytest.mark.usefixtures("no_neuron")
def test_every_entry_point_says_how_to_install(tmp_path: Path) -> None:
    backend = neuron.NeuronBackend()
    calls = [
        backend.version,
        lambda: backend.compile(cp.step, cp.SIGNATURE, cp.example(1), name="p"),
        lambda: backend.load(tmp_path / "p.pt", cp.SIGNATURE, name="p"),
    ]
    for call in calls:
        with pytest.raises(neuron.NeuronUnavailableError, match=r"pip install 'nxdi\[neuron\]'") as info:
            call()
        assert "torch-neuronx and neuronx-cc" in str(info.value)
        assert isinstance(info.value, ImportError)


def test_importing_the_backend_imports_no_neuron_package() -> None:
    code = "import sys, nxdi.effects.backends.neuron; print('torch_neuronx' in sys.modules, 'neuronxcc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]

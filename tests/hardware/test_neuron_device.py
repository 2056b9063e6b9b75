"""Neuron device: the Neuron stack imports, exposes its XLA device, and computes what the CPU computes;
the neuron backend's NEFFs (the HLO the XLA tier verifies) generate the CPU engine's tokens.

Needs a Neuron instance (trn1/trn2/inf2) with the `neuron` extra installed; skipped elsewhere.
"""

from __future__ import annotations

import glob
import importlib.util
from typing import Any

import pytest
import torch

HAS_TORCH_NEURONX = importlib.util.find_spec("torch_neuronx") is not None
HAS_NEURON_DEVICE = bool(glob.glob("/dev/neuron[0-9]*"))

pytestmark = [
    pytest.mark.neuron,
    pytest.mark.skipif(not HAS_TORCH_NEURONX, reason="torch-neuronx is not installed (pip install '.[neuron]')"),
    pytest.mark.skipif(not HAS_NEURON_DEVICE, reason="no Neuron device (/dev/neuron*) on this machine"),
]


def _xla_device() -> torch.device:
    import torch_neuronx  # noqa: F401  (registers the Neuron PJRT plugin with torch-xla)
    import torch_xla
    import torch_xla.core.xla_model as xm

    # torch_xla.device() is the current spelling; releases before it only have xm.xla_device().
    device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
    return device if isinstance(device, torch.device) else torch.device(device)


def test_neuron_backend_reports_an_xla_device() -> None:
    assert _xla_device().type == "xla"


def test_a_matmul_on_the_device_matches_the_cpu() -> None:
    device = _xla_device()
    a = torch.arange(64, dtype=torch.float32).reshape(8, 8) / 64
    b = torch.linspace(-1, 1, 64, dtype=torch.float32).reshape(8, 8)
    got = (a.to(device) @ b.to(device)).cpu()
    # Neuron matmuls may run fp32 through bf16 by default (auto-cast); the tolerance covers that.
    torch.testing.assert_close(got, a @ b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tp", [1, 2])
def test_hlo_to_neff_gives_the_cpu_engine_tokens(
    tp: int,
    tiny_checkpoint: Any,
    loaded_model: Any,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compile() hands neuronx-cc the HLO the XLA tier verifies; load() runs the NEFF's module on
    NeuronCores (tp 2: SPMD over two cores). fp32 without auto-cast, so greedy tokens must agree."""
    from nxdi.shell.application import NeuronApplicationBase
    from tests.support.engine_fixtures import PROMPTS, load_model, nxdi_generate

    monkeypatch.setattr(NeuronApplicationBase, "get_compiler_args", lambda self: "--auto-cast=none")
    model = load_model(
        tiny_checkpoint("llama"), "llama", workdir=tmp_path, backend="neuron", tp_degree=tp, batch_size=4
    )
    try:
        assert torch.equal(nxdi_generate(model, PROMPTS), nxdi_generate(loaded_model("llama", batch_size=4), PROMPTS))
    finally:
        model.close()

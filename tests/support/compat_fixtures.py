"""The optional `nxdi-compat` distribution (`compat/`), importable for one test without installing it.

`compat_package` puts `compat/` first on `sys.path`, so `neuronx_distributed_inference.*` (and
`transformers_neuronx.*`) resolve to this checkout's copy, and afterwards removes the path and every
module of those packages it imported (the next test starts from a clean slate, and nothing leaks into other tests).
Registered for every test directory by `tests/conftest.py`; each use checks, before it starts, that
no module of them is left over from an earlier test.

`CLIENT_IMPORTS` lists what vLLM's Neuron plugin imports from NxDI (its model loader and model
runner, `vllm_neuron/worker/neuronx_distributed_model_{loader,runner}.py`, and its tests), plus the
older in-tree vLLM Neuron loader's `LoraCheckpoint`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

COMPAT_ROOT = Path(__file__).resolve().parents[2] / "compat"
PACKAGE = "neuronx_distributed_inference"
TNX_PACKAGE = "transformers_neuronx"
"""transformers-neuronx's module paths, which the same distribution provides (`nxdi.shell.tnx`)."""

CLIENT_IMPORTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        f"{PACKAGE}.models.config",
        ("ChunkedPrefillConfig", "FusedSpecNeuronConfig", "NeuronConfig", "OnDeviceSamplingConfig"),
    ),
    (f"{PACKAGE}.modules.lora_serving", ("LoraServingConfig", "LoraCheckpoint")),
    (f"{PACKAGE}.utils.constants", ("MODEL_TYPES",)),
    (f"{PACKAGE}.utils.hf_adapter", ("load_pretrained_config",)),
    (f"{PACKAGE}.modules.generation.sampling", ("prepare_sampling_params",)),
    (f"{PACKAGE}.modules.padding", ("pad_tensor",)),
)
"""(module, names) a serving client imports; `import PACKAGE` alone is its installed-check."""


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in (PACKAGE, TNX_PACKAGE))


@pytest.fixture
def compat_package() -> Iterator[Path]:
    """`compat/` on sys.path for the test (its path is the fixture's value); cleaned up afterwards."""
    leftover = sorted(name for name in sys.modules if _ours(name))
    assert not leftover, f"{leftover[0]} already imported from {sys.modules[leftover[0]]!r}: cannot test compat/"
    sys.path.insert(0, str(COMPAT_ROOT))
    try:
        yield COMPAT_ROOT
    finally:
        sys.path.remove(str(COMPAT_ROOT))
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]

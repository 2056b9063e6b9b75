"""The XLA tier: nxdi's programs lowered to HLO by torch-xla and run on XLA:CPU (`make test-xla`).

It runs in its own environment (.venv-xla: torch 2.9 with torch-xla 2.9), never in the main one,
and fails at collection, saying so, where torch-xla is missing: it is never skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nxdi.effects.backends import xla as xla_backend

try:
    xla_backend._xla()
except xla_backend.XlaUnavailableError as e:
    raise pytest.UsageError(f"tests/xla is the XLA tier: run it with `make test-xla`. {e}") from e

from tests.support.engine_fixtures import hf_greedy, load_model, loaded_model, one_torch_thread  # noqa: F401


@pytest.fixture
def backend_model(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`backend_model(backend, variant, **neuron_config)`: compiled for `backend` into tmp_path and
    loaded; private to the test (tensor-parallel ones hold a rank process) and closed after it."""
    made: list[Any] = []

    def make(backend: str, variant: str, **kwargs: Any) -> Any:
        model = load_model(tiny_checkpoint(variant), variant, workdir=tmp_path, backend=backend, **kwargs)
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()

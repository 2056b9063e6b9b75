"""The XLA tier: nxdi's programs lowered to HLO by torch-xla and run on XLA:CPU (`make test-xla`).

It runs in its own environment (.venv-xla: torch 2.9 with torch-xla 2.9), never in the main one,
and fails at collection, saying so, where torch-xla is missing: it is never skipped.
"""

from __future__ import annotations

import pytest

from nxdi.effects.backends import xla as xla_backend

try:
    xla_backend._xla()
except xla_backend.XlaUnavailableError as e:
    raise pytest.UsageError(f"tests/xla is the XLA tier: run it with `make test-xla`. {e}") from e

from tests.support.engine_fixtures import hf_greedy, loaded_model, one_torch_thread  # noqa: F401

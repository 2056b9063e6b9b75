"""End-to-end engine fixtures (`loaded_model`, `hf_greedy`); see tests/e2e/engine_fixtures.py."""

from tests.e2e.engine_fixtures import hf_greedy, loaded_model, one_torch_thread  # noqa: F401

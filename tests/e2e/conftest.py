"""End-to-end engine fixtures (`loaded_model`, `hf_greedy`); see tests/support/engine_fixtures.py."""

from tests.support.engine_fixtures import hf_greedy, loaded_model, one_torch_thread, tp_model  # noqa: F401

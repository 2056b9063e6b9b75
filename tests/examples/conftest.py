"""The examples tier: the documentation's code examples run as written (`make test-examples`).

The transformers-neuronx guide's examples build models at the tensor-parallel degrees they name
(tp_degree=8: eight rank processes on this machine), which makes them the slowest tests there are;
they run in a tier of their own, which `.ci/run` runs after the main suite.
"""

from tests.support.engine_fixtures import one_torch_thread  # noqa: F401

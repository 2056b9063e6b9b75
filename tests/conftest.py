"""Shared test configuration: hypothesis profiles and session fixtures.

Profiles (select with the environment variable HYPOTHESIS_PROFILE; default `dev`):
- `dev`: few examples, for quick local runs.
- `ci`: more examples, no per-example deadline (CI machines are shared and timings are noisy).

Tensor-program property tests set `deadline=None` themselves, whatever the profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Fixture modules shared by every test directory.
pytest_plugins = [
    "tests.support.checkpoint_fixtures",  # session-scoped tiny Hugging Face checkpoints: tiny_model, tiny_checkpoint
    "tests.support.compat_fixtures",  # compat_package: compat/ (neuronx_distributed_inference.*) on sys.path for a test
]

settings.register_profile("dev", max_examples=25, deadline=1000)
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=(HealthCheck.too_slow,),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The persistent compile cache is on by default (in the user's cache folder). The suite turns it
# off, rank and CLI processes included, so each test compiles what it tests and nothing is left in
# the home folder; the cache's own tests point it at a temporary folder.
os.environ["NXDI_COMPILE_CACHE"] = "off"

# `make test` runs the suite in two pytest-xdist workers (one per core of the 2-core CI machine).
# Each then computes on one torch thread: two workers of two OpenMP threads each on two cores spin
# against each other (the accuracy fixture's training took 347 s that way, 57 s alone).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

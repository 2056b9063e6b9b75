"""Waiting for the processes a multi-process test starts (nodes, ranks): all of them, or none."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest


def outputs_of(procs: Sequence[subprocess.Popen[str]], *, timeout: float, what: str) -> list[str]:
    """Each process's output (stdout, stderr merged into it) once all have exited with status 0.

    Fails the test, with everything they printed, when they do not all finish within `timeout`
    seconds (every one is killed first, so none outlives the test) or when one exits non-zero.
    """
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        pytest.fail(f"{what} did not finish within {timeout} s:\n{outputs}")
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return outputs

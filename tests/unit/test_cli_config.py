"""`nxdi config` and `nxdi demo` through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nxdi.shell.cli import main


def test_config_prints_resolved_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--tp-degree", "4", "--enable-bucketing", "--seq-len", "256"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["neuron_config"]["tp_degree"] == 4 and data["neuron_config"]["max_context_length"] == 256
    assert len(data["graph_key"]) == 64


def test_config_lists_every_problem_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--max-context-length", "512", "--cp-degree", "3"]) == 2
    err = capsys.readouterr().err
    assert "max_context_length=512" in err and "cp_degree=3" in err


def test_misspelled_flag_is_rejected() -> None:
    with pytest.raises(SystemExit):
        main(["config", "--tp-degre", "4"])


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nxdi.shell.cli", "demo", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "round trip identical: True" in done.stdout
    assert (tmp_path / "compiled" / "neuron_config.json").is_file()

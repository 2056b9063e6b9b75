"""`nxdi bench generate --speculation draft` end to end at the toy pair's size: the report's
fields, nxdi's speculative tokens equal to its greedy ones, and the flags it refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nxdi.shell.cli import bench_speculation
from nxdi.shell.cli.main import main

SIDES = ("nxdi_greedy", "nxdi_speculation", "transformers_assisted", "transformers_greedy")


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before  # the bench restores the caller's setting


def _argv(*extra: str) -> list[str]:
    argv = ["bench", "generate", "--speculation", "draft", "--shape", "toy", "--threads", "1", "--repeat", "1"]
    return [*argv, "--prompt-len", "6", "--new-tokens", "20", "--speculation-length", "4", "--json", *extra]


def _doc(capsys: pytest.CaptureFixture[str]) -> Any:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])  # progress lines come first


def test_the_report_has_every_side_and_speculation_matches_greedy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv("--batch-size", "1", "2")) == 0
    doc = _doc(capsys)
    assert (doc["method"], doc["speculation_length"], doc["dtype"]) == ("draft", 4, "float32")
    assert doc["pair"]["target_parameters"] > 3 * doc["pair"]["draft_parameters"]
    one, two = doc["results"]
    assert set(one["sides"]) == set(SIDES) and set(two["sides"]) == set(SIDES) - {"transformers_assisted"}
    assert "transformers_assisted" in two["not_measured"]
    for r in (one, two):
        assert r["tokens_match_nxdi_greedy"]["nxdi_speculation"] is True
        for name, s in r["sides"].items():
            assert s["tpot_ms"] > 0 and s["e2e_s"] > 0, name
        assert r["sides"]["nxdi_greedy"]["acceptance"] is None
        assert r["sides"]["nxdi_greedy"]["tokens_per_target_step"] == 1.0
        spec = r["sides"]["nxdi_speculation"]
        assert 0.5 < spec["acceptance"] <= 1 and spec["tokens_per_target_step"] > 2
        assert r["speedup"]["speculation_vs_nxdi_greedy"] > 0
        compiled = r["compiled"]
        assert compiled["target (speculation)"]["programs"] == compiled["target"]["programs"]  # 1 + 1 vs 1 + 1
    assert 0.5 < one["sides"]["transformers_assisted"]["acceptance"] <= 1
    assert one["speedup"]["speculation_vs_transformers_assisted"] > 0
    text = bench_speculation.render(doc)
    assert "(b) nxdi speculation" in text and "(c) transformers assisted" in text and "speed-up" in text


def test_other_methods_and_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--speculation", "medusa"])  # not a choice yet
    assert "invalid choice: 'medusa'" in capsys.readouterr().err
    assert main(["bench", "generate", "--speculation", "draft", "--model-path", "x", "--shape", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--model-path" in err and "--shape tiny" in err and "Traceback" not in err

"""`nxdi bench generate --speculation METHOD` end to end at the toy pair's size, for every method
(draft, fused, medusa, eagle): the report's fields, nxdi's speculative tokens equal to its greedy
ones, the counts behind acceptance and tokens per step, the reason transformers' side is not
measured, and the flags it refuses."""

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


def _argv(*extra: str, method: str = "draft", k: bool = True) -> list[str]:
    argv = ["bench", "generate", "--speculation", method, "--shape", "toy", "--threads", "1", "--repeat", "1"]
    argv += ["--prompt-len", "6", "--new-tokens", "20", *(["--speculation-length", "4"] if k else [])]
    return [*argv, "--json", *extra]


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


def _spec_side(doc: Any, batch: int) -> tuple[Any, Any]:
    """The one result's nxdi speculation side, after the checks every method shares: (b)'s tokens
    equal (a)'s, acceptance in (0, 1], more than one token per target step, timings present."""
    (r,) = doc["results"]
    assert r["batch_size"] == batch and r["tokens_match_nxdi_greedy"]["nxdi_speculation"] is True
    spec = r["sides"]["nxdi_speculation"]
    assert 0 < spec["acceptance"] <= 1 and spec["accepted"] <= spec["proposed"], spec
    assert spec["tokens_per_target_step"] > 1.5 and spec["tpot_ms"] > 0 and spec["e2e_s"] > 0
    assert r["speedup"]["speculation_vs_nxdi_greedy"] > 0
    return r, spec


def test_fused_speculation_reports_the_fused_loops_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """`fused` at batch 1: the same pair fused into the target, next to transformers' assisted
    generation; k-1 proposals per fused step (20 new tokens = the prefill's + the steps')."""
    assert main(_argv("--batch-size", "1", method="fused")) == 0
    doc = _doc(capsys)
    assert (doc["method"], doc["speculation_length"], doc["pair"]["draft"]) == ("fused", 4, "draft")
    r, spec = _spec_side(doc, 1)
    assert set(r["sides"]) == set(SIDES) and "not_measured" not in r
    steps = round(20 / spec["tokens_per_target_step"]) - 1  # fused steps after the context call
    assert spec["proposed"] == 3 * steps and spec["acceptance"] > 0.5
    assert r["speedup"]["speculation_vs_transformers_assisted"] > 0
    assert list(r["compiled"]) == ["target", "target + draft (fused)"]
    assert "(b) nxdi speculation (fused, k=4)" in bench_speculation.render(doc)


@pytest.mark.parametrize(
    ("method", "draft", "why"),
    [
        ("medusa", "Medusa heads", "transformers has no Medusa decoding"),
        ("eagle", "EAGLE draft", "transformers has no EAGLE decoding"),
        ("eagle-tree", "EAGLE draft", "transformers has no EAGLE decoding"),
    ],
)
def test_medusa_and_eagle_are_measured_without_a_transformers_side(
    method: str, draft: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`medusa` and `eagle` at batch 2: heads / a draft trained on the target in the run, tokens
    equal nxdi greedy, and transformers' side reported as not measured, with the reason."""
    tree = method in ("medusa", "eagle-tree")
    assert main(_argv("--batch-size", "2", method=method, k=not tree)) == 0
    doc = _doc(capsys)
    p = doc["pair"]
    assert (doc["method"], p["draft"]) == (method, draft) and p["draft_train_s"] > 0 and p["draft_parameters"] > 0
    assert doc["speculation_length"] == (None if tree else 4)
    r, spec = _spec_side(doc, 2)
    assert set(r["sides"]) == set(SIDES) - {"transformers_assisted"}
    assert why in r["not_measured"]["transformers_assisted"]
    if method == "medusa":
        assert spec["proposed"] % 4 == 0 and spec["tokens_per_target_step"] > 2.5  # 4-deep tree, trained heads
    if method == "eagle-tree":
        assert spec["proposed"] % 4 == 0 and 0 < spec["acceptance"] <= 1  # EAGLE_TREE is 4 deep
        assert "(eagle-tree, 9 nodes)" in r["labels"]["nxdi_speculation"]
    text = bench_speculation.render(doc)
    assert f"(c) transformers_assisted: not measured ({why}" in text and f"(b) nxdi speculation ({method}" in text


def test_other_methods_and_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--speculation", "lookahead"])  # not a method
    assert "invalid choice: 'lookahead'" in capsys.readouterr().err
    assert main(["bench", "generate", "--speculation", "draft", "--model-path", "x", "--shape", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--model-path" in err and "--shape tiny" in err and "Traceback" not in err
    assert main(["bench", "generate", "--speculation", "medusa", "--speculation-length", "4"]) == 2
    err = capsys.readouterr().err
    assert "--speculation-length 4: not used by medusa" in err and "Traceback" not in err

"""`nxdi bench roofline` end to end on a tiny checkpoint: the report's fields, and its weight bytes
against the checkpoint's own tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nxdi.shell.cli import bench_roofline
from nxdi.shell.cli.main import main


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nxdi.testing import checkpoints

    path, _ = checkpoints.build_checkpoint(tmp_path_factory.mktemp("m"), "llama", checkpoints.SaveFormat.SAFETENSORS)
    return path


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before  # the bench restores the caller's setting


def _argv(model: Path, work: Path, *extra: str) -> list[str]:
    argv = ["bench", "roofline", "--model-path", str(model), "--dtype", "float32", "--threads", "1"]
    argv += ["--prompt-len", "8", "--new-tokens", "5", "--repeat", "1", "--bandwidth-mib", "8"]
    return [*argv, "--work-dir", str(work), "--json", *extra]


def _doc(capsys: pytest.CaptureFixture[str]) -> Any:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])  # progress lines come first


def test_roofline_reports_both_sides_against_the_checkpoint_bytes(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_llama, tmp_path, "--paired-steps", "6")) == 0
    doc = _doc(capsys)
    (r,) = doc["results"]
    tensors = load_file(tiny_llama / "model.safetensors")
    expected = sum(4 * t.numel() for name, t in tensors.items() if "embed_tokens" not in name)  # float32
    assert r["step_bytes"]["weight_bytes"] == expected
    assert r["context"] == 8 + 5 // 2 and r["roofline"]["ms_per_step"] > 0
    for side in ("nxdi", "transformers"):
        assert r[side]["tpot_ms_p50"] > 0 and r[side]["pct_of_roofline"] > 0
    assert r["ratio_hf_over_nxdi"] > 0
    # nxdi's decode steps interleaved with reads of their bytes: 6 pairs (two prefills, 4 + 2 steps)
    share = r["nxdi"]["paired_pct_of_roofline"]
    assert share["steps"] == 6 and 0 < share["q1"] <= share["median"] <= share["q3"]
    assert "paired_pct_of_roofline" not in r["transformers"]
    assert doc["bandwidth"]["best_gb_s"] >= doc["bandwidth"]["median_gb_s"] > 0
    text = bench_roofline.render(doc)
    assert "bytes per decode step" in text and "% of roofline" in text and "ratio (transformers / nxdi)" in text
    assert "at the moments of a read of its step's bytes (6 pairs)" in text


def test_int8_weights_run_beside_the_unquantized_model_and_transformers(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_llama, tmp_path, "--weights", "int8-per-channel", "--paired-steps", "9")) == 0
    doc = _doc(capsys)
    (r,) = doc["results"]
    paired = r["paired_unquantized_over_nxdi"]  # 9 pairs: three prefills (4, 4 and 1 decode steps after them)
    assert paired["steps"] == 9 and 0 < paired["q1"] <= paired["median"] <= paired["q3"]
    assert r["nxdi"]["paired_pct_of_roofline"]["steps"] == r["nxdi_unquantized"]["paired_pct_of_roofline"]["steps"] == 9
    assert main(_argv(tiny_llama, tmp_path, "--skip-hf")) == 0
    (float_r,) = _doc(capsys)["results"]
    assert "transformers" not in float_r and "nxdi_unquantized" not in float_r
    assert r["step_bytes"]["weight_bytes"] < float_r["step_bytes"]["weight_bytes"]
    assert r["float_roofline"]["ms_per_step"] > r["roofline"]["ms_per_step"]  # same bandwidth, more bytes
    assert "not_measured" not in doc
    # Each side against the roofline of the weights it reads; the ratios from the same run.
    for side, roof in (
        ("nxdi", r["roofline"]),
        ("nxdi_unquantized", r["float_roofline"]),
        ("transformers", r["float_roofline"]),
    ):
        m = r[side]
        assert m["pct_of_roofline"] == pytest.approx(100 * roof["ms_per_step"] / m["tpot_ms_p50"])
    tpot = {side: r[side]["tpot_ms_p50"] for side in ("nxdi", "nxdi_unquantized", "transformers")}
    assert r["ratio_unquantized_over_nxdi"] == pytest.approx(tpot["nxdi_unquantized"] / tpot["nxdi"])
    assert r["ratio_hf_over_nxdi"] == pytest.approx(tpot["transformers"] / tpot["nxdi"])
    text = bench_roofline.render(doc)
    assert "ratio (nxdi float32 weights / nxdi int8-per-channel)" in text and "roofline of float32 weights" in text
    assert "the same, decode steps interleaved (9 pairs): median" in text


def test_modules_kept_in_float_are_kept_in_the_model_and_the_roofline(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_llama, tmp_path, "--weights", "int8-per-channel", "--skip-hf", "--paired-steps", "0")) == 0
    (every,) = _doc(capsys)["results"]
    argv = _argv(
        tiny_llama, tmp_path, "--weights", "int8-per-channel", "--skip-hf", "--modules-to-not-convert", "lm_head"
    )
    assert main(argv) == 0
    doc = _doc(capsys)
    (kept,) = doc["results"]
    lm_head = load_file(tiny_llama / "model.safetensors")["lm_head.weight"]
    rows, values = lm_head.shape[0], lm_head.numel()
    assert kept["step_bytes"]["weight_bytes"] == every["step_bytes"]["weight_bytes"] - (values + 4 * rows) + 4 * values
    assert doc["modules_to_not_convert"] == ["lm_head"] and "float32 for norms, lm_head" in bench_roofline.render(doc)
    # the model read what was counted: its quantized checkpoint keeps lm_head in float32, the default's does not
    saved = {p.name: torch.load(p, weights_only=True) for p in tmp_path.glob("quantized-*.pt")}
    assert sorted(saved) == [
        f"quantized-{tiny_llama.name}-float32-int8-per-channel-keep-lm_head.pt",
        f"quantized-{tiny_llama.name}-float32-int8-per-channel-keep-none.pt",
    ]
    keep, default = (saved[name] for name in sorted(saved))
    assert keep["lm_head.weight"].dtype == torch.float32 and "lm_head.scale" not in keep
    assert default["lm_head.weight"].dtype == torch.int8 and "lm_head.scale" in default


def test_bad_flags_are_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "roofline", "--new-tokens", "1", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "--new-tokens must be >= 2" in err and "--batch-size must be >= 1" in err and "Traceback" not in err
    assert main(["bench", "roofline", "--modules-to-not-convert", "lm_head"]) == 2
    assert "--modules-to-not-convert needs quantized --weights" in capsys.readouterr().err
    assert main(["bench", "roofline", "--weights", "int8-per-channel", "--paired-steps", "-1"]) == 2
    assert "--paired-steps must be >= 0, got -1" in capsys.readouterr().err

"""`nxdi bench generate --lora N ...` end to end at the toy shape: the report's fields, the base-slot
rows' tokens equal to the base model's (and an adapter's not), and the flags it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxdi.shell.cli import bench_lora
from nxdi.shell.cli.main import main


def _argv(work: Path, *extra: str) -> list[str]:
    argv = ["bench", "generate", "--shape", "toy", "--threads", "1", "--repeat", "1", "--prompt-len", "6"]
    return [*argv, "--new-tokens", "6", "--work-dir", str(work), *extra]


def test_the_report_has_every_side_and_the_base_slot_matches_the_base_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threads = torch.get_num_threads()
    assert main(_argv(tmp_path, "--lora", "0", "1", "4", "--batch-size", "4", "--lora-rank", "8", "--json")) == 0
    assert torch.get_num_threads() == threads  # the bench restores the caller's setting
    out = capsys.readouterr().out
    (r,) = json.loads(out[out.index("[\n") :])  # progress lines come first
    assert (r["batch_size"], r["lora_rank"], r["max_loras"]) == (4, 8, 4)
    assert r["target_modules"] == list(bench_lora.DENSE_TARGETS)
    assert r["base"]["ttft_ms"] > 0 and r["base"]["tpot_ms"]["p50"] > 0
    zero, _, four = r["lora"]
    assert [s["adapter_ids"] for s in r["lora"]] == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 2, 3, 4]]
    for s in r["lora"]:
        assert s["ttft_ms"] > 0 and s["tpot_ms"]["p99"] >= s["tpot_ms"]["p50"] > 0
        assert s["overhead_tpot_p50"] > 0 and s["overhead_ttft"] > 0
    assert zero["tokens_equal_base"] is True
    assert four["tokens_equal_base"] is False  # the comparison can fail: the adapters change the tokens
    adapters = sorted(p.name for p in next(tmp_path.glob("lora-*-r8")).iterdir())
    assert adapters == [f"adapter-{i:03d}" for i in range(1, 5)]  # distinct, written once for the max N
    text = bench_lora.render([r])
    assert "base model" in text and "lora, 4 adapters" in text and "overhead TPOT" in text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--lora", "0", "9"], "--lora 9: more distinct adapters than rows in a batch of 8"),
        (["--lora", "-1", "--batch-size", "2"], "adapter counts must be >= 0"),
        (["--lora", "1", "--tp-degree", "2"], "--tp-degree 2: multi-LoRA serving runs at tp 1 only"),
        (["--lora", "1", "--compare-hf"], "--async and --compare-hf: not measured with --lora"),
        (["--lora", "1", "--speculation", "draft"], "--speculation: measured on its own"),
        (["--lora", "1", "--lora-rank", "0"], "--lora-rank 0: must be >= 1"),
        (["--lora-rank", "8"], "--lora-rank 8: only used with --lora"),
    ],
)
def test_flags_it_cannot_honour_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    assert main(_argv(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before anything is built


def test_rows_spread_over_n_adapters() -> None:
    assert bench_lora.row_adapters(0, 3) == [0, 0, 0]
    assert bench_lora.row_adapters(2, 5) == [1, 2, 1, 2, 1]

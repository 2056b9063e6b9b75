"""`nxdi bench serve`: the report's fields, and the nxdi server's tokens against transformers' greedy generate."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell.cli import bench_serve
from nxdi.shell.cli.main import main


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # The shared 2-core machine makes two OpenMP threads crawl whenever another process is busy.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bench_serve_reports_every_server(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--model-path", str(tiny_checkpoint("llama")), "--dtype", "float32", "--threads", "1"]
    argv += ["--num-requests", "5", "--rate", "100", "--prompt-len", "2", "10", "--output-len", "1", "6"]
    argv += ["--batch-size", "2", "--work-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{\n") :])  # progress lines come first
    assert doc["workload"] == {
        "requests": 5,
        "rate": 100.0,
        "prompt_len": [2, 10],
        "output_len": [1, 6],
        "batch_size": 2,
        "seed": 0,
    }
    expected = bench_serve.make_requests(n=5, rate=100, prompt_len=(2, 10), output_len=(1, 6), vocab=160, seed=0)
    tokens = sum(r.output_len for r in expected)
    for side in bench_serve.SIDES:
        s = doc[side]
        assert s["requests"] == 5 and s["generated_tokens"] == tokens
        assert s["throughput_tok_s"] > 0 and s["duration_s"] > 0
        assert set(s["ttft_ms"]) == set(s["tpot_ms"]) == {"p50", "p99"}
    for side in ("hf_sequential", "hf_static"):
        assert set(doc["ratios_nxdi_advantage"][side]) == {"throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"}
    assert doc["tokens_equal_to_hf_sequential"] == {"requests": 5, "of": 5}
    assert "virtual" in doc["clock"]


def test_bench_serve_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--output-len", "5", "2", "--skip-hf"]) == 2
    assert "1 <= lo <= hi" in capsys.readouterr().err


def test_continuous_batching_serves_every_request_its_greedy_tokens(
    tiny_checkpoint: Callable[..., Path], hf_greedy: Callable[..., torch.Tensor], tmp_path: Path
) -> None:
    """More requests than slots, all arriving at once: slots are freed and reused mid-stream, each
    decode step mixes requests at different positions, and each request must still get exactly
    transformers' greedy tokens for its prompt alone."""
    args = argparse.Namespace(prompt_len=[1, 14], output_len=[1, 12], batch_size=3, dtype="float32", work_dir=tmp_path)
    model = bench_serve.serving_model(tiny_checkpoint("llama"), args)
    requests = bench_serve.make_requests(
        n=8, rate=float("inf"), prompt_len=args.prompt_len, output_len=args.output_len, vocab=160, seed=3
    )
    with model, torch.inference_mode():
        served = bench_serve.serve_nxdi(model, requests, bench_serve.VirtualClock())
    assert [s.request for s in served] == requests
    for s in served:
        r = s.request
        assert len(s.tokens) == len(s.times) == r.output_len
        assert s.tokens == hf_greedy("llama", [r.prompt], r.output_len)[0].tolist(), r


def test_poisson_arrivals_are_seeded_and_in_range() -> None:
    make: Any = bench_serve.make_requests
    a = make(n=200, rate=4.0, prompt_len=(3, 9), output_len=(1, 5), vocab=50, seed=7)
    assert a == make(n=200, rate=4.0, prompt_len=(3, 9), output_len=(1, 5), vocab=50, seed=7)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and 30 < arrivals[-1] < 70  # about n / rate = 50 s
    assert all(3 <= len(r.prompt) <= 9 and 1 <= r.output_len <= 5 for r in a)
    assert all(3 <= t < 50 for r in a for t in r.prompt)

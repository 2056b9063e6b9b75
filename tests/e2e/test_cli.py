"""`nxdi config` and `nxdi demo` through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nxdi.shell.cli.main import main


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
        [sys.executable, "-m", "nxdi.shell.cli.main", "demo", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "tokens equal" in done.stdout and "all steps passed" in done.stdout
    assert (tmp_path / "compiled" / "manifest.json").is_file()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nxdi.testing import checkpoints

    path, _ = checkpoints.build_checkpoint(tmp_path_factory.mktemp("m"), "llama", checkpoints.SaveFormat.SAFETENSORS)
    return path


def test_run_compiles_generates_and_checks_logits(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "run",
        "--model-path",
        str(tiny_llama),
        "--compiled-model-path",
        str(tmp_path / "c"),
        "--input-ids",
        "1 5 7 9",
        "--input-ids",
        "3 4",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--max-context-length",
        "16",
        "--torch-dtype",
        "float32",
        "--on-device-sampling",
        "--output-logits",
        "--max-new-tokens",
        "12",
        "--check-accuracy-mode",
        "logit-matching",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "generated 12 tokens per row" in out and "logit matching against transformers: passed" in out
    assert main([*argv[:-2], "--check-accuracy-mode", "token-matching", "--skip-compile", "--benchmark"]) == 0
    out = capsys.readouterr().out
    assert "compiling" not in out and "token matching against transformers: passed" in out and "TPOT" in out


def test_run_with_tensor_parallel_ranks(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--model-path", str(tiny_llama), "--compiled-model-path", str(tmp_path / "c")]
    argv += ["--input-ids", "1 5 7 9", "--input-ids", "3 4", "--batch-size", "2", "--seq-len", "64"]
    argv += ["--max-context-length", "16", "--torch-dtype", "float32", "--tp-degree", "4", "--flash-decoding-enabled"]
    argv += ["--sequence-parallel-enabled", "--check-accuracy-mode", "token-matching"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "token matching against transformers: passed" in out
    assert sorted(p.name for p in (tmp_path / "c" / "programs").iterdir())  # one set of programs for every rank


def test_run_reports_invalid_configuration(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "run",
        "--model-path",
        str(tiny_llama),
        "--compiled-model-path",
        str(tmp_path),
        "--input-ids",
        "1 2",
        "--seq-len",
        "16",
        "--max-context-length",
        "32",
        "--tp-degree",
        "2",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "max_context_length=32" in err


def test_bench_generate_compares_with_transformers(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "generate",
        "--model-path",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--batch-size",
        "1",
        "2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "6",
        "--repeat",
        "1",
        "--compare-hf",
        "--work-dir",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads(out[out.index("[\n") :])  # progress lines come first
    assert [r["batch_size"] for r in results] == [1, 2]
    for r in results:
        assert (
            r["nxdi"]["tpot_ms"]["p50"] > 0
            and r["transformers"]["ttft_ms"] > 0
            and r["ratio_hf_over_nxdi"]["tpot_p50"] > 0
        )


def test_bench_generate_reports_the_collectives_of_tensor_parallel_ranks(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "generate", "--model-path", str(tiny_llama), "--dtype", "float32", "--tp-degree", "1", "2"]
    argv += ["--prompt-len", "8", "--new-tokens", "5", "--repeat", "1", "--work-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    one, two = json.loads(out[out.index("[\n") :])
    assert (one["tp_degree"], two["tp_degree"]) == (1, 2) and "collectives" not in one["nxdi"]
    # per decode step and rank: 2 layers x (attention + MLP) all-reduces, the embedding and lm_head gathers
    assert two["nxdi"]["collectives"]["calls_per_step"] == {"all_gather": 2, "all_reduce": 4}
    assert two["nxdi"]["collectives"]["total_ms_per_step"] > 0


def test_bench_generate_builds_and_measures_a_random_mixture_of_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "generate", "--model-type", "mixtral", "--shape", "toy", "--dtype", "float32", "--compare-hf"]
    argv += ["--prompt-len", "8", "--new-tokens", "2", "--repeat", "1", "--work-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (result,) = json.loads(out[out.index("[\n") :])
    assert (result["batch_size"], result["tp_degree"], result["backend"]) == (1, 1, "cpu")
    for side in ("nxdi", "transformers"):
        assert result[side]["ttft_ms"] > 0 and result[side]["tpot_ms"]["p50"] > 0
    assert set(result["ratio_hf_over_nxdi"]) == {"tpot_p50", "ttft", "throughput"}
    config = json.loads((tmp_path / "mixtral-toy-float32" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)


def test_bench_generate_refuses_an_unknown_model_type(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "generate", "--model-type", "mixtrall"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--model-type: invalid choice: 'mixtrall'" in err
    assert all(name in err for name in ("llama", "mixtral", "qwen3_moe"))


def test_bench_generate_async_measures_the_overlap_against_synchronous_mode(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "generate", "--model-path", str(tiny_llama), "--dtype", "float32", "--async", "--host-ms", "2"]
    argv += ["--prompt-len", "8", "--new-tokens", "6", "--repeat", "1", "--work-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "async_mode vs synchronous, decode loop with 2 ms of host time per step" in out
    # The loop's 5 decode calls and generate()'s: each first call runs synchronously.
    assert "8/10 steps launched ahead were used" in out
    argv += ["--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    a = json.loads(out[out.index("[\n") :])[0]["async_mode"]
    assert a["sync"]["host_ms"] >= 2 and a["overlap"] is not None
    assert a["async"]["launched"] > a["async"]["used"] > 0


def test_bench_load_measures_every_phase(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "load", "--model-path", str(tiny_llama), "--dtype", "float32", "--work-dir", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tp_degree"] == 2 and result["shard_mib"] > 0
    assert result["bound_mib"] == pytest.approx(result["largest_tensor_mib"] + result["shard_mib"])
    for phase in ("ranks_to_cpu", "ranks_load"):
        assert [r["rank"] for r in result[phase]["ranks"]] == [0, 1]
    assert sorted(p.name for p in (tmp_path / f"sharded-{tiny_llama.name}-tp2" / "weights").iterdir()) == [
        "tp0_sharded_checkpoint.safetensors",
        "tp1_sharded_checkpoint.safetensors",
    ]


def test_kernels_builds_then_reports_what_runs_here(capsys: pytest.CaptureFixture[str]) -> None:
    from nxdi.effects.backends import kernels

    if not kernels.load():
        pytest.skip(f"nxdi's kernels cannot run on this machine: {kernels.why_not()}")
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert (
        f"ready in {kernels.kernel_dir()}: int8 and float8 decode linears, their SwiGLU and dequantize, bf16 RMSNorm (with its residual sum), RoPE and decode attention"
        in out
    )
    if kernels.bf16_max_rows(32) > 4:
        assert "AMX tiles up to 16 rows" in out
    assert main(["kernels", "--check"]) == 0
    assert f"built in {kernels.kernel_dir()}" in capsys.readouterr().out


def test_kernels_on_a_cpu_without_avx512_builds_nothing_and_succeeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from nxdi.effects.backends import kernels

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(kernels, "load", lambda: pytest.fail("nothing may be built without AVX-512"))
    assert main(["kernels"]) == 0
    assert "need AVX-512 and this CPU offers AVX2" in capsys.readouterr().out


def test_kernels_failed_build_exits_1_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import torch

    from nxdi.effects.backends import kernels

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("NXDI_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "load", lambda: False)
    monkeypatch.setattr(kernels, "why_not", lambda: "g++: not found")
    assert main(["kernels", "--check"]) == 1
    assert "not built yet" in capsys.readouterr().out
    assert main(["kernels"]) == 1
    assert "not available: g++: not found" in capsys.readouterr().out

"""`nxdi plan` and `nxdi bench plan` through the real entry point, on published config.json files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.shell.cli import bench_plan, cmd_plan
from nxdi.shell.cli.bench_timing import Timings
from nxdi.shell.cli.main import main
from tests.support.planner_configs import (
    GEMMA_3_1B,
    LLAMA_31_8B,
    LLAMA_31_70B,
    MIXTRAL_8X7B,
    OPT_13B,
    PLAN_JSON_KEYS,
)
from tests.support.planner_configs import spec as spec_of

JSON_KEYS = PLAN_JSON_KEYS
L8_TRN1 = ["--instance", "trn1.32xlarge", "--tp-degree", "32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model folders holding only a config.json: llama-8b, llama-70b, opt-13b, mixtral-8x7b, gemma-3-1b."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    configs = (
        ("llama-8b", LLAMA_31_8B),
        ("llama-70b", LLAMA_31_70B),
        ("opt-13b", OPT_13B),
        ("mixtral", MIXTRAL_8X7B),
        ("gemma-3-1b", GEMMA_3_1B),
    )
    for name, config in configs:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = root / name
    return out


def _plan(capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> tuple[int, str, str]:
    status = main(["plan", "--model-path", str(model), *flags])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _plan_json(capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    status, out, _ = _plan(capsys, model, *flags, "--json")
    return status, json.loads(out)


def test_llama_8b_on_trn1_text(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _plan(
        capsys, models["llama-8b"], *L8_TRN1, "--batch-size", "4", "--seq-len", "2048", "--enable-bucketing"
    )
    assert status == 0 and err == ""
    assert "8.03B parameters" in out and "torch_dtype bfloat16 (from config.json)" in out
    assert "replicate_to_tp_degree over 32 ranks: 32 query heads, 8 KV heads -> 32" in out
    assert "per rank: 1 query head, 1 KV head" in out
    assert "[4, 1, 2048, 128] [B, K, T, D] bfloat16" in out and "128.0 MiB per rank" in out
    assert "Verdict    fits; smallest TP degree that fits on trn1.32xlarge: 2" in out
    assert out.count("128, 256, 512, 1024, 2048") == 2  # context encoding and token generation
    assert "No problems" in out


def test_block_kv_tables_replace_the_plain_ones(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    prefix = ("--seq-len", "2048", "--enable-bucketing", "--is-block-kv-layout", "--is-prefix-caching")
    status, out, _ = _plan(capsys, models["llama-8b"], *L8_TRN1, *prefix, "--pa-block-size", "32")
    assert status == 0 and "prefill 1024: prefix 0, 512, 1024, 2048" in out and "active 1: prefix 256, 512" in out
    chunked = ("--seq-len", "1024", "--batch-size", "2", "--enable-bucketing", "--is-block-kv-layout")
    chunked += ("--enable-chunked-prefill", "--max-num-seqs", "2", "--kernel-kv-tile-size", "512")
    status, doc = _plan_json(capsys, models["llama-8b"], *L8_TRN1, *chunked)
    assert status == 0 and doc["buckets"]["axes"]["context_encoding"] == ["chunk", "tiles"]
    assert doc["buckets"]["context_encoding"] == [[q, t] for q in (128, 512, 1024) for t in (1, 16, 32)]
    assert doc["buckets"]["token_generation"] == [128, 256, 512, 1024]


def test_llama_8b_on_trn1_json(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = _plan_json(
        capsys, models["llama-8b"], *L8_TRN1, "--batch-size", "4", "--seq-len", "2048", "--enable-bucketing"
    )
    assert status == 0
    for section, keys in JSON_KEYS.items():
        assert keys <= set(doc[section]), section
    assert doc["problems"] == [] and isinstance(doc["warnings"], list)
    assert doc["buckets"]["token_generation"] == [128, 256, 512, 1024, 2048]
    assert doc["sharding"]["kv_heads"] == 32 and doc["sharding"]["kv_heads_per_rank"] == 1
    assert doc["kv_cache"] == {**doc["kv_cache"], "shape_per_rank": [4, 1, 2048, 128], "bytes_per_rank": 128 << 20}
    assert doc["memory"]["kv_cache_bytes"] == 32 * (128 << 20) and doc["memory"]["hbm_per_core_bytes"] == 16 << 30
    assert doc["memory"]["fits"] is True and doc["memory"]["min_tp_degree"] == 2
    assert doc["lora"] == {"max_adapters": None}
    assert doc["model"]["num_params"] == 8_030_261_248 and doc["settings"]["torch_dtype_source"] == "config.json"


def test_llama_70b_tp16_fits_and_tp8_does_not(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--instance", "trn1.32xlarge", "--seq-len", "8192", "--enable-bucketing")
    status, doc = _plan_json(capsys, models["llama-70b"], *flags, "--tp-degree", "16")
    assert status == 0 and doc["memory"]["fits"] is True and doc["memory"]["min_tp_degree"] == 16
    assert (doc["sharding"]["q_heads_per_rank"], doc["sharding"]["kv_heads_per_rank"]) == (4, 1)
    assert doc["kv_cache"]["shape_per_rank"] == [1, 1, 8192, 128]
    # tp 8 is planned (exit 1, not 2): the verdict and the fix come with the whole plan.
    status, out, _ = _plan(capsys, models["llama-70b"], *flags, "--tp-degree", "8")
    assert status == 1
    assert "DOES NOT FIT" in out and "Fix: use tp_degree=16" in out and "Sharding" in out
    status, doc = _plan_json(capsys, models["llama-70b"], *flags, "--tp-degree", "8")
    assert status == 1 and doc["memory"]["fits"] is False
    assert [p["field"] for p in doc["problems"]] == ["tp_degree"]


def test_opt_13b_from_its_config_file(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    config = models["opt-13b"] / "config.json"
    status, out, _ = _plan(capsys, config, "--instance", "inf2.48xlarge", "--tp-degree", "8", "--seq-len", "2048")
    assert status == 0
    assert "opt from" in out and "torch_dtype float16 (from config.json)" in out
    assert "per rank: 5 query heads, 5 KV heads" in out and "[1, 5, 2048, 128] [B, K, T, D] float16" in out
    status, doc = _plan_json(capsys, config, "--tp-degree", "8", "--torch-dtype", "float32")
    assert status == 0 and doc["platform"] == "trn1" and doc["kv_cache"]["dtype"] == "float32"
    assert doc["settings"]["torch_dtype_source"] == "--torch-dtype"


def test_gemma_3_1b_counts_its_four_norms_a_layer(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _plan(capsys, models["gemma-3-1b"], "--instance", "trn1.2xlarge", "--tp-degree", "2")
    assert status == 0 and err == ""
    assert "gemma3_text from" in out and "999.89M parameters" in out and "No problems" in out
    assert "per rank: 2 query heads, 1 KV head" in out


@pytest.mark.parametrize(
    ("shard", "expected"), [("--lora-shard-linear-layer", 376), ("--no-lora-shard-linear-layer", 23)]
)
def test_seed_lora_capacity(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str], shard: str, expected: int
) -> None:
    """nxdi-feature-guide.rst: 170 MB Llama-3.1-8B rank-16 adapters in 2 GB per trn1 core at tp 32."""
    lora = ("--lora-adapter-mb", "170", "--lora-memory-gb", "2", shard)
    status, doc = _plan_json(capsys, models["llama-8b"], *L8_TRN1, *lora)
    assert status == 0 and abs(doc["lora"]["max_adapters"] - expected) <= 1
    assert doc["lora"]["reserved_bytes_per_core"] == 2 * 10**9 and doc["lora"]["adapter_bytes"] == 170 * 10**6
    _, out, _ = _plan(capsys, models["llama-8b"], *L8_TRN1, *lora)
    assert (
        f"LoRA       {doc['lora']['max_adapters']} adapters fit: 170.0 MB each" in out
        and "2.00 GB per core reserved" in out
    )


def test_resident_adapters_count_in_memory(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = _plan_json(capsys, models["llama-8b"], *L8_TRN1, "--max-loras", "8", "--lora-rank", "32")
    assert status == 0 and doc["lora"]["requested"] == 8 and doc["lora"]["max_adapters"] > 8
    assert doc["memory"]["lora_bytes_per_core"] == 8 * doc["lora"]["bytes_per_core"] > 0


def test_mixtral_experts_per_rank(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _plan(
        capsys, models["mixtral"], "--tp-degree", "32", "--moe-ep-degree", "8", "--moe-tp-degree", "4"
    )
    assert status == 0 and "46.70B parameters, 8 experts (2 per token: 12.88B active)" in out
    assert "8 per layer in 8 expert groups of 4 ranks: 1 expert per rank, each 3584 of its 14336" in out
    status, doc = _plan_json(capsys, models["mixtral"], "--tp-degree", "32")
    assert status == 0 and (doc["sharding"]["experts_per_rank"], doc["sharding"]["expert_rows_per_rank"]) == (8, 448)
    status, _, err = _plan(capsys, models["mixtral"], "--tp-degree", "32", "--moe-ep-degree", "8")
    assert status == 2 and "moe_tp_degree=1: x moe_ep_degree=8 must equal tp_degree=32" in err
    assert "set moe_tp_degree=4" in err
    status, _, err = _plan(capsys, models["llama-8b"], "--moe-ep-degree", "2")  # not a mixture of experts
    assert status == 2 and "moe_ep_degree=2: is not a NeuronConfig attribute" in err


def test_invalid_input_lists_every_problem(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    bad = ("--instance", "trn9.32xlarge", "--tp-degree", "0", "--batch-size", "0", "--max-context-length", "512")
    status, out, err = _plan(capsys, tmp_path, *bad, "--lora-adapter-mb", "-3")
    assert status == 2 and out == ""
    for text in ("--instance='trn9.32xlarge'", "config.json.model_type='bert'", "tp_degree=0", "batch_size=0"):
        assert text in err
    assert "max_context_length=512" in err and "--lora-adapter-mb=-3.0" in err and "6 problems" in err
    status, doc = _plan_json(capsys, tmp_path, *bad)
    assert status == 2 and len(doc["problems"]) == 5
    # a configuration that cannot be planned at all, plus a contradiction between flags
    status, _, err = _plan(
        capsys, models["llama-8b"], "--tp-degree", "4", "--flash-decoding-enabled", "--target", "trn2", *L8_TRN1[:2]
    )
    assert status == 2 and "flash_decoding_enabled=True" in err and "target='trn2'" in err


def test_configuration_and_platform_problems_are_listed_in_one_pass(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--max-context-length", "999", "--seq-len", "128", "--tp-degree", "7", "--instance", "trn1.32xlarge")
    status, out, err = _plan(capsys, models["llama-8b"], *flags)
    assert status == 2 and out == "" and "2 problems" in err
    assert "max_context_length=999" in err and "tp_degree=7: is not supported on trn1 at LNC=1" in err


def test_trn3_target(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _plan(capsys, models["llama-8b"], "--target", "trn3", "--tp-degree", "8", "--seq-len", "2048")
    assert status == 0 and "Target     trn3, LNC 2: 36.00 GiB HBM per logical core" in out


def test_unreadable_config_is_invalid_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    status, _, err = _plan(capsys, tmp_path)
    assert status == 2 and "is not valid JSON" in err
    status, _, err = _plan(capsys, tmp_path / "missing")
    assert status == 2 and "has no config.json" in err


def test_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "exit status:" in out and "does not fit" in out and "--lora-adapter-mb" in out and "--tp-degree" in out


def test_planning_imports_no_torch(models: dict[str, Path]) -> None:
    code = (
        "import sys\n"
        "from nxdi.shell.cli.main import main\n"
        f"assert main(['plan', '--model-path', {str(models['llama-70b'])!r}, '--tp-degree', '16', '--json']) == 0\n"
        "assert main(['bench', 'plan', '--repeat', '2', '--warmup', '0']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_bench_plan_prints_timings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "plan", "--repeat", "20", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "20 timed runs per case" in out and "median ms" in out and "p90 ms" in out
    rows = [line for line in out.splitlines() if "405B" in line]
    assert len(rows) == 3 and all(len(row.split()) > 8 for row in rows)
    assert "target: median < 50 ms per plan:" in out
    assert main(["bench", "plan", "--repeat", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["repeat"] for c in doc["cases"]] == [3, 3, 3]
    assert all(0 < c["min_ms"] <= c["median_ms"] <= c["p90_ms"] for c in doc["cases"])


def test_bench_without_a_name_runs_the_default_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_plan, "CASES", bench_plan.CASES[:1])  # the default path, at a third of the cost
    assert main(["bench"]) == 0
    assert "nxdi bench plan: 200 timed runs" in capsys.readouterr().out


def test_timings_summary() -> None:
    t = Timings(samples=[0.010, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009])
    assert (t.min, t.median, t.p90) == (0.001, 0.0055, 0.009)
    assert Timings(samples=[0.5]).p90 == 0.5


def test_mixtral_hybrid_sharding_reports_both_expert_layouts(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Context encoding splits every expert over all 32 ranks; token generation gives each group of
    4 ranks one expert. Each rank holds both, so the weights per core grow by the second copy."""
    hybrid = ("--moe-cte-tp-degree", "32", "--moe-cte-ep-degree", "1", "--moe-tkg-tp-degree", "4")
    status, out, _ = _plan(capsys, models["mixtral"], "--tp-degree", "32", *hybrid, "--moe-tkg-ep-degree", "8")
    assert status == 0, out
    assert "Experts    context encoding 8 per layer on every rank: 8 experts per rank, each 448 of its 14336" in out
    assert "Experts    token generation 8 per layer in 8 expert groups of 4 ranks: 1 expert per rank, each 3584" in out
    status, doc = _plan_json(capsys, models["mixtral"], "--tp-degree", "32", *hybrid, "--moe-tkg-ep-degree", "8")
    _, plain = _plan_json(capsys, models["mixtral"], "--tp-degree", "32")
    s = doc["sharding"]
    assert status == 0 and (s["experts_per_rank"], s["expert_rows_per_rank"]) == (8, 448)
    assert (s["tkg_experts_per_rank"], s["tkg_expert_rows_per_rank"]) == (1, 3584)
    assert plain["sharding"]["tkg_experts_per_rank"] is None
    # the second copy: 1 expert's 3584 rows per rank, of 3 [E]-wide matrices, in 32 layers, bf16
    second = 32 * 3 * 1 * 3584 * 4096 * 2
    assert doc["memory"]["weights_bytes_per_core"] - plain["memory"]["weights_bytes_per_core"] == second
    status, _, err = _plan(capsys, models["mixtral"], "--tp-degree", "32", *hybrid, "--moe-tkg-ep-degree", "4")
    assert status == 2 and "hybrid_sharding_config.moe_tkg_tp_degree=4: x moe_tkg_ep_degree=4 must equal" in err
    assert "set moe_tkg_tp_degree=8" in err


FUSED = ("--seq-len", "2048", "--speculation-length", "5", "--enable-fused-speculation")


def test_a_fused_draft_is_counted_from_its_config_or_said_not_to_be(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-70b with llama-8b as its fused draft: the draft's weights and KV cache per core are
    llama-8b's own plan at the same settings, every cache row holds seq_len + k slots, and only
    context-encoding and fused programs compile. Without --draft-model-path the plan says the draft
    is not counted; with it but without fused speculation the flag is refused."""
    draft = ("--draft-model-path", str(models["llama-8b"]))
    status, doc = _plan_json(capsys, models["llama-70b"], *L8_TRN1, *FUSED, *draft)
    _, alone = _plan_json(capsys, models["llama-8b"], *L8_TRN1, "--seq-len", "2053")
    assert status == 0, doc["problems"]
    m = doc["memory"]
    assert m["draft_weights_bytes_per_core"] == alone["memory"]["weights_bytes_per_core"] > 0
    assert m["draft_kv_cache_bytes_per_core"] == alone["memory"]["kv_cache_bytes_per_core"]
    assert m["speculation_bytes_per_core"] == m["draft_weights_bytes_per_core"] + m["draft_kv_cache_bytes_per_core"]
    assert doc["kv_cache"]["shape_per_rank"][2] == 2048 + 5
    assert doc["programs"] == {"total": 2, "by_phase": {"context_encoding": 1, "fused_speculation": 1}}
    assert not any("not counted" in w for w in doc["warnings"])

    status, out, _ = _plan(capsys, models["llama-70b"], *L8_TRN1, *FUSED)
    assert status == 0 and "the draft model's weights and KV cache are not counted" in out
    assert "Programs   2 compiled: 1 context_encoding, 1 fused_speculation" in out
    status, _, err = _plan(capsys, models["llama-70b"], *L8_TRN1, "--seq-len", "2048", *draft)
    assert status == 2 and "--draft-model-path=" in err and "enable_fused_speculation is off" in err


def test_trace_tokengen_model_false_counts_no_token_generation_programs(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--seq-len", "2048", "--enable-bucketing", "--speculation-length", "4")
    _, traced = _plan_json(capsys, models["llama-8b"], *L8_TRN1, *flags)
    _, untraced = _plan_json(capsys, models["llama-8b"], *L8_TRN1, *flags, "--no-trace-tokengen-model")
    assert traced["programs"]["by_phase"]["token_generation"] == 5
    assert "token_generation" not in untraced["programs"]["by_phase"]
    assert untraced["programs"]["total"] == traced["programs"]["total"] - 5
    assert any("trace_tokengen_model=False" in w for w in untraced["warnings"])


def test_a_counted_fused_draft_keeps_in_float_what_draft_model_modules_to_not_convert_lists() -> None:
    """The planner's draft is the target's settings with the draft's list (what the engine runs)."""
    settings = {"seq_len": 64, "speculation_length": 4, "enable_fused_speculation": True, "quantized": True}
    quant = {"quantized_checkpoints_path": "/q", "modules_to_not_convert": ["layers.1"]}
    spec = parse_neuron_spec({**settings, **quant, "draft_model_modules_to_not_convert": ["lm_head"]}).unwrap().spec
    model = spec_of(LLAMA_31_8B)
    counted = cmd_plan._counted_draft((model, False), spec)
    assert counted is not None and counted.spec.modules_to_not_convert == ("lm_head",)
    unset = cmd_plan._counted_draft((model, False), attrs.evolve(spec, draft_model_modules_to_not_convert=None))
    assert unset is not None and unset.spec.modules_to_not_convert == ("layers.1",)

"""`nxdi bench plan`: how fast the pure planner answers for a 405B-parameter model. Effects: reads the clock.

Times `plan_for` (buckets, sharding, KV layout, memory with the smallest-fitting-TP search, LoRA
capacity) for Llama-3.1-405B on trn2.48xlarge at tp 64 and on trn1.32xlarge at tp 32, and the whole
path from raw dicts (`parse_model_spec` + `parse_neuron_spec` + `plan_for`). The target is a median
under 50 ms per plan, so tools can call the planner interactively.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.families import parse_model_spec
from nxdi.core.planning import plan
from nxdi.core.platform import Platform
from nxdi.shell.cli.bench_timing import Timings, render_table, time_calls

TARGET_MS = 50.0

LLAMA_31_405B: Mapping[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 16384,
    "initializer_range": 0.02,
    "intermediate_size": 53248,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 128,
    "num_hidden_layers": 126,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
"""meta-llama/Llama-3.1-405B's config.json (as published)."""


@attrs.frozen(kw_only=True)
class Case:
    """One planning question to time."""

    name: str
    instance: str
    platform: Platform
    neuron_kwargs: Mapping[str, Any]
    from_raw: bool = False
    """Time parsing both configs too, not only `plan_for`."""


_TRN2_TP64: Mapping[str, Any] = {
    "tp_degree": 64,
    "batch_size": 4,
    "seq_len": 16384,
    "max_context_length": 8192,
    "enable_bucketing": True,
    "lora_config": {"max_loras": 4, "max_lora_rank": 16},
}

CASES: tuple[Case, ...] = (
    Case(
        name="plan_for   405B trn2.48xlarge tp 64, batch 4, 8k+8k, 4 LoRA",
        instance="trn2.48xlarge",
        platform=Platform.TRN2,
        neuron_kwargs=_TRN2_TP64,
    ),
    Case(
        name="plan_for   405B trn1.32xlarge tp 32, batch 1, 4k",
        instance="trn1.32xlarge",
        platform=Platform.TRN1,
        neuron_kwargs={"tp_degree": 32, "batch_size": 1, "seq_len": 4096, "enable_bucketing": True},
    ),
    Case(
        name="parse+plan 405B trn2.48xlarge tp 64, batch 4, 8k+8k, 4 LoRA",
        instance="trn2.48xlarge",
        platform=Platform.TRN2,
        neuron_kwargs=_TRN2_TP64,
        from_raw=True,
    ),
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="time the planner on Llama-3.1-405B (target: median < 50 ms)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--repeat", type=int, default=200, help="timed runs per case (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    p.add_argument("--json", action="store_true", help="print the timings as JSON")
    p.set_defaults(run=run)


def _plan_call(case: Case) -> tuple[Callable[[], object], plan.Plan]:
    """The call to time, and the plan it gives (planned once up front; a planning failure is a bug here)."""
    model = parse_model_spec(LLAMA_31_405B).unwrap()
    spec = parse_neuron_spec(case.neuron_kwargs, platform=case.platform).unwrap().spec

    def planned() -> object:
        return plan.plan_for(model, spec, instance=case.instance)

    def from_raw() -> object:
        m = parse_model_spec(LLAMA_31_405B).unwrap()
        s = parse_neuron_spec(case.neuron_kwargs, platform=case.platform).unwrap().spec
        return plan.plan_for(m, s, instance=case.instance)

    return (from_raw if case.from_raw else planned), plan.plan_for(model, spec, instance=case.instance).unwrap()


def _verdict(p: plan.Plan) -> str:
    m = p.memory
    gib = m.per_core_bytes / 2**30
    smallest = "no TP degree fits" if m.min_tp_degree is None else f"smallest fitting TP {m.min_tp_degree}"
    return f"{'fits' if m.fits else 'does not fit'} ({gib:.1f} GiB per core; {smallest})"


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.warmup < 0:
        print("nxdi bench plan: --repeat must be >= 1 and --warmup >= 0")
        return 2
    rows: list[tuple[str, Timings, str]] = []
    for case in CASES:
        call, result = _plan_call(case)
        rows.append((case.name, time_calls(call, repeat=args.repeat, warmup=args.warmup), _verdict(result)))
    met = all(t.median * 1e3 < TARGET_MS for _, t, _ in rows)
    if args.json:
        cases = [{"case": name, **t.to_dict(), "plan": note} for name, t, note in rows]
        print(json.dumps({"bench": "plan", "target_median_ms": TARGET_MS, "met": met, "cases": cases}, indent=2))
        return 0
    print(f"nxdi bench plan: {args.repeat} timed runs per case after {args.warmup} warm-up runs (time.perf_counter)")
    print(render_table(rows, note_title="plan"))
    print(f"target: median < {TARGET_MS:.0f} ms per plan: {'met' if met else 'MISSED'}")
    return 0

"""`nxdi plan`: buckets, sharding, KV cache, memory verdict and LoRA capacity of one deployment. Effects: reads config.json.

The model's `config.json` is parsed with `parse_model_spec`, the NeuronConfig flags with
`parse_neuron_spec` (no NeuronConfig object, no environment variables, no torch), and the pure
planner `plan_for` answers. Every problem in the input is reported at once.

Exit status (also in `nxdi plan --help`):
- 0: the configuration runs as asked (it fits, its TP degree is valid on the platform, ...).
- 1: the plan was made but lists problems (does not fit, a TP degree the platform does not support,
  more adapters than fit, ...); the full plan is still printed, so a "no" is a complete answer.
- 2: invalid input (a bad flag value, an unreadable or unsupported config.json, an unknown instance,
  a configuration that cannot be planned at all); every problem is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config import codec, fused_checks
from nxdi.core.config.fields import did_you_mean
from nxdi.core.config.neuron_parse import parse_neuron_spec
from nxdi.core.config.neuron_spec import DTYPE_BYTES, NeuronSpec
from nxdi.core.errors import ConfigError, Problem
from nxdi.core.families import parse_model_spec
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import plan, sharding, speculation_memory
from nxdi.core.platform import INSTANCES, Platform, resolve_lnc
from nxdi.shell.cli import plan_report
from nxdi.shell.cli.flags import add_neuron_config_flags, neuron_config_kwargs

# LoRA sizes are decimal: the units adapter checkpoint sizes and the NxDI LoRA tables use.
MB = 10**6
GB = 10**9

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""The plan was made but lists problems."""
EXIT_INVALID = 2

_EPILOG = """\
exit status:
  0  the configuration runs as asked
  1  the plan was made but lists problems (does not fit in HBM, a TP degree the platform does not
     support, more adapters than fit, ...); the whole plan is still printed
  2  invalid input (bad flag values, unreadable or unsupported config.json, unknown instance, a
     configuration that cannot be planned at all); every problem is printed

Platform: --instance, else --target, else trn1. LNC: --logical-nc-config, else the platform's
default; environment variables (NEURON_LOGICAL_NC_CONFIG, ...) are not read, so a plan depends on
its arguments only. torch_dtype: --torch-dtype, else the dtype in config.json, else bfloat16.
Memory is in GiB (2**30 bytes); LoRA sizes are in MB and GB (10**6 and 10**9 bytes).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="plan buckets, sharding, KV cache, memory and LoRA capacity (no device, no torch)",
        description="Plan a deployment of a model: buckets, GQA sharding, per-rank KV cache, memory per "
        "core against HBM, and LoRA adapter capacity.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--model-path", required=True, help="model folder holding config.json, or the config.json file")
    p.add_argument("--instance", help=f"EC2 instance type ({', '.join(INSTANCES)})")
    p.add_argument("--json", action="store_true", help="print the plan as a JSON document")
    p.add_argument(
        "--draft-model-path",
        help="with --enable-fused-speculation: the draft's model folder (or config.json), so its weights and "
        "KV cache are counted (in the target's settings); without it they are not, and the plan says so",
    )
    _add_lora_flags(p)
    _add_chunked_prefill_flags(p)
    add_neuron_config_flags(p)
    p.set_defaults(run=run)


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    """Plan-only LoRA options (NeuronConfig's lora_config has no flags of its own)."""
    g = p.add_argument_group("LoRA capacity (plan only)")
    g.add_argument("--lora-rank", type=int, help="adapter rank; the adapter size follows from the model (default 16)")
    g.add_argument(
        "--lora-target-modules", nargs="+", help="modules with adapters (default q_proj k_proj v_proj o_proj)"
    )
    g.add_argument("--lora-adapter-mb", type=float, help="size of one adapter in MB (instead of --lora-rank)")
    g.add_argument("--lora-memory-gb", type=float, help="GB per core reserved for adapters (default: what is free)")
    g.add_argument(
        "--lora-shard-linear-layer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard each adapter's linear layer across the TP group (default) or duplicate it on every core",
    )
    g.add_argument("--max-loras", type=int, help="adapters resident on device: counted in memory and checked")


def _add_chunked_prefill_flags(p: argparse.ArgumentParser) -> None:
    """chunked_prefill_config as the reference's inference demo spells it (it has no NeuronConfig flag)."""
    g = p.add_argument_group("chunked prefill (needs --is-block-kv-layout)")
    g.add_argument("--enable-chunked-prefill", action="store_true", help="set chunked_prefill_config")
    g.add_argument("--max-num-seqs", type=int, help="sequences per chunked-prefill call (max_num_seqs)")
    g.add_argument("--kernel-q-tile-size", type=int, help="query tile of the chunked-prefill kernel (default 128)")
    g.add_argument("--kernel-kv-tile-size", type=int, help="KV tile of the chunked-prefill kernel (default 1024)")


def _chunked_prefill_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """`chunked_prefill_config` from the flags; the core checks the values."""
    if not args.enable_chunked_prefill:
        return None
    names = ("max_num_seqs", "kernel_q_tile_size", "kernel_kv_tile_size")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


_LORA_DESTS = ("lora_rank", "lora_target_modules", "lora_adapter_mb", "lora_memory_gb", "lora_shard_linear_layer")


def _lora_problems(args: argparse.Namespace) -> list[Problem]:
    """Problems of the plan-only LoRA flags alone (the core checks the rest)."""
    found: list[Problem] = []
    if args.lora_adapter_mb is not None:
        if args.lora_adapter_mb <= 0:
            found.append(Problem.of("--lora-adapter-mb", args.lora_adapter_mb, "must be positive"))
        for other in ("lora_rank", "lora_target_modules", "max_loras"):
            if getattr(args, other) is not None:
                flag = "--" + other.replace("_", "-")
                found.append(
                    Problem.of("--lora-adapter-mb", args.lora_adapter_mb, f"conflicts with {flag}", "give only one")
                )
    if args.lora_rank is not None and args.lora_rank < 1:
        found.append(Problem.of("--lora-rank", args.lora_rank, "must be a positive integer"))
    if args.lora_memory_gb is not None and args.lora_memory_gb < 0:
        found.append(Problem.of("--lora-memory-gb", args.lora_memory_gb, "must be >= 0"))
    return found


def _lora_request(args: argparse.Namespace) -> plan.LoraRequest | None:
    """The LoRA capacity question the flags ask, or None when they ask none."""
    if all(getattr(args, d) is None for d in (*_LORA_DESTS, "max_loras")):
        return None
    request = plan.LoraRequest(
        rank=16 if args.lora_rank is None else args.lora_rank,
        adapter_bytes=None if args.lora_adapter_mb is None else round(args.lora_adapter_mb * MB),
        reserved_bytes_per_core=None if args.lora_memory_gb is None else round(args.lora_memory_gb * GB),
        shard_linear_layer=args.lora_shard_linear_layer is not False,
    )
    if args.lora_target_modules is not None:
        request = attrs.evolve(request, target_modules=tuple(args.lora_target_modules))
    return request


def _lora_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """`lora_config` for the NeuronSpec when --max-loras puts adapters on the device."""
    if args.max_loras is None:
        return None
    cfg: dict[str, Any] = {
        "max_loras": args.max_loras,
        "lora_shard_linear_layer": args.lora_shard_linear_layer is not False,
    }
    if args.lora_rank is not None:
        cfg["max_lora_rank"] = args.lora_rank
    if args.lora_target_modules is not None:
        cfg["target_modules"] = list(args.lora_target_modules)
    return cfg


def config_file(model_path: str) -> str:
    """`DIR/config.json` for a folder, else the path itself."""
    path = Path(model_path)
    return str(path / "config.json") if path.is_dir() else model_path


def read_hf_config(model_path: str, flag: str = "--model-path") -> Result[dict[str, Any], ConfigError]:
    """The `config.json` of a model folder (or the file itself), as a dict.

    Returns:
        `Failure` naming `flag` when there is no such file, or the file when it is not a JSON object.
    """
    file = Path(config_file(model_path))
    if not file.is_file():
        return Failure(ConfigError.of(flag, model_path, "has no config.json", "give a model folder or file"))
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return Failure(ConfigError.of(flag, str(file), f"cannot be read ({exc})"))
    return codec.loads(text, source=str(file))


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
    """The checkpoint's dtype name from config.json (`torch_dtype`, or the newer `dtype`), if known."""
    raw = hf.get("torch_dtype") or hf.get("dtype")
    name = raw.removeprefix("torch.") if isinstance(raw, str) else None
    return name if name in DTYPE_BYTES else None


def _platform(args: argparse.Namespace, found: list[Problem]) -> Platform:
    """The platform to parse flags for: the instance's, else --target's, else trn1."""
    target = Platform(args.nc_target) if args.nc_target is not None else None
    if args.instance is None:
        return target or Platform.TRN1
    known = INSTANCES.get(args.instance)
    if known is None:
        found.append(
            Problem.of(
                "--instance",
                args.instance,
                "is not a known instance type",
                did_you_mean(args.instance, INSTANCES) or f"use one of {list(INSTANCES)}",
            )
        )
        return target or Platform.TRN1
    if target is not None and target is not known.platform:
        found.append(
            Problem.of("target", target.value, f"contradicts --instance {args.instance} ({known.platform.value})")
        )
    return known.platform


def _neuron_kwargs(args: argparse.Namespace, hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """NeuronConfig kwargs from the flags, and where torch_dtype comes from (as load_pretrained_config does)."""
    kwargs = neuron_config_kwargs(args)
    source = "--torch-dtype" if "torch_dtype" in kwargs else "default"
    if source == "default" and checkpoint_dtype(hf) is not None:
        kwargs.update(torch_dtype=checkpoint_dtype(hf), overrides_torch_dtype=False)
        source = "config.json"
    lora_config = _lora_config(args)
    if lora_config is not None:
        kwargs["lora_config"] = lora_config
    chunked = _chunked_prefill_config(args)
    if chunked is not None:
        kwargs["chunked_prefill_config"] = chunked
    return kwargs, source


def _failures(*results: Result[Any, ConfigError]) -> list[Problem]:
    return [p for r in results if isinstance(r, Failure) for p in r.failure().problems]


def _placement_problems(
    kwargs: dict[str, Any], where: Platform, instance: str | None, model: Result[ModelSpec, ConfigError]
) -> list[Problem]:
    """What planning would also say about tp_degree when the flags do not parse as a whole (so one
    run lists every problem): whether the platform and instance support it, and whether the model's
    heads shard over it."""
    tp = kwargs.get("tp_degree", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return []  # the flag itself is wrong, and already reported
    target = next((p for p in Platform if p.value == kwargs.get("target")), where)
    requested = kwargs.get("logical_nc_config")
    lnc, _ = resolve_lnc(env=None, requested=requested if isinstance(requested, int) else None, platform=target)
    known = instance if instance in INSTANCES else None
    heads = model.bind(lambda m: sharding.shard_plan(m, tp=tp))
    return _failures(sharding.check_tp_degree(tp, platform=target, lnc=lnc, instance=known), heads)


def _draft(args: argparse.Namespace, fused: bool) -> Result[tuple[ModelSpec, bool] | None, ConfigError]:
    """The fused draft's architecture from --draft-model-path, and whether an EAGLE draft's fc has a
    bias (its `fc_bias`); None when not given. Refused without fused speculation, where no draft runs."""
    if args.draft_model_path is None:
        return Success(None)
    if not fused:
        why = "names a fused-speculation draft, but enable_fused_speculation is off: no draft would run"
        fix = "add --enable-fused-speculation (with --speculation-length), or drop --draft-model-path"
        return Failure(ConfigError.of("--draft-model-path", args.draft_model_path, why, fix))
    return read_hf_config(args.draft_model_path, "--draft-model-path").bind(
        lambda d: (
            parse_model_spec(d)
            .alt(lambda e: e.prefixed("draft config.json"))
            .map(lambda m: (m, bool(d.get("fc_bias", False))))
        )
    )


def _counted_draft(found: tuple[ModelSpec, bool] | None, spec: NeuronSpec) -> speculation_memory.Draft | None:
    """The draft to count: it runs with the target's settings (fused_spec_config's draft_config is a
    copy of the target's NeuronConfig), as an EAGLE draft under enable_eagle_speculation, its
    modules_to_not_convert the target's draft_model_modules_to_not_convert when set."""
    if found is None:
        return None
    model, fc_bias = found
    eagle = spec.enable_eagle_speculation
    own = attrs.evolve(
        fused_checks.draft_spec(spec, spec),
        enable_fused_speculation=False,
        enable_eagle_speculation=False,
        is_eagle_draft=eagle,
    )
    return speculation_memory.Draft(model=model, spec=own, fc_bias=fc_bias)


def make_plan(args: argparse.Namespace) -> Result[plan_report.PlanRun, ConfigError]:
    """Parse the model and the flags, then plan.

    Returns:
        `Success(PlanRun)`, or `Failure` listing every problem of the flags, of config.json, and of
        planning (planning still runs when only the instance or the LoRA flags are at fault).
    """
    lora_found = _lora_problems(args)
    found = list(lora_found)
    where = _platform(args, found)
    hf_result = read_hf_config(args.model_path)
    model = hf_result.bind(lambda d: parse_model_spec(d).alt(lambda e: e.prefixed("config.json")))
    kwargs, dtype_source = _neuron_kwargs(args, hf_result.value_or({}))
    parsed = parse_neuron_spec(kwargs, platform=where, moe=model.map(lambda m: m.is_moe).value_or(False))
    draft = _draft(args, parsed.map(lambda r: r.spec.enable_fused_speculation).value_or(True))
    found += _failures(model, parsed, draft)
    if found and any(isinstance(r, Failure) for r in (model, parsed, draft)):
        found += _placement_problems(kwargs, where, args.instance, model)
        return Failure(ConfigError(problems=tuple(dict.fromkeys(found))))
    m, p = model.unwrap(), parsed.unwrap()
    instance = args.instance if args.instance in INSTANCES else None
    request = None if lora_found else _lora_request(args)
    counted = _counted_draft(draft.unwrap(), p.spec)
    outcome = plan.plan_for(m, p.spec, platform=where, instance=instance, lora_request=request, draft=counted)
    found += _failures(outcome)
    if found:
        return Failure(ConfigError(problems=tuple(dict.fromkeys(found))))
    return outcome.map(
        lambda pl: plan_report.PlanRun(
            model=m,
            spec=p.spec,
            plan=pl,
            config_file=config_file(args.model_path),
            dtype_source=dtype_source,
            lora_memory_given=args.lora_memory_gb is not None,
            notes=p.notes,
        )
    )


def run(args: argparse.Namespace) -> int:
    match make_plan(args):
        case Success(result):
            if args.json:
                print(json.dumps(plan_report.plan_document(result), indent=2))
            else:
                print(plan_report.render_plan(result))
            return EXIT_PROBLEMS if result.plan.problems else EXIT_OK
        case Failure(err):
            if args.json:
                print(json.dumps({"problems": [attrs.asdict(p) for p in err.problems], "warnings": []}, indent=2))
            print(err.render("nxdi plan: invalid input"), file=sys.stderr)
    return EXIT_INVALID

"""`nxdi bench load`: host memory while tensor-parallel weights are sharded and loaded.

    nxdi bench load [--model-type llama] [--shape tiny|small|toy | --model-path DIR] [--dtype bfloat16]
                    [--tp-degree 2] [--work-dir .nxdi-bench] [--json]

Three phases on one checkpoint (a random `--shape` built into the work dir, as `bench generate`
does, or `--model-path`), each against the bound "largest checkpoint tensor + one rank's shard":
- driver, `shard_weights()` into the compiled folder: this process converts every rank's weights
  and writes them to `weights/tp{rank}_sharded_checkpoint.safetensors`, one rank at a time;
- ranks, `to_cpu()`: every rank process reads its slices of the original checkpoint;
- ranks, `load()`: every rank process reads its presharded file.
The figure is the peak of *anonymous* resident memory during the phase minus what the process held
when it began (its interpreter, torch, the process group), sampled every 5 ms. Memory-mapped
checkpoint pages are left out: they are page cache the kernel reclaims at will (the peak total
resident size, VmHWM, includes them and is shown beside it for the driver). Linux only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from nxdi.shell.cli import bench_models

    p = sub.add_parser(
        "load",
        help="host memory of sharding and loading tensor-parallel weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    bench_models.add_checkpoint_args(p, default_shape="tiny")
    p.add_argument("--tp-degree", type=int, default=2)
    p.add_argument("--work-dir", default=".nxdi-bench", help="random checkpoints and the sharded folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def _largest_tensor(path: Path) -> int:
    """Bytes of the checkpoint's largest tensor (from the headers)."""
    from nxdi.effects import checkpoint

    with checkpoint.open_checkpoint(path) as ckpt:
        sizes = ckpt.shapes()
        return max(ckpt.torch_dtype(key).itemsize * _numel(shape) for key, shape in sizes.items())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _model(path: Path, args: argparse.Namespace) -> Any:
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES, model_type_of

    cls = MODEL_TYPES[model_type_of(str(path))]["causal-lm"]
    neuron = cls.get_neuron_config_cls()(
        tp_degree=args.tp_degree, torch_dtype=args.dtype, seq_len=128, skip_warmup=True
    )
    return cls, cls.get_config_cls()(neuron, load_config=load_pretrained_config(path))


def _rank_rows(probes: list[Any], bound: int) -> list[dict[str, Any]]:
    return [
        {
            "rank": p.rank,
            "peak_anon_mib": (p.peak_anon_in_build - p.anon_before_build) / MIB,
            "ratio_to_bound": (p.peak_anon_in_build - p.anon_before_build) / bound,
        }
        for p in probes
    ]


def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The three phases' memory (see the module docstring)."""
    from nxdi.effects import memory

    cls, config = _model(path, args)
    folder = Path(args.work_dir) / f"sharded-{path.name}-tp{args.tp_degree}"
    shutil.rmtree(folder, ignore_errors=True)
    model = cls(path, config)
    model.compile(folder)  # the programs; shard_weights() then lists its shards beside them

    t = time.perf_counter()
    memory.reset_peak()  # the peak resident size of this phase only
    with memory.PeakSampler() as sampler:
        model.shard_weights(folder)
    shard_s = time.perf_counter() - t
    shard = max(f.stat().st_size for f in (folder / "weights").iterdir())
    largest = _largest_tensor(path)
    bound = largest + shard
    driver = {
        "peak_anon_mib": (sampler.peak_anon - sampler.start.anon) / MIB,
        "ratio_to_bound": (sampler.peak_anon - sampler.start.anon) / bound,
        "peak_rss_mib": memory.usage().peak_rss / MIB,
        "seconds": shard_s,
    }

    t = time.perf_counter()
    model.to_cpu()
    eager_s = time.perf_counter() - t
    eager = _rank_rows(model._require_runtime().probe(), bound)
    model.close()

    loader = cls(folder)
    t = time.perf_counter()
    loader.load(folder)
    load_s = time.perf_counter() - t
    loaded = _rank_rows(loader._require_runtime().probe(), bound)
    loader.close()
    return {
        "checkpoint": str(path),
        "tp_degree": args.tp_degree,
        "largest_tensor_mib": largest / MIB,
        "shard_mib": shard / MIB,
        "bound_mib": bound / MIB,
        "driver_shard_weights": driver,
        "ranks_to_cpu": {"seconds": eager_s, "ranks": eager},
        "ranks_load": {"seconds": load_s, "ranks": loaded},
    }


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['checkpoint']} at tp_degree {r['tp_degree']}: largest tensor {r['largest_tensor_mib']:.0f} MiB, "
        f"one rank's shard {r['shard_mib']:.0f} MiB, bound {r['bound_mib']:.0f} MiB",
    ]
    d = r["driver_shard_weights"]
    lines.append(
        f"  driver shard_weights(): peak anonymous +{d['peak_anon_mib']:.0f} MiB = {d['ratio_to_bound']:.2f}x the bound"
        f"  (peak resident incl. mapped checkpoint pages {d['peak_rss_mib']:.0f} MiB; {d['seconds']:.1f} s)"
    )
    for name, key in (("to_cpu()", "ranks_to_cpu"), ("load()", "ranks_load")):
        phase = r[key]
        for rank in phase["ranks"]:
            lines.append(
                f"  rank {rank['rank']} {name:<9}: peak anonymous +{rank['peak_anon_mib']:.0f} MiB"
                f" = {rank['ratio_to_bound']:.2f}x the bound"
            )
        lines.append(f"  ({name} took {phase['seconds']:.1f} s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from nxdi.shell.cli.bench_models import checkpoint_for

    if args.tp_degree < 2:
        print("nxdi bench load: --tp-degree must be at least 2 (rank processes)", flush=True)
        return 2
    result = measure(checkpoint_for(args), args)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0

"""LoRA adapters on disk: path lists, the JSON path file, adapter configs, adapter weights. Effects: reads files.

Resolves what `LoraServingConfig` is given into plain data for `nxdi.core.config.sub_specs.LoraSpec`:
adapter id -> path maps (checked to exist), and the union of the adapters' target modules and
their largest rank, read from each adapter's `adapter_config.json` (PEFT format) when present.
`read_for` reads every device adapter of a spec, checks it against the base model and stacks them
into the programs' weights (`nxdi.core.programs.lora`); `sliced` and `write_slots` give a
tensor-parallel rank its slices of them, at load and at each dynamic swap. `read_adapter_weights` reads one adapter's tensors (for `nxdi.shell.lora_serving.LoraCheckpoint`)
in either format NxDI reads: a PEFT folder (`adapter_config.json` plus a `.safetensors`, `.bin`
or `.pt` file), or one NxD checkpoint file whose state dict also holds its `lora_config`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import CheckpointError, Problem

if TYPE_CHECKING:
    from torch import Tensor

    from nxdi.core.config.neuron_spec import NeuronSpec
    from nxdi.core.model_spec import ModelSpec
    from nxdi.core.weight_plan import Take

_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt")


@attrs.frozen(kw_only=True)
class AdapterInfo:
    """What one adapter's files say about it."""

    rank: int | None
    target_modules: tuple[str, ...]


def read_paths_json(path: str) -> dict[str, Any]:
    """Read a LoRA path file with keys `lora-ckpt-dir`, `lora-ckpt-paths`, `lora-ckpt-paths-cpu`.

    Returns kwargs for LoraServingConfig (`lora_ckpt_paths`, `lora_ckpt_paths_cpu`), with relative
    paths joined to `lora-ckpt-dir`. Raises FileNotFoundError when the file is missing and
    ValueError when it is not a JSON object of that shape.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"lora_ckpt_json: LoRA path file {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_ckpt_json: {str(file)!r} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"lora_ckpt_json: {str(file)!r} must hold a JSON object")
    base = Path(data.get("lora-ckpt-dir") or file.parent)
    out: dict[str, Any] = {}
    for key, kwarg in (("lora-ckpt-paths", "lora_ckpt_paths"), ("lora-ckpt-paths-cpu", "lora_ckpt_paths_cpu")):
        paths = data.get(key)
        if paths is None:
            continue
        if not isinstance(paths, dict):
            raise ValueError(f"lora_ckpt_json: {key!r} in {str(file)!r} must map adapter ids to paths")
        out[kwarg] = {str(k): str(base / v) for k, v in paths.items()}
    return out


def check_paths_exist(paths: Mapping[str, str], field: str) -> None:
    """Raise FileNotFoundError listing every adapter whose checkpoint path does not exist."""
    missing = [f"{k} : {v}" for k, v in paths.items() if not Path(v).exists()]
    if missing:
        raise FileNotFoundError(f"{field}: LoRA checkpoint paths do not exist: {', '.join(missing)}")


def read_adapter_info(path: str) -> AdapterInfo:
    """Rank and target modules from the adapter's `adapter_config.json` (folder) or sibling JSON file."""
    p = Path(path)
    candidates = (
        [p / "adapter_config.json"] if p.is_dir() else [p.with_suffix(".json"), p.parent / "adapter_config.json"]
    )
    for config in candidates:
        if config.is_file():
            try:
                data = json.loads(config.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"LoRA adapter config {str(config)!r} is not valid JSON ({exc.msg})") from None
            rank = data.get("r", data.get("lora_rank"))
            modules = data.get("target_modules") or ()
            return AdapterInfo(rank=int(rank) if rank is not None else None, target_modules=tuple(sorted(modules)))
    return AdapterInfo(rank=None, target_modules=())


def merge_adapter_infos(
    infos: list[AdapterInfo], *, target_modules: tuple[str, ...] | None, max_rank: int
) -> tuple[tuple[str, ...] | None, int]:
    """The target modules (given ones, widened to the adapters' union) and the max rank seen."""
    union = sorted({m for info in infos for m in info.target_modules} | set(target_modules or ()))
    ranks = [info.rank for info in infos if info.rank is not None]
    return (tuple(union) if union else target_modules), max([max_rank, *ranks])


@attrs.frozen(kw_only=True, eq=False)
class AdapterWeights:
    """One adapter's tensors and the scaling settings of its config (eq=False: it holds tensors)."""

    scaling: tuple[float, bool] | None
    """`(lora_alpha, use_rslora)` from the adapter's config; None when it has no config."""
    state_dict: dict[str, Tensor]
    """The adapter's tensors, keys as stored (`...q_proj.lora_A.weight`, ...)."""
    config: Mapping[str, Any] | None = None
    """The adapter's whole config (`adapter_config.json`, or a checkpoint file's `lora_config`)."""


def _scaling_of(config: Any) -> tuple[float, bool] | None:
    if not isinstance(config, Mapping):
        return None
    return float(config.get("lora_alpha", 0) or 0), bool(config.get("use_rslora", False))


def _read_tensors(file: Path) -> dict[str, Any]:
    """A `.safetensors`, `.bin` or `.pt` file's dict (`.bin`/`.pt` read with `weights_only=True`).

    Raises:
        FileNotFoundError: the file has another suffix (the reference's error for it).
        ValueError: the file cannot be read as such a checkpoint, naming it.
    """
    # Imported here: LoraServingConfig (and so `nxdi plan`) uses this module without torch.
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if file.suffix not in _CHECKPOINT_SUFFIXES:
        raise FileNotFoundError(
            f"{str(file)!r}: not a LoRA adapter checkpoint (expected one of {', '.join(_CHECKPOINT_SUFFIXES)})"
        )
    try:
        if file.suffix == ".safetensors":
            return dict(load_file(str(file)))
        data = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, EOFError, ValueError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"{str(file)!r}: cannot be read as a LoRA adapter checkpoint ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r}: does not hold a state dict of name -> tensor")
    return data


def read_adapter_weights(path: str | Path) -> AdapterWeights:
    """Read one adapter: a PEFT folder or an NxD checkpoint file (see the module docstring).

    A folder's checkpoint is its `.safetensors` file, else its `.bin`, else its `.pt` (the first by
    name); a file's scaling comes from the `lora_config` entry of its state dict.

    Raises:
        FileNotFoundError: `path` does not exist, or is a file of another suffix.
        ValueError: a folder without a checkpoint file, an unreadable file or adapter_config.json, or a
            state dict holding something other than tensors (every such key named).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{str(p)!r}: LoRA adapter checkpoint does not exist")
    scaling: tuple[float, bool] | None = None
    config: Any = None
    if p.is_dir():
        files = [f for suffix in _CHECKPOINT_SUFFIXES for f in sorted(p.glob(f"*{suffix}")) if f.is_file()]
        if not files:
            raise ValueError(
                f"{str(p)!r}: no LoRA adapter checkpoint in the folder (expected a {', '.join(_CHECKPOINT_SUFFIXES)} file)"
            )
        config_file = p / "adapter_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
                scaling = _scaling_of(config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"LoRA adapter config {str(config_file)!r} is not valid JSON ({exc.msg})") from None
        data = _read_tensors(files[0])
    else:
        data = _read_tensors(p)
        config = data.pop("lora_config", None)
        scaling = _scaling_of(config)
    import torch

    others = sorted(k for k, v in data.items() if not isinstance(v, torch.Tensor))
    if others:
        raise ValueError(f"{str(p)!r}: LoRA adapter entries are not tensors: {', '.join(map(str, others))}")
    return AdapterWeights(
        scaling=scaling, state_dict=data, config=dict(config) if isinstance(config, Mapping) else None
    )


def _config_problems(field: str, config: Mapping[str, Any] | None) -> list[Problem]:
    """Adapter settings whose effect the programs cannot reproduce (refused, never ignored)."""
    if config is None:
        return []
    problems = []
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        why = "trains biases, which multi-LoRA serving does not apply (lora_bias='none' only)"
        problems.append(Problem.of(f"{field}.bias", bias, why, "use an adapter trained with bias='none'"))
    if config.get("use_dora"):
        problems.append(Problem.of(f"{field}.use_dora", True, "DoRA adapters are not supported", "use a LoRA adapter"))
    if config.get("alpha_pattern"):
        why = "sets per-module alphas, which are not supported"
        problems.append(Problem.of(f"{field}.alpha_pattern", config["alpha_pattern"], why, "use one lora_alpha"))
    return problems


def adapter_ids(spec: NeuronSpec) -> dict[str, str]:
    """The device adapters, id -> path, in slot order: `lora_ckpt_paths` in the order given, so the
    `position`-th id here is NxDI's adapter index `position` (+1 with enable_base_model_only)."""
    cfg = spec.lora_config
    return {} if cfg is None or cfg.lora_ckpt_paths is None else cfg.lora_ckpt_paths.to_dict()


def read_one(adapter_id: str, path: str, field: str, layout: Any) -> Result[Any, CheckpointError]:
    """One adapter read and checked against `layout` (a `LoraLayout`): a `lora.Adapter` at slot 0.

    Returns:
        The adapter, or a CheckpointError listing every problem (`field` names it): an unreadable
        path, refused settings, tensors of other modules, layers or shapes, a rank above max_lora_rank.
    """
    from nxdi.core.planning import lora as lora_plan
    from nxdi.core.programs import lora

    try:
        read = read_adapter_weights(path)
    except (FileNotFoundError, ValueError) as exc:
        found = [Problem.of(field, str(path), f"cannot be read: {exc}", "give the adapter's PEFT folder")]
        return Failure(CheckpointError(problems=tuple(found)))
    found = _config_problems(field, read.config)
    found += lora_plan.check_adapter(adapter_id, {k: tuple(t.shape) for k, t in read.state_dict.items()}, layout)
    if found:
        return Failure(CheckpointError(problems=tuple(found)))
    alpha, rslora = read.scaling if read.scaling is not None else (None, False)
    return Success(lora.Adapter(slot=0, tensors=read.state_dict, alpha=alpha, rslora=rslora))


def read_for(spec: NeuronSpec, model: ModelSpec) -> Result[dict[str, Tensor], CheckpointError]:
    """Every adapter of `spec.lora_config.lora_ckpt_paths`, read, checked and stacked at its slot (the
    `position`-th adapter at `LoraLayout.slot_of(position)`), in the model's dtype.

    Returns:
        The stacked tensors by name (`LoraLayout.shapes()` order), or a CheckpointError listing every
        problem of every adapter (missing or unreadable files, refused settings, tensors of other
        modules, layers or shapes, ranks above max_lora_rank), each naming the adapter: nothing is
        stacked unless every adapter is right.
    """
    import torch  # here: LoraServingConfig (and so `nxdi plan`) imports this module without torch

    from nxdi.core.host import weight_ops
    from nxdi.core.planning import lora as lora_plan
    from nxdi.core.programs import lora

    cfg = spec.lora_config
    assert cfg is not None, "read_for runs for a spec with lora_config"
    planned = lora_plan.layout_for(model, cfg)
    if isinstance(planned, Failure):
        return Failure(CheckpointError(problems=planned.failure().problems))
    layout = planned.unwrap()
    problems: list[Problem] = []
    adapters: list[lora.Adapter] = []
    for position, (adapter_id, path) in enumerate(adapter_ids(spec).items()):
        match read_one(adapter_id, path, f"lora_config.lora_ckpt_paths[{adapter_id}]", layout):
            case Success(adapter):
                adapters.append(dataclasses.replace(adapter, slot=layout.slot_of(position)))
            case Failure(err):
                problems.extend(err.problems)
    if problems:
        return Failure(CheckpointError(problems=tuple(problems)))
    dtype = weight_ops.torch_dtype(spec.torch_dtype)
    return Success(lora.stack(layout, adapters, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32))


def sliced(stacked: Mapping[str, Tensor], takes: Mapping[str, Take | None]) -> dict[str, Tensor]:
    """A tensor-parallel rank's slices of the stacked adapters (`lora_ranks.rank_takes`; a name
    without a Take is held whole)."""
    from nxdi.core.host import weight_ops

    out = {}
    for name, t in stacked.items():
        take = takes.get(name)
        out[name] = t if take is None else weight_ops.take(t, take)
    return out


def write_slots(
    bound: Mapping[str, Tensor], takes: Mapping[str, Take | None], writes: Sequence[tuple[int, Mapping[str, Tensor]]]
) -> None:
    """Copy each adapter's whole slot tensors (`lora.slot_tensors`) into its slot of the `bound`
    stacked tensors, in place, this rank's slice of each (`takes`, along the stacked dims)."""
    import torch

    from nxdi.core.host import weight_ops
    from nxdi.core.weight_plan import Take

    with torch.no_grad():
        for slot, tensors in writes:
            for name, t in tensors.items():
                take = takes.get(name)
                if take is not None:  # the slot tensor lacks the stacked tensor's slot dim
                    t = weight_ops.take(t, Take(dim=take.dim - 1, indices=take.indices))
                bound[name][slot].copy_(t)

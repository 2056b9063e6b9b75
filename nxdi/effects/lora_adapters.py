"""LoRA adapters on disk: path lists, the JSON path file, adapter configs, adapter weights. Effects: reads files.

Resolves what `LoraServingConfig` is given into plain data for `nxdi.core.config.sub_specs.LoraSpec`:
adapter id -> path maps (checked to exist), and the union of the adapters' target modules and
their largest rank, read from each adapter's `adapter_config.json` (PEFT format) when present.
`read_adapter_weights` reads one adapter's tensors (for `nxdi.shell.lora_serving.LoraCheckpoint`)
in either format NxDI reads: a PEFT folder (`adapter_config.json` plus a `.safetensors`, `.bin`
or `.pt` file), or one NxD checkpoint file whose state dict also holds its `lora_config`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from torch import Tensor

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
    if p.is_dir():
        files = [f for suffix in _CHECKPOINT_SUFFIXES for f in sorted(p.glob(f"*{suffix}")) if f.is_file()]
        if not files:
            raise ValueError(
                f"{str(p)!r}: no LoRA adapter checkpoint in the folder (expected a {', '.join(_CHECKPOINT_SUFFIXES)} file)"
            )
        config = p / "adapter_config.json"
        if config.is_file():
            try:
                scaling = _scaling_of(json.loads(config.read_text()))
            except json.JSONDecodeError as exc:
                raise ValueError(f"LoRA adapter config {str(config)!r} is not valid JSON ({exc.msg})") from None
        data = _read_tensors(files[0])
    else:
        data = _read_tensors(p)
        scaling = _scaling_of(data.pop("lora_config", None))
    import torch

    others = sorted(k for k, v in data.items() if not isinstance(v, torch.Tensor))
    if others:
        raise ValueError(f"{str(p)!r}: LoRA adapter entries are not tensors: {', '.join(map(str, others))}")
    return AdapterWeights(scaling=scaling, state_dict=data)

"""LoRA adapter discovery: path lists, the JSON path file, adapter_config.json. Effects: reads files.

Resolves what `LoraServingConfig` is given into plain data for `nxdi.core.config.sub_specs.LoraSpec`:
adapter id -> path maps (checked to exist), and the union of the adapters' target modules and
their largest rank, read from each adapter's `adapter_config.json` (PEFT format) when present.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

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

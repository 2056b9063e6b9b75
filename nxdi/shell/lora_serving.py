"""Multi-LoRA serving: `LoraServingConfig` and `LoraCheckpoint` (NxDI's `modules.lora_serving`).

`LoraCheckpoint(config)` is NxDI's reader of a serving config's adapters: it lists the adapters
(ids and paths, those loaded on the device and those kept on the CPU) and reads each one's
tensors and scaling, in both formats NxDI reads (a PEFT folder, or an NxD checkpoint file;
`nxdi.effects.lora_adapters.read_adapter_weights`). NxDI's methods that write adapters into a
wrapped torch model (`update_weights_for_lora`, `shard_cpu_checkpoints`, `load_streaming_ckpt`)
have no counterpart: the engine stacks the adapters into its programs' weights itself
(`nxdi.effects.lora_adapters.read_for`, `nxdi.core.programs.lora`).

Dynamic multi-LoRA (adapters swapped between host memory and the device slots, `add_adapter` /
`remove_adapter`) lives in `nxdi.shell.lora_dynamic`.

`adapter_slots` is NxDI's `convert_adapter_ids_to_indices` and its check: what a caller passes as
`adapter_ids` (adapter names, or NxDI's indices) becomes each row's device slot. Adapter index i is
the i-th id of `lora_ckpt_paths` in the order given (as NxDI numbers them), plus one with
`enable_base_model_only`, whose index 0 is the base model.
Effects: reads adapter files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.effects import lora_adapters
from nxdi.shell.config import LoraServingConfig
from nxdi.shell.exceptions import IncompatibleConfigError

__all__ = ["LoraCheckpoint", "LoraServingConfig", "adapter_slots"]

LoraScaling = tuple[float, bool]
"""`(lora_alpha, use_rslora)` from an adapter's config."""


class LoraCheckpoint:
    """The adapters of a LoraServingConfig, and their weights read from disk.

    Args:
        config: the serving config; None gives a checkpoint with no adapters.

    Attributes:
        lora_config: the config.
        ckpt_paths: adapter id -> path of the adapters loaded on the device (None: none).
        ckpt_paths_cpu: adapter id -> path of the adapters kept in host memory (None: none).
        lora_ckpts, lora_ckpts_cpu: what `load_lora_state_dicts` read for each group, once `load()`
            has run (None before).
    """

    def __init__(self, config: LoraServingConfig | None) -> None:
        self.lora_config = config
        self.ckpt_paths: dict[str, str] | None = None if config is None else config.lora_ckpt_paths
        self.ckpt_paths_cpu: dict[str, str] | None = None if config is None else config.lora_ckpt_paths_cpu
        self.lora_ckpts: dict[str, dict[str, Any]] | None = None
        self.lora_ckpts_cpu: dict[str, dict[str, Any]] | None = None

    @property
    def adapter_ids(self) -> tuple[str, ...]:
        """Every adapter id: the device adapters, then the CPU ones (each group by id, as the config keeps them)."""
        return (*(self.ckpt_paths or {}), *(self.ckpt_paths_cpu or {}))

    def adapter_path(self, adapter_id: str) -> str:
        """The checkpoint path of `adapter_id`.

        Raises:
            KeyError: no adapter has that id (the message lists the ids there are).
        """
        for paths in (self.ckpt_paths, self.ckpt_paths_cpu):
            if paths and adapter_id in paths:
                return paths[adapter_id]
        known = ", ".join(self.adapter_ids) or "none"
        raise KeyError(f"adapter id {adapter_id!r} is not in lora_config (adapters: {known})")

    @staticmethod
    def is_lora_module(name: str) -> bool:
        """Whether a module or weight name is a LoRA A or B matrix."""
        return "lora_A" in name or "lora_B" in name

    def load_adapter(self, adapter_id: str) -> dict[str, Any]:
        """One adapter as NxDI holds it: `{"lora_scaling": (lora_alpha, use_rslora) | None, "state_dict": {...}}`.

        Raises:
            KeyError: unknown id. FileNotFoundError / ValueError: see `read_adapter_weights`.
        """
        read = lora_adapters.read_adapter_weights(self.adapter_path(adapter_id))
        return {"lora_scaling": read.scaling, "state_dict": read.state_dict}

    def load_lora_state_dicts(self, ckpt_paths: Mapping[str, str] | None) -> dict[str, dict[str, Any]] | None:
        """Every adapter of `ckpt_paths` (id -> path) read as `load_adapter` reads one; None for None.

        Raises:
            FileNotFoundError: a path does not exist or is a file of an unknown suffix.
            ValueError: a folder without a checkpoint, or a file that cannot be read.
        """
        if ckpt_paths is None:
            return None
        out: dict[str, dict[str, Any]] = {}
        for key, path in ckpt_paths.items():
            read = lora_adapters.read_adapter_weights(path)
            out[key] = {"lora_scaling": read.scaling, "state_dict": read.state_dict}
        return out

    def load(self) -> None:
        """Read the device and the CPU adapters into `lora_ckpts` and `lora_ckpts_cpu` (once).

        Raises: as `load_lora_state_dicts`.
        """
        if self.lora_ckpts is None:
            self.lora_ckpts = self.load_lora_state_dicts(self.ckpt_paths)
        if self.lora_ckpts_cpu is None:
            self.lora_ckpts_cpu = self.load_lora_state_dicts(self.ckpt_paths_cpu)

    @staticmethod
    def scaling(lora_scaling: LoraScaling | None, rank: int) -> float:
        """The factor NxDI multiplies an adapter's A matrices by: `lora_alpha / rank`, or
        `lora_alpha / sqrt(rank)` with rsLoRA; 1.0 without a config or with lora_alpha 0."""
        if lora_scaling is None or not lora_scaling[0] or rank <= 0:
            return 1.0
        alpha, rslora = lora_scaling
        return alpha / (math.sqrt(rank) if rslora else rank)

    def scaled_state_dict(self, adapter_id: str) -> dict[str, Tensor]:
        """`adapter_id`'s tensors with every A matrix scaled (`scaling`, its rank being its rows);
        new tensors, the files and earlier reads untouched.

        Raises: as `load_adapter`.
        """
        adapter = self.load_adapter(adapter_id)
        scaling = adapter["lora_scaling"]
        return {
            name: t * self.scaling(scaling, t.shape[0]) if "lora_A" in name else t
            for name, t in adapter["state_dict"].items()
        }

    def __repr__(self) -> str:
        return f"LoraCheckpoint(adapters={list(self.adapter_ids)})"


def adapter_index(spec: NeuronSpec) -> dict[str, int]:
    """Adapter name -> its index (its device slot): NxDI's `lora_adapter_id_mapping`."""
    cfg = spec.lora_config
    first = 1 if cfg is not None and cfg.enable_base_model_only else 0
    return {name: first + i for i, name in enumerate(lora_adapters.adapter_ids(spec))}


def adapter_slots(spec: NeuronSpec, adapter_ids: Any, batch: int) -> Tensor | None:
    """Each row's device slot [batch] int64 for what a caller passes as `adapter_ids`: a [batch]
    tensor or list of adapter indices, or a list of adapter names; None on a model without
    lora_config (which takes no adapter_ids), and all base-model rows for None with
    enable_base_model_only.

    Raises:
        IncompatibleConfigError: adapter_ids on a model without lora_config; None without
            enable_base_model_only (no row may silently take some adapter); a length other than
            the batch; an unknown name or an index naming no loaded adapter (the known ones listed).
    """
    cfg = spec.lora_config
    if cfg is None:
        if adapter_ids is None:
            return None
        raise IncompatibleConfigError(
            "adapter_ids: given, but this model has no lora_config. Fix: build it with "
            "NeuronConfig(lora_config=LoraServingConfig(...)), or pass adapter_ids=None"
        )
    index = adapter_index(spec)
    rows = row_adapters(
        index, adapter_ids, batch, base=cfg.enable_base_model_only, fix="add the adapter to lora_config.lora_ckpt_paths"
    )
    return torch.tensor([0 if name is None else index[name] for name in rows], dtype=torch.int64)


def row_adapters(index: Mapping[str, int], adapter_ids: Any, batch: int, *, base: bool, fix: str) -> list[str | None]:
    """Each row's adapter name (None: the base model) for what a caller passes as `adapter_ids`:
    None (every row on the base model), or one adapter name or NxDI index per row; `index` maps the
    loaded adapters' names to their indices (0 is the base model's when `base`); `fix` ends the
    message for an unknown one (how to load it).

    Raises:
        IncompatibleConfigError: None without `base` (no row may silently take some adapter), a
            length other than the batch, or names / indices of no loaded adapter (the loaded ones listed).
    """
    known = ", ".join(f"{n!r} ({i})" for n, i in index.items()) or "none"
    if adapter_ids is None:
        if base:
            return [None] * batch
        raise IncompatibleConfigError(
            "adapter_ids: None, but every row needs an adapter (enable_base_model_only=False). Fix: pass one "
            f"adapter per row (adapters: {known}), or set lora_config.enable_base_model_only=True"
        )
    given = adapter_ids.reshape(-1).tolist() if isinstance(adapter_ids, Tensor) else list(adapter_ids)
    if len(given) != batch:
        raise IncompatibleConfigError(
            f"adapter_ids: has {len(given)} entries for a batch of {batch} rows. Fix: give one adapter per row"
        )
    by_index = {i: n for n, i in index.items()}
    rows: list[str | None] = []
    bad = []
    for value in given:
        if isinstance(value, str) and value in index:
            rows.append(value)
        elif isinstance(value, int) and not isinstance(value, bool) and (value in by_index or (base and value == 0)):
            rows.append(by_index.get(value))
        else:
            bad.append(value)
    if bad:
        zero = " or 0 for the base model" if base else ""
        raise IncompatibleConfigError(
            f"adapter_ids: {bad} name no loaded adapter. Fix: use an adapter name or index{zero} "
            f"(adapters: {known}), or {fix}"
        )
    return rows

"""Dynamic multi-LoRA (`LoraServingConfig(dynamic_multi_lora=True)`): adapters in host memory,
swapped into the device slots on demand. Effects: reads adapter files, writes the bound weights.

Theory of operation:
- Up to `max_cpu_loras` adapters live in host memory (`lora_ckpt_paths_cpu` and `lora_ckpt_paths`,
  read and checked when the model loads; more through `add_adapter(id, path)` at run time, gone
  with `remove_adapter(id)`), each already laid out as one slot of the stacked adapter tensors
  (`nxdi.core.programs.lora.slot_tensors`, its scaling folded in).
- The programs are compiled once for `max_loras` device slots (static shapes). Before a forward,
  the rows' adapters are placed by the eviction policy (`nxdi.core.host.lora_slots.place`: `lru`
  or `lfu` with `lfu_decay_period`); each adapter missing from the device is copied into its slot
  of the bound weight tensors in place (the cpu backend binds those very tensors; under tensor
  parallelism every rank copies its slices), then the rows' slots go to the programs as `adapter_ids`. The `lora_ckpt_paths` adapters start on the device.
- Adapter indices (what a caller may pass instead of names) are NxDI's: the ids of
  `lora_ckpt_paths`, then of `lora_ckpt_paths_cpu`, then those added, numbered in that order from 0
  (from 1 with enable_base_model_only, whose 0 is the base model); a removed adapter's index is not
  reused.
"""

from __future__ import annotations

from typing import Any

import torch
from returns.result import Failure, Success
from torch import Tensor

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import CheckpointError, Problem
from nxdi.core.host import lora_slots, weight_ops
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import lora as lora_plan
from nxdi.core.programs import lora
from nxdi.effects import lora_adapters
from nxdi.effects.runtime import StepRuntime
from nxdi.shell import lora_serving
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap


class DynamicAdapters:
    """The host adapters of a dynamic multi-LoRA model, the device slots' state, and the swaps.

    Attributes:
        state: the device slots (`lora_slots.SlotState`), managed slots only (the base slot apart).
        swaps: every (slot, adapter id) copied to the device so far, in order (for inspection).
    """

    def __init__(self, spec: NeuronSpec, model: ModelSpec) -> None:
        cfg = spec.lora_config
        assert cfg is not None and cfg.dynamic_multi_lora, "DynamicAdapters serves dynamic_multi_lora"
        self.cfg = cfg
        self.layout = lora_plan.layout_for(model, cfg).unwrap()
        dtype = weight_ops.torch_dtype(spec.torch_dtype)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        self.first = 1 if cfg.enable_base_model_only else 0
        self.host: dict[str, dict[str, Tensor]] = {}
        self.index: dict[str, int] = {}
        self._next = self.first
        self.swaps: list[tuple[int, str]] = []
        self.state = lora_slots.SlotState.empty(
            cfg.max_loras, policy=cfg.eviction_policy, decay_period=cfg.lfu_decay_period
        )

    def start(self) -> None:
        """Read every configured adapter into host memory (the device ones first), the device ones
        resident in their slots. Called when the model loads; earlier run-time additions are dropped.

        Raises:
            CheckpointValidationError: every problem of every adapter, each named; nothing is kept then.
        """
        device = self.cfg.lora_ckpt_paths.to_dict() if self.cfg.lora_ckpt_paths is not None else {}
        cpu = self.cfg.lora_ckpt_paths_cpu.to_dict() if self.cfg.lora_ckpt_paths_cpu is not None else {}
        problems: list[Problem] = []
        host: dict[str, dict[str, Tensor]] = {}
        groups = (("lora_ckpt_paths", device), ("lora_ckpt_paths_cpu", cpu))
        for field, paths in groups:
            for adapter_id, path in paths.items():
                if adapter_id in host:
                    continue  # both lists name it: one host copy
                match lora_adapters.read_one(adapter_id, path, f"lora_config.{field}[{adapter_id}]", self.layout):
                    case Success(adapter):
                        host[adapter_id] = lora.slot_tensors(self.layout, adapter, dtype=self.dtype)
                    case Failure(err):
                        problems.extend(err.problems)
        if len(host) > self.cfg.max_cpu_loras and not problems:
            why = f"names {len(host)} adapters, more than max_cpu_loras={self.cfg.max_cpu_loras}"
            problems.append(Problem.of("lora_config.lora_ckpt_paths_cpu", len(host), why, "raise max_cpu_loras"))
        unwrap(
            Failure(CheckpointError(problems=tuple(problems))) if problems else Success(None), "Invalid LoRA adapters"
        )
        self.host = host
        self.index = {name: self.first + i for i, name in enumerate(host)}
        self._next = self.first + len(host)
        empty = lora_slots.SlotState.empty(
            self.cfg.max_loras, policy=self.cfg.eviction_policy, decay_period=self.cfg.lfu_decay_period
        )
        self.state = empty.with_resident(list(device))
        self.swaps = []

    def add_adapter(self, adapter_id: str, path: str) -> None:
        """Read `path` (a PEFT folder or NxD checkpoint file), check it and keep it in host memory as `adapter_id`.

        Raises:
            IncompatibleConfigError: the id is taken, or host memory already holds max_cpu_loras adapters.
            CheckpointValidationError: every problem of the adapter (unreadable, refused settings,
                tensors that do not fit the base model or max_lora_rank); nothing is changed.
        """
        if adapter_id in self.host:
            raise IncompatibleConfigError(
                f"add_adapter: adapter id {adapter_id!r} is already loaded. Fix: remove_adapter({adapter_id!r}) first"
            )
        if len(self.host) >= self.cfg.max_cpu_loras:
            raise IncompatibleConfigError(
                f"add_adapter: host memory holds {len(self.host)} adapters, max_cpu_loras={self.cfg.max_cpu_loras}. "
                "Fix: remove_adapter() one, or raise lora_config.max_cpu_loras"
            )
        field = f"add_adapter({adapter_id!r})"
        adapter = unwrap(lora_adapters.read_one(adapter_id, str(path), field, self.layout), "Invalid LoRA adapter")
        self.host[adapter_id] = lora.slot_tensors(self.layout, adapter, dtype=self.dtype)
        self.index[adapter_id] = self._next
        self._next += 1

    def remove_adapter(self, adapter_id: str) -> None:
        """Drop `adapter_id` from host memory and free its device slot.

        Raises:
            IncompatibleConfigError: no adapter has that id (the loaded ones listed); nothing changes.
        """
        if adapter_id not in self.host:
            raise IncompatibleConfigError(
                f"remove_adapter: adapter id {adapter_id!r} is not loaded (adapters: {self._known()})"
            )
        del self.host[adapter_id], self.index[adapter_id]
        self.state = self.state.without(adapter_id)

    def _known(self) -> str:
        return ", ".join(f"{n!r} ({i})" for n, i in self.index.items()) or "none"

    def names(self, adapter_ids: Any, batch: int) -> list[str | None]:
        """Each row's adapter id (None: base model) for names or NxDI indices (`lora_serving.row_adapters`)."""
        base = self.cfg.enable_base_model_only
        return lora_serving.row_adapters(
            self.index, adapter_ids, batch, base=base, fix="add it with add_adapter(id, path)"
        )

    def indices(self, adapter_ids: Any, batch: int) -> Tensor:
        """NxDI's adapter index per row [batch] int64 (0 for base rows); raises as `names`."""
        return torch.tensor([0 if n is None else self.index[n] for n in self.names(adapter_ids, batch)])

    def slots_for(self, runtime: StepRuntime, adapter_ids: Any, batch: int) -> Tensor:
        """Place the rows' adapters on the device (swapping in what is missing, in place into the
        runtime's stacked adapters, every rank's slices) and return each row's device slot [batch] int64.

        Raises:
            IncompatibleConfigError: as `names`, or more distinct adapters than max_loras (nothing swapped).
        """
        rows = self.names(adapter_ids, batch)
        placed = unwrap(lora_slots.place(self.state, rows), "Cannot place the LoRA adapters")
        if placed.loads:
            swaps = [(slot + self.first, adapter_id) for slot, adapter_id in placed.loads]
            runtime.write_lora_slots([(slot, self.host[adapter_id]) for slot, adapter_id in swaps])
            self.swaps.extend(swaps)
        self.state = placed.state
        return torch.tensor([0 if s is None else s + self.first for s in placed.rows], dtype=torch.int64)

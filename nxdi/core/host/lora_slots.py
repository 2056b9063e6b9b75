"""Dynamic multi-LoRA: which adapter sits in which device slot, and what to evict. Pure, torch-free.

Theory of operation:
- The device holds `max_loras` adapter slots (after the base model's slot with
  enable_base_model_only, which never holds an adapter and is not managed here). `SlotState`
  records each slot's adapter id (None: free) and what the eviction policy reads: the forward
  that last used it (`last_used`, a logical clock) and its use count (`uses`, one per batch row).
- `place(state, rows)` takes one forward's adapter per row (None: a base-model row) and returns a
  `Placement`: each row's slot, the adapters to copy into which slots, the adapters evicted, and
  the next state. Adapters already resident keep their slot; a missing adapter takes a free slot
  (lowest first), else evicts the slot the policy picks among those the batch does not use:
  `lru` the least recently used, `lfu` the least used (ties: the least recent, then the lowest
  slot). A batch of more distinct adapters than slots is refused (nothing changes).
- `lfu_decay_period`: every that many forwards every use count is halved (NxDI's decay), so an
  adapter used heavily long ago does not stay resident for ever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem

Policy = Literal["lru", "lfu"]


@attrs.frozen(kw_only=True)
class SlotState:
    """The device slots' adapters and usage (one entry per slot)."""

    slots: tuple[str | None, ...]
    """Adapter id per slot; None: free."""
    last_used: tuple[int, ...]
    """Per slot: the clock of the forward that last used it (-1: never)."""
    uses: tuple[int, ...]
    """Per slot: rows that used it since it was loaded (halved every `decay_period` forwards)."""
    policy: Policy = "lru"
    decay_period: int = 128
    clock: int = 0
    """Forwards placed so far."""

    @staticmethod
    def empty(count: int, *, policy: Policy = "lru", decay_period: int = 128) -> SlotState:
        """`count` free slots."""
        return SlotState(
            slots=(None,) * count,
            last_used=(-1,) * count,
            uses=(0,) * count,
            policy=policy,
            decay_period=decay_period,
        )

    def with_resident(self, ids: Sequence[str]) -> SlotState:
        """This state with `ids` in slots 0.. (what `load()` put there), unused so far."""
        slots = list(self.slots)
        slots[: len(ids)] = ids
        return attrs.evolve(self, slots=tuple(slots))

    def slot_of(self, adapter_id: str) -> int | None:
        """The slot holding `adapter_id`, or None."""
        return self.slots.index(adapter_id) if adapter_id in self.slots else None

    def without(self, adapter_id: str) -> SlotState:
        """This state with `adapter_id` gone from its slot (removed from the host too)."""
        slot = self.slot_of(adapter_id)
        if slot is None:
            return self
        return attrs.evolve(
            self,
            slots=_put(self.slots, slot, None),
            last_used=_put(self.last_used, slot, -1),
            uses=_put(self.uses, slot, 0),
        )


@attrs.frozen(kw_only=True)
class Placement:
    """What one forward needs: each row's slot, the copies to make, and the state after it."""

    rows: tuple[int | None, ...]
    """Per batch row: its adapter's slot (None: a base-model row)."""
    loads: tuple[tuple[int, str], ...]
    """(slot, adapter id) to copy into the device slot before the forward runs."""
    evicted: tuple[str, ...]
    """Adapters that left the device, in eviction order."""
    state: SlotState


def _put(values: tuple, index: int, value: object) -> tuple:
    return (*values[:index], value, *values[index + 1 :])


def _victim(state: SlotState, busy: set[int]) -> int:
    """The slot to evict: free ones first (lowest), else the policy's pick among slots not in `busy`."""
    free = [s for s, held in enumerate(state.slots) if held is None and s not in busy]
    if free:
        return free[0]
    candidates = [s for s in range(len(state.slots)) if s not in busy]
    if state.policy == "lfu":
        return min(candidates, key=lambda s: (state.uses[s], state.last_used[s], s))
    return min(candidates, key=lambda s: (state.last_used[s], s))


def place(state: SlotState, rows: Sequence[str | None]) -> Result[Placement, ConfigError]:
    """Place one forward's adapters (`rows`: each row's adapter id, None for the base model).

    Returns:
        The placement, or a ConfigError when the batch names more distinct adapters than there are
        slots (the state is then unchanged: nothing is evicted or loaded).
    """
    wanted = list(dict.fromkeys(a for a in rows if a is not None))
    if len(wanted) > len(state.slots):
        why = f"names {len(wanted)} distinct adapters ({', '.join(wanted)}), but the device holds {len(state.slots)}"
        fix = "split the batch, or raise lora_config.max_loras"
        return Failure(ConfigError(problems=(Problem.of("adapter_ids", list(rows), why, fix),)))
    busy = {s for a in wanted if (s := state.slot_of(a)) is not None}
    loads: list[tuple[int, str]] = []
    evicted: list[str] = []
    for adapter in wanted:
        if state.slot_of(adapter) is not None:
            continue
        slot = _victim(state, busy)
        gone = state.slots[slot]
        if gone is not None:
            evicted.append(gone)
        state = attrs.evolve(
            state,
            slots=_put(state.slots, slot, adapter),
            last_used=_put(state.last_used, slot, -1),
            uses=_put(state.uses, slot, 0),
        )
        busy.add(slot)
        loads.append((slot, adapter))
    last, uses = list(state.last_used), list(state.uses)
    placed: list[int | None] = []
    for row in rows:
        at = None if row is None else state.slot_of(row)
        placed.append(at)
        if at is not None:
            last[at], uses[at] = state.clock, uses[at] + 1
    clock = state.clock + 1
    if state.policy == "lfu" and clock % state.decay_period == 0:
        uses = [u // 2 for u in uses]
    state = attrs.evolve(state, last_used=tuple(last), uses=tuple(uses), clock=clock)
    return Success(Placement(rows=tuple(placed), loads=tuple(loads), evicted=tuple(evicted), state=state))

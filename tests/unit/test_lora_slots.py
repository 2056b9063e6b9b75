"""The dynamic multi-LoRA eviction policy (`nxdi.core.host.lora_slots`): properties and hand-made orders."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from nxdi.core.host.lora_slots import Placement, SlotState, place

ADAPTERS = ("a", "b", "c", "d", "e", "f")


def _place(state: SlotState, rows: Sequence[str | None]) -> Placement:
    placed = place(state, rows)
    assert isinstance(placed, Success), placed
    return placed.unwrap()


def _run(state: SlotState, batches: Sequence[Sequence[str | None]]) -> tuple[SlotState, list[str]]:
    evicted: list[str] = []
    for rows in batches:
        p = _place(state, rows)
        evicted.extend(p.evicted)
        state = p.state
    return state, evicted


batches = st.lists(
    st.lists(st.one_of(st.none(), st.sampled_from(ADAPTERS)), min_size=1, max_size=4), min_size=1, max_size=30
)


@settings(max_examples=200, deadline=None)
@given(
    batches=batches,
    slots=st.integers(4, 5),
    policy=st.sampled_from(("lru", "lfu")),
    period=st.integers(1, 5),
)
def test_every_row_finds_its_adapter_and_nothing_the_batch_uses_is_evicted(
    batches: list[list[str | None]], slots: int, policy: str, period: int
) -> None:
    state = SlotState.empty(slots, policy=policy, decay_period=period)  # type: ignore[arg-type]
    for rows in batches:
        before = set(state.slots)
        p = _place(state, rows)
        used = {a for a in rows if a is not None}
        assert not used & set(p.evicted)
        for adapter, slot in zip(rows, p.rows, strict=True):
            assert (slot is None) == (adapter is None)
            if adapter is not None:
                assert slot is not None and p.state.slots[slot] == adapter
        # only missing adapters are loaded, each once, into distinct slots
        assert sorted(a for _, a in p.loads) == sorted(used - before)
        assert len({s for s, _ in p.loads}) == len(p.loads)
        held = [a for a in p.state.slots if a is not None]
        assert len(held) == len(set(held))
        state = p.state


@given(batches=batches, policy=st.sampled_from(("lru", "lfu")))
def test_a_batch_over_the_slot_count_is_refused_and_changes_nothing(
    batches: list[list[str | None]], policy: str
) -> None:
    state, _ = _run(SlotState.empty(4, policy=policy), batches)  # type: ignore[arg-type]
    placed = place(state, ["a", "b", "c", "d", "e"])
    assert isinstance(placed, Failure)
    assert "adapter_ids" in str(placed.failure()) and "raise lora_config.max_loras" in str(placed.failure())


def test_lru_evicts_the_least_recently_used() -> None:
    state = SlotState.empty(3, policy="lru")
    state, evicted = _run(state, [["a"], ["b"], ["c"], ["a"], ["d"]])  # b is the oldest use
    assert evicted == ["b"] and state.slots == ("a", "d", "c")
    state, evicted = _run(state, [["e", "a"]])  # c, then (not a: in the batch) d
    assert evicted == ["c"] and state.slots == ("a", "d", "e")


def test_lfu_evicts_the_least_used_ties_by_recency() -> None:
    state = SlotState.empty(3, policy="lfu", decay_period=1000)
    state, evicted = _run(state, [["a", "a"], ["b"], ["b"], ["c"], ["a"], ["d"]])  # uses a3 b2 c1
    assert evicted == ["c"]
    state, evicted = _run(state, [["e"]])  # d (1 use) goes, though b was used earlier
    assert evicted == ["d"]
    state, evicted = _run(state, [["e"], ["f"]])  # e 2 uses, b 2 uses older: b goes
    assert evicted == ["b"]


def test_lfu_decay_halves_the_counts_every_period() -> None:
    state = SlotState.empty(2, policy="lfu", decay_period=4)
    state, _ = _run(state, [["a", "a", "a"], ["b"], ["b"]])
    assert state.uses == (3, 2)
    state, _ = _run(state, [["b"]])  # the 4th forward: 3, 3 -> 1, 1
    assert state.uses == (1, 1)
    # without decay `a` (3 early uses) would stay; with it the older `a` ties and goes
    state, evicted = _run(state, [["c"]])
    assert evicted == ["a"]


def test_resident_adapters_and_removal() -> None:
    state = SlotState.empty(3).with_resident(["x", "y"])
    p = _place(state, ["y", None, "x"])
    assert p.rows == (1, None, 0) and p.loads == () and p.evicted == ()
    freed = p.state.without("x")
    p = _place(freed, ["z", "w"])  # the free slots first: 0 (freed), then 2
    assert p.loads == ((0, "z"), (2, "w")) and p.evicted == ()

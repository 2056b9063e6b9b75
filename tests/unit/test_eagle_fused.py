"""The hidden-state cache of EAGLE fused speculation (`nxdi.core.programs.eagle_fused`): h at every
position, split across one cache layer's key and value, read back whole per row."""

from __future__ import annotations

import pytest
import torch

from nxdi.core.programs import eagle_fused
from nxdi.core.programs.kv_cache import KVCache


@pytest.mark.parametrize("width", [1, 5, 8])
def test_hidden_states_written_at_their_slots_read_back_whole(width: int) -> None:
    """Each row's states land at its own slots (others untouched) and read back per row, any width."""
    cache = eagle_fused.hidden_cache(batch=2, length=6, width=width, dtype=torch.float32)
    assert cache.k[0].shape == (2, 1, 6, width // 2) and cache.v[0].shape == (2, 1, 6, width - width // 2)
    hidden = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]])
    written = eagle_fused.write_hidden(cache, hidden, slots)
    assert torch.equal(
        eagle_fused.read_hidden(written, torch.tensor([2, 3])), torch.stack([hidden[0, 2], hidden[1, 0]])
    )
    assert torch.equal(eagle_fused.read_hidden(written, torch.tensor([3, 0])), torch.zeros(2, width))
    assert torch.equal(cache.k[0], torch.zeros_like(cache.k[0])), "written out of place"


def test_split_is_the_inverse_of_join() -> None:
    def layers(n: int, fill: float) -> KVCache:
        return KVCache(
            k=tuple(torch.full((1, 1, 4, 2), fill + i) for i in range(n)),
            v=tuple(torch.zeros(1, 1, 4, 2) for _ in range(n)),
        )

    target, draft = layers(2, 0.0), layers(1, 10.0)
    hidden = eagle_fused.hidden_cache(batch=1, length=4, width=3, dtype=torch.float32)
    t, d, h = eagle_fused.split(eagle_fused.join(target, draft, hidden), 2)
    assert (t.k, d.k, h.k, h.v) == (target.k, draft.k, hidden.k, hidden.v)

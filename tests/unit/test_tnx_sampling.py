"""transformers-neuronx host sampling (`nxdi.shell.tnx.loop`): the candidates top-k and top-p keep."""

from __future__ import annotations

import torch

from nxdi.shell.tnx import loop


def test_top_k_keeps_the_k_best_in_order_and_zero_keeps_all() -> None:
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    values, ids = loop.filter_top_k_top_p(scores, top_k=2, top_p=1.0)
    assert ids.tolist() == [[1, 3]] and values.tolist() == [[3.0, 2.0]]
    assert loop.filter_top_k_top_p(scores, top_k=0, top_p=1.0)[1].shape == (1, 4)
    assert loop.filter_top_k_top_p(scores, top_k=9, top_p=1.0)[1].shape == (1, 4)


def test_top_p_keeps_the_smallest_prefix_reaching_p_and_at_least_one() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    values, _ = loop.filter_top_k_top_p(probs.log(), top_k=0, top_p=0.75)
    assert torch.isfinite(values).tolist() == [[True, True, False, False]]  # 0.5 < 0.75 <= 0.8
    values, _ = loop.filter_top_k_top_p(probs.log(), top_k=0, top_p=0.01)
    assert torch.isfinite(values).tolist() == [[True, False, False, False]]

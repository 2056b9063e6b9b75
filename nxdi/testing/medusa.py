"""Medusa heads for tests: a torch reference module, its `medusa_heads.pt` file, and brief training.

`MedusaHeads(hidden, vocab, num_heads)` holds `medusa_head_{i} = nn.Sequential(ResBlock(hidden),
Linear(hidden, vocab, bias=False))`, so its state dict has exactly the keys NxDI's
`medusa_heads.pt` holds (`medusa_head_{i}.0.linear.weight`, `.0.linear.bias`, `.1.weight`), and its
forward is the reference the engine's heads are checked against. `save_medusa_heads` writes that
file; `train_medusa_heads` fits the heads to a frozen target on the progression data of
`nxdi.testing.training`, where the next tokens are predictable, so a tree's paths are mostly
accepted. `DEFAULT_TREE` is a small tree for tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from torch import Tensor, nn

from nxdi.testing.training import progression_batch

HEADS_FILE = "medusa_heads.pt"

DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (0, 1),
    (1, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (0, 0, 0, 0),
)
"""10 paths (11 nodes with the root), 4 deep, top-3 at depth 1: a small tree for tests
(medusa_speculation_length >= 11, num_medusa_heads >= 4)."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b) (NxDI's Medusa ResBlock)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads over a target's final normed hidden states of width `hidden`."""

    def __init__(self, hidden: int, vocab: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        for i in range(num_heads):
            setattr(self, f"medusa_head_{i}", nn.Sequential(ResBlock(hidden), nn.Linear(hidden, vocab, bias=False)))

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H, V] every head's logits at hidden states [..., E]."""
        return torch.stack([getattr(self, f"medusa_head_{i}")(hidden) for i in range(self.num_heads)], dim=-2)


def random_medusa_heads(
    config: transformers.PretrainedConfig, num_heads: int, *, seed: int = 0, scale: float = 0.5
) -> MedusaHeads:
    """Heads for `config`'s model with every weight drawn from a seeded normal (the ResBlock too,
    so the engine's residual path is exercised): proposals unrelated to the target's."""
    heads = MedusaHeads(config.hidden_size, config.vocab_size, num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * scale / p.shape[-1] ** 0.5)
    return heads


def save_medusa_heads(heads: MedusaHeads, path: str | os.PathLike[str]) -> Path:
    """Write `heads` as NxDI's `medusa_heads.pt` (name -> tensor, loadable with weights_only=True):
    into the model directory `path`, or to `path` itself when it names a `.pt` file."""
    target = Path(path)
    if target.suffix != ".pt":
        target = target / HEADS_FILE
    torch.save({k: v.detach().clone().contiguous() for k, v in heads.state_dict().items()}, target)
    return target


def final_hidden(target: transformers.PreTrainedModel, ids: Tensor) -> Tensor:
    """The target's final normed hidden states [B, S, E] (what its lm_head and the heads read)."""
    return target(ids, output_hidden_states=True).hidden_states[-1]


def train_medusa_heads(
    target: transformers.PreTrainedModel,
    *,
    num_heads: int,
    steps: int = 200,
    seed: int = 0,
    lr: float = 3e-3,
    length: int = 48,
    batch: int = 32,
) -> tuple[MedusaHeads, float]:
    """Heads trained on the frozen `target` for `steps` AdamW steps, each on `batch` fresh sequences of
    `length` tokens: head i at position t learns the token at t + 2 + i of progression sequences
    (`progression_batch`). Returns the heads and the last loss (mean over the heads). The target is
    left unchanged (its parameters stay frozen). Most of a step's time is the target's forward
    pass over the batch, so a larger target trains its heads faster at a smaller `batch`."""
    generator = torch.Generator().manual_seed(seed)
    config = target.config
    heads = random_medusa_heads(config, num_heads, seed=seed)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr)
    vocab = config.vocab_size
    target.eval()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        seq = progression_batch(vocab, batch=batch, length=length, generator=generator)
        with torch.no_grad():
            hidden = final_hidden(target, seq)  # [B, S, E]
        logits = heads(hidden)  # [B, S, H, V]
        losses = []
        for i in range(num_heads):
            ahead = i + 2
            pred = logits[:, : length - ahead, i].reshape(-1, vocab)
            losses.append(nn.functional.cross_entropy(pred, seq[:, ahead:].reshape(-1)))
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    heads.eval()
    return heads, float(loss.detach())

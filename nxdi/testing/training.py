"""Briefly trained tiny checkpoints: a stand-in for real weights in low-precision accuracy tests.

A randomly initialised model has nearly flat logits, so bf16 rounding flips its argmax between
near-equal tokens and its max-scaled logit error sits at the edge of the reference tolerances,
for transformers' own bf16 run as much as for nxdi's. Real checkpoints are confident. A few
seconds of training on a learnable synthetic task (arithmetic progressions modulo the vocabulary)
gives a tiny model the same property, so a bf16 accuracy check measures the engine, not the
noise of random weights. The training uses its own seeded generator.
"""

from __future__ import annotations

import torch
import transformers


def progression_batch(vocab: int, *, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] sequences `(start + stride * i) % vocab` with random start and stride 1..6."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 7, (batch, 1), generator=generator)
    return (start + stride * torch.arange(length)[None, :]) % vocab


def train_briefly(
    model: transformers.PreTrainedModel, *, steps: int = 150, seed: int = 0, lr: float = 3e-3, length: int = 33
) -> float:
    """Train `model` in place on progressions of `length` tokens for `steps` AdamW steps; returns the last loss.

    With the tiny test configurations the loss drops from ~5 to ~0.2 in 150 steps (2-3 s on 2 cores).
    Past `length` positions the model extrapolates and its top logits come close to ties, so a test
    that generates further should train on sequences as long as it generates (80: ~7 s).
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        seq = progression_batch(vocab, batch=32, length=length, generator=generator)
        logits = model(seq[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())

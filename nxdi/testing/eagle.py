"""A reference EAGLE (v1) draft in transformers' Llama pieces, its checkpoint writer and a quick trainer.
Effects: writes checkpoint folders; trains with its own seeded generator.

`EagleDraftModel` computes what NxDI's `is_eagle_draft` Llama computes (see
`nxdi.core.programs.eagle` for the pairing): `fc([embed(t_{q+1}); h_q])`, transformers'
`LlamaDecoderLayer`s (their input norm replaced by the identity unless `input_norm`), no final
norm, and the target's lm_head. It recomputes every pair from scratch (no cache), so the engine's
cached, step-by-step program is checked against a plain full forward.

`save_eagle_draft` writes the layout the EAGLE project ships (`embed_tokens.weight`, `fc.weight`,
`layers.0.*`, no `model.` prefix unless asked) plus the target's `lm_head.weight`, which NxDI
requires. `train_eagle_draft` fits a draft to a frozen target on the progressions of
`nxdi.testing.training` in a few seconds and reports how often its greedy proposal (fed the
target's hidden state) equals the target's greedy token.
"""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import torch
import transformers
from torch import Tensor, nn
from transformers.models.llama import modeling_llama

from nxdi.effects import checkpoint
from nxdi.testing.training import progression_batch


class EagleDraftModel(nn.Module):
    """A Llama EAGLE (v1) draft: embed_tokens, fc [E, 2E], `num_hidden_layers` decoder layers, lm_head."""

    def __init__(self, config: transformers.LlamaConfig, *, input_norm: bool = False, fc_bias: bool = False) -> None:
        super().__init__()
        e = config.hidden_size
        self.config = config
        self.input_norm = input_norm
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        self.fc = nn.Linear(2 * e, e, bias=fc_bias)
        self.layers = nn.ModuleList(
            modeling_llama.LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        if not input_norm:  # NxDI drops every layer's input norm (the EAGLE project only the first's)
            for layer in self.layers:
                layer.input_layernorm = nn.Identity()
        self.rotary_emb = modeling_llama.LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(e, config.vocab_size, bias=False)

    def forward(
        self, input_ids: Tensor, prev_hidden: Tensor, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logits [B, S, V] and the draft's own hidden states [B, S, E] of pairs (input_ids [B, S],
        prev_hidden [B, S, E]) at positions [B, S] (default 0..S-1); each sees the pairs at positions <= its own."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s)[None].expand(b, s)
        h = self.fc(torch.cat((self.embed_tokens(input_ids), prev_hidden.to(self.fc.weight.dtype)), dim=-1))
        rope = self.rotary_emb(h, position_ids)
        seen = position_ids[:, None, None, :] <= position_ids[:, None, :, None]  # [B, 1, S(query), S(key)]
        mask = torch.zeros(seen.shape, dtype=h.dtype).masked_fill(~seen, torch.finfo(h.dtype).min)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        return self.lm_head(h), h


def draft_config(
    target: transformers.PretrainedConfig, *, layers: int = 1, fc_bias: bool = False
) -> transformers.LlamaConfig:
    """The target's config with the draft's `num_hidden_layers` and `fc_bias` (what an EAGLE draft's config.json holds).

    Raises:
        TypeError: the target is not a Llama (the reference draft is built from Llama layers).
    """
    if not isinstance(target, transformers.LlamaConfig):
        raise TypeError(f"the reference EAGLE draft is a Llama; the target's config is a {type(target).__name__}")
    config = copy.deepcopy(target)
    config.num_hidden_layers = layers
    config.fc_bias = fc_bias
    return config


def from_target(
    target: transformers.PreTrainedModel,
    *,
    layers: int = 1,
    input_norm: bool = False,
    fc_bias: bool = False,
    seed: int = 0,
) -> EagleDraftModel:
    """A draft for `target`: random layers and fc (from `seed`), the target's embedding and lm_head
    copied and frozen (EAGLE trains neither)."""
    config = draft_config(target.config, layers=layers, fc_bias=fc_bias)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = EagleDraftModel(config, input_norm=input_norm, fc_bias=fc_bias)
        if fc_bias:  # nn.Linear's default bias is small; a larger one makes a dropped bias visible
            nn.init.normal_(draft.fc.bias, std=0.5)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert isinstance(embed, Tensor) and isinstance(head, Tensor), "a causal LM has embedding and lm_head weights"
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.lm_head.weight.copy_(head)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft.eval()


def save_eagle_draft(
    module: EagleDraftModel, target_lm_head: Tensor | None, path: str | Path, *, model_prefix: bool = False
) -> Path:
    """Write `module` as an EAGLE draft folder: config.json (with `fc_bias`) and model.safetensors.

    Args:
        module: the draft (its own lm_head is not written: `target_lm_head` is).
        target_lm_head: [V, E] the target's lm_head weight, saved as `lm_head.weight`; None leaves it
            out, as the EAGLE project's checkpoints do (NxDI then refuses the checkpoint).
        path: the folder (created).
        model_prefix: put `model.` before every key but lm_head's (a Hugging Face Llama's layout).
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "model." if model_prefix else ""
    tensors = {
        prefix + k: v.detach().contiguous() for k, v in module.state_dict().items() if not k.startswith("lm_head.")
    }
    tensors = {k: v for k, v in tensors.items() if "rotary_emb" not in k}
    if target_lm_head is not None:
        tensors["lm_head.weight"] = target_lm_head.detach().contiguous()
    config = copy.deepcopy(module.config)
    config.fc_bias = module.fc.bias is not None
    config.save_pretrained(folder)
    checkpoint.write_safetensors(folder / "model.safetensors", tensors)
    return folder


@attrs.frozen(kw_only=True)
class EagleTraining:
    """A trained draft and how well it does."""

    draft: EagleDraftModel = attrs.field(eq=False)
    loss: float
    """The last training step's loss."""
    agreement: float
    """Held-out fraction of positions where the draft's greedy proposal, fed the target's hidden
    state, equals the target's greedy next token."""


def _target_states(target: transformers.PreTrainedModel, seq: Tensor) -> tuple[Tensor, Tensor]:
    """The target's final hidden states h [B, L, E] (after its final norm) and logits [B, L, V]."""
    with torch.no_grad():
        out = target(seq, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def agreement(draft: EagleDraftModel, target: transformers.PreTrainedModel, seq: Tensor) -> float:
    """Fraction of pairs (t_{q+1}, h_q) of `seq` [B, L] whose draft argmax equals the target's argmax at q+1."""
    h, logits = _target_states(target, seq)
    with torch.no_grad():
        proposed, _ = draft(seq[:, 1:], h[:, :-1])
    return float((proposed.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean())


def train_eagle_draft(
    target: transformers.PreTrainedModel,
    *,
    layers: int = 1,
    input_norm: bool = False,
    fc_bias: bool = False,
    steps: int = 200,
    seed: int = 0,
    lr: float = 3e-3,
    length: int = 33,
    batch: int = 32,
) -> EagleTraining:
    """Train an EAGLE draft of `target` (frozen) on progressions, as EAGLE trains: the draft's hidden
    state regressed on the target's next one (smooth L1) plus cross-entropy of its logits against
    the target's distribution there. With the tiny test configurations and a target trained by
    `train_briefly`, 200 steps take a few seconds on 2 cores. Each step draws `batch` fresh sequences
    of `length` tokens; most of its time is the target's forward pass over them, so a larger target
    trains its draft faster at a smaller `batch`."""
    target.eval()
    draft = from_target(target, layers=layers, input_norm=input_norm, fc_bias=fc_bias, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    vocab = target.config.vocab_size
    draft.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        seq = progression_batch(vocab, batch=batch, length=length, generator=generator)
        h, logits = _target_states(target, seq)
        proposed, own = draft(seq[:, 1:], h[:, :-1])  # pair (t_{q+1}, h_q) predicts h_{q+1} and t_{q+2}
        regression = nn.functional.smooth_l1_loss(own, h[:, 1:])
        distill = nn.functional.cross_entropy(proposed.reshape(-1, vocab), logits[:, 1:].softmax(-1).reshape(-1, vocab))
        loss = regression + 0.1 * distill
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()
    held_out = progression_batch(vocab, batch=64, length=length, generator=torch.Generator().manual_seed(seed + 1))
    return EagleTraining(draft=draft, loss=float(loss.detach()), agreement=agreement(draft, target, held_out))

"""What one decoder step reads besides weights and cache: token ids, positions, the output row. Pure.

Rules:
- Prompts are right padded. Token s of row b has position `position_ids[b, s]`; `last_index[b]` is
  the index (in 0..S-1) of the row's last real token, whose logits a step returns. A 1-token prompt
  has `last_index = 0` (the reference's argmax over positions padded with 1 picks a pad slot).
- Real tokens write their keys/values at slot = position. Padded tokens (s > last_index) write at
  the slots that follow the last real one, so their position ids never matter and never collide
  with real tokens; the caller keeps those slots inside the cache view (S <= T for a prompt starting
  at 0). Padded slots are overwritten by later tokens before any query can see them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class StepInputs:
    """Inputs of one context-encoding or token-generation step."""

    input_ids: Tensor
    """[B, S] int64 token ids, right padded."""
    position_ids: Tensor
    """[B, S] int64 positions of the tokens (only the real tokens' values are used)."""
    last_index: Tensor
    """[B] int64 index of each row's last real token within the S tokens."""
    adapter_ids: Tensor | None = None
    """[B] int64 device LoRA slot of each row (`nxdi.core.programs.lora`); None: a model without
    `lora_config`, whose programs take no such input."""

    def to_tensors(self) -> tuple[Tensor, ...]:
        fixed = (self.input_ids, self.position_ids, self.last_index)
        return fixed if self.adapter_ids is None else (*fixed, self.adapter_ids)

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor]) -> StepInputs:
        """The inverse of `to_tensors`: three tensors, or four with the rows' LoRA slots."""
        input_ids, position_ids, last_index, *slots = tensors
        return cls(
            input_ids=input_ids,
            position_ids=position_ids,
            last_index=last_index,
            adapter_ids=slots[0] if slots else None,
        )


def write_slots(x: StepInputs) -> Tensor:
    """[B, S] cache slot of every token: its position if real, else the slots after the last real one."""
    s = x.input_ids.shape[1]
    idx = torch.arange(s, device=x.input_ids.device)[None, :]  # [1, S]
    last = x.last_index[:, None]  # [B, 1]
    last_pos = x.position_ids.gather(1, last)  # [B, 1]
    return torch.where(idx <= last, x.position_ids, last_pos + (idx - last))


def prompt_inputs(prompts: Sequence[Sequence[int]], *, length: int, pad_id: int = 0) -> StepInputs:
    """Right-padded context-encoding inputs for prompts starting at position 0.

    Args:
        prompts: B token-id lists, each 1..length long.
        length: S, the context bucket.
        pad_id: id written into padded slots.

    Raises:
        ValueError: a prompt is empty or longer than `length` (the caller picks the bucket).
    """
    bad = [i for i, p in enumerate(prompts) if not 0 < len(p) <= length]
    if bad:
        raise ValueError(f"prompts {bad} are empty or longer than the bucket length {length}")
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
    positions = torch.arange(length, dtype=torch.int64)[None, :].expand(len(prompts), length).contiguous()
    last = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64)
    return StepInputs(input_ids=ids, position_ids=positions, last_index=last)


def token_inputs(tokens: Tensor, positions: Tensor) -> StepInputs:
    """Token-generation inputs: one new token per row, tokens [B] at positions [B]."""
    b = tokens.shape[0]
    return StepInputs(
        input_ids=tokens.reshape(b, 1).to(torch.int64),
        position_ids=positions.reshape(b, 1).to(torch.int64),
        last_index=torch.zeros(b, dtype=torch.int64, device=tokens.device),
    )

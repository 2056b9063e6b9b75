"""Host-side preparation of step inputs: compact padded prompts, pad to a bucket, pick batch rows. Pure.

Callers may pad prompts on either side (or anywhere: only `attention_mask` says which columns are
real). The programs want right padding with the last real token's index known, so prompts are
first compacted: each row's real tokens move to the front, in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nxdi.core.programs.inputs import StepInputs


def compact(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's real tokens to the front: ids [B, W] -> ids [B, W] (tail = 0), lengths [B]."""
    real = attention_mask.to(torch.bool)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real columns first, in order
    ids = input_ids.gather(1, order)
    lengths = real.sum(dim=1)
    keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return torch.where(keep, ids, torch.zeros_like(ids)), lengths


def context_inputs(ids: Tensor, lengths: Tensor, *, bucket: int, pad_token_id: int = 0) -> StepInputs:
    """Right-padded (or truncated) context-encoding inputs [B, bucket] from compacted ids [B, W].

    Rows longer than `bucket` keep their first `bucket` tokens (truncation was allowed upstream).
    """
    b, w = ids.shape
    lengths = lengths.clamp(max=bucket)
    ids = torch.nn.functional.pad(ids, (0, bucket - w)) if w < bucket else ids[:, :bucket]
    cols = torch.arange(bucket)[None, :]
    ids = torch.where(cols < lengths[:, None], ids, torch.full_like(ids, pad_token_id)).to(torch.int64)
    positions = cols.expand(b, bucket).contiguous().to(torch.int64)
    return StepInputs(input_ids=ids, position_ids=positions, last_index=(lengths - 1).to(torch.int64))


def select_rows(x: StepInputs, rows: Tensor) -> StepInputs:
    """The inputs of batch rows `rows` [B'] (rows may repeat: padding rows copy a real one)."""
    return StepInputs(
        input_ids=x.input_ids.index_select(0, rows),
        position_ids=x.position_ids.index_select(0, rows),
        last_index=x.last_index.index_select(0, rows),
    )

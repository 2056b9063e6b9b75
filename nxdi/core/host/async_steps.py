"""async_mode: the decode call a serving loop makes next, predicted from this one. Pure.

Under `async_mode` forward() launches the step a decode loop will most likely ask for next before
the caller has read this step's tokens: the same rows (same seq_ids, block tables and sampling
params), one position further, fed the tokens this step sampled. The launched step's result is
used only when the next call's arguments equal the predicted ones value for value (`same_call`), so
a step is never answered with a result computed from other inputs. Anything else a loop does (pad a
finished row, admit a prompt, drop a row, change sampling params, start a new block) gets a
synchronous step, with the same tokens as without async_mode. (The reference feeds the device's
tokens forward whatever the caller passes next.)

A call is predicted only from a decode (every position > 0) that passes `position_ids`, one token
per request: `input_ids` [B, 1], or with chunked prefill [1, R] where every request decodes one
token (`full_context_lens - computed_context_lens == 1`). With the block layout the next token goes
to the slot after this one, so a decode whose next token starts a new block is not predicted: the
block past a row's last token belongs to whoever the client gave it to, and a speculative write
there could clobber another sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nxdi.core.host.forward_inputs import as_integers

Call = Mapping[str, Any]
"""forward()'s named arguments: `input_ids`, `position_ids`, `attention_mask`, `seq_ids`,
`sampling_params` and the block arguments, each a tensor (or tensor-like) or None."""

_LENS = ("full_context_lens", "computed_context_lens")


def next_decode(
    call: Call, tokens: Tensor | None, *, max_length: int, block_size: int | None, chunked: bool = False
) -> dict[str, Any] | None:
    """The call a decode loop makes after `call` returned `tokens`, or None when none is predicted.

    Args:
        call: this call's arguments (see `Call`).
        tokens: [R] the tokens it sampled, one per request (None without on-device sampling).
        max_length: positions 0..max_length-1 exist; a step past them is not predicted.
        block_size: pa_block_size with the block layout (None: contiguous cache).
        chunked: the call is chunked-prefill shaped (one row of requests).

    Returns:
        `call` with input_ids = tokens (in input_ids' shape and dtype), position_ids + 1, one more
        mask column, slot_mapping + 1 and the context lens + 1 (where given); everything else as is
        (every tensor a copy).
    """
    ids, pos = _long(call.get("input_ids")), _long(call.get("position_ids"))
    if tokens is None or ids is None or pos is None or ids.dim() != 2 or ids.numel() == 0:
        return None
    if pos.numel() != ids.numel() or int(pos.min()) <= 0 or int(pos.max()) + 1 >= max_length:
        return None
    if tokens.numel() != ids.numel():
        return None
    if chunked:
        full, computed = _long(call.get("full_context_lens")), _long(call.get("computed_context_lens"))
        if full is None or computed is None or full.shape != computed.shape or full.numel() != ids.numel():
            return None
        if not bool((full - computed == 1).all()):
            return None
    elif ids.shape[1] != 1:
        return None
    given_ids = call["input_ids"]
    # Copies: the step runs on another thread while the caller may reuse its buffers or edit the
    # tokens it was given, and the prediction must stay what the step ran on.
    out = {name: value.clone() if isinstance(value, Tensor) else value for name, value in call.items()}
    ids_dtype = given_ids.dtype if isinstance(given_ids, Tensor) else torch.int64
    out["input_ids"] = tokens.reshape(ids.shape).to(ids_dtype, copy=True)
    out["position_ids"] = _as_tensor(call["position_ids"]) + 1
    mask = call.get("attention_mask")
    if mask is not None:
        mask = _as_tensor(mask)
        out["attention_mask"] = torch.cat((mask, torch.ones_like(mask[..., :1])), dim=-1)
    for name in _LENS:
        if call.get(name) is not None:
            out[name] = _as_tensor(call[name]) + 1
    slots = _long(call.get("slot_mapping"))
    if slots is not None:
        if block_size is None:
            return None
        real = slots >= 0
        if bool(((slots + 1) % block_size == 0)[real].any()):
            return None  # the next token starts a new block (see the module docstring)
        out["slot_mapping"] = torch.where(real, slots + 1, slots).to(_as_tensor(call["slot_mapping"]).dtype)
    return out


def same_call(a: Call, b: Call) -> bool:
    """Whether two calls pass the same arguments, value for value (None only equals None)."""
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            if x is not y:
                return False
            continue
        tx, ty = _as_tensor(x), _as_tensor(y)
        if tx.shape != ty.shape or tx.dtype.is_floating_point != ty.dtype.is_floating_point:
            return False
        if not torch.equal(tx, ty.to(tx.dtype)):
            return False
    return True


def _as_tensor(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else torch.as_tensor(value)


def _long(value: Any) -> Tensor | None:
    """`value` as int64 (None when absent or not integers: such a call is never predicted)."""
    return None if value is None else as_integers("", value)[0]

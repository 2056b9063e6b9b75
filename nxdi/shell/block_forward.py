"""forward() with the block KV layout: a serving client's block tables and slots drive every call.

`NeuronBaseForCausalLM.forward` hands a block-KV model's calls here. Each call is checked and laid
out on the host (`nxdi.core.host.block_inputs`), its program picked by the block plan
(`nxdi.core.planning.block_programs`), and run on the whole block cache:

- rows (continuous batching, prefix caching): a call whose smallest position is 0 encodes prompts
  (context encoding: the tokens after each row's cached prefix); any other call decodes. Batches
  larger than the compiled batch run in chunks; smaller ones are padded with rows that write
  nowhere. Outputs: `logits` [B, 1, V], `tokens` [B].
- chunked prefill: every call is one row of requests' chunks (and decode tokens); outputs are per
  request: `logits` [1, R, V], `tokens` [R].

A mixture of experts' routing outputs (`moe_settings.routing_outputs`) are per token of the
caller's `input_ids` [B, W], as without blocks: [L, B, W, ...], each token in its column, the
columns no token of the call was computed for (padding, a row's cached prefix before
`computed_context_lens`) filled with `moe_settings.FILL`. In chunked prefill B = 1 and every one of
the T columns is a request's token.
"""

from __future__ import annotations

from typing import Any

import torch
from returns.result import Failure
from torch import Tensor

from nxdi.core.config.neuron_spec import Phase
from nxdi.core.errors import ConfigError
from nxdi.core.host import block_inputs, forward_inputs
from nxdi.core.host.block_inputs import BlockLimits, Segments
from nxdi.core.planning.block_programs import BlockPlan
from nxdi.core.programs import moe_settings
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap

_REQUIRED = ("slot_mapping", "block_table")


def _integers(**named: Any) -> dict[str, Tensor | None]:
    """Each given argument as int64 (None stays None); every one that is not integers is refused
    at once, naming it (`forward_inputs.as_integers`)."""
    out: dict[str, Tensor | None] = {}
    problems = []
    for name, value in named.items():
        t, found = (None, []) if value is None else forward_inputs.as_integers(name, value)
        out[name] = t
        problems += found
    if problems:
        unwrap(Failure(ConfigError(problems=tuple(problems))), "Invalid forward() inputs")
    return out


def run(
    model: Any,
    runtime: Any,
    plan: BlockPlan,
    *,
    input_ids: Tensor,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    sampling_params: Tensor | None,
    slot_mapping: Tensor | None,
    block_table: Tensor | None,
    full_context_lens: Tensor | None,
    computed_context_lens: Tensor | None,
) -> tuple[Tensor | None, Tensor | None, dict[str, Tensor]]:
    """One block-KV forward call of `model` (a `NeuronBaseForCausalLM`) on `runtime`.

    Returns:
        logits (None when the programs return only tokens), tokens (None without on-device
        sampling) and the routing outputs by name ([L, B, W, ...]; none unless asked for), shaped
        as the module docstring says.

    Raises:
        IncompatibleConfigError: a missing or malformed block argument, or anything
            `block_inputs` refuses (every problem listed).
    """
    missing = [n for n, v in zip(_REQUIRED, (slot_mapping, block_table), strict=True) if v is None]
    if missing:
        raise IncompatibleConfigError(
            f"forward() with is_block_kv_layout=True needs {' and '.join(missing)}: the serving client's "
            "block manager says where each sequence lives (see the serving docs)"
        )
    given = _integers(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        slot_mapping=slot_mapping,
        block_table=block_table,
        full_context_lens=full_context_lens,
        computed_context_lens=computed_context_lens,
    )
    ids, slots, table = given["input_ids"], given["slot_mapping"], given["block_table"]
    assert ids is not None and slots is not None and table is not None  # given, so converted
    ids = ids[None] if ids.dim() == 1 else ids
    positions = given["position_ids"]
    if positions is None:
        mask = given["attention_mask"]
        positions = ((torch.ones_like(ids) if mask is None else mask).cumsum(1) - 1).clamp(min=0)
    positions = positions.reshape(ids.shape)
    full, computed = given["full_context_lens"], given["computed_context_lens"]
    spec = model.spec
    limits = BlockLimits(
        num_blocks=spec.pa_num_blocks,
        block_size=spec.pa_block_size,
        max_length=spec.max_length,
        vocab_size=model.model_spec.vocab_size,
    )
    if plan.chunked:
        if full is None or computed is None:
            raise IncompatibleConfigError(
                "forward() with chunked prefill needs full_context_lens and computed_context_lens: "
                "they say how many of input_ids' tokens belong to each request"
            )
        seg = unwrap(
            block_inputs.chunked_segments(ids, slots, table, full, computed, limits=limits),
            "Invalid chunked-prefill inputs",
        )
        key = unwrap(plan.select(Phase.CONTEXT, sum(seg.new), max(seg.computed)), "No chunked-prefill bucket fits")
        params = _params(model, sampling_params, len(seg.tokens), plan.segments)
        x, blocks = block_inputs.as_chunks(seg, segments=plan.segments, tokens=key.tokens, blocks=plan.blocks(key))
        out = runtime.run_blocks(key, x, blocks, params=params)
        logits, tokens, r, t = out.logits, out.tokens, len(seg.tokens), ids.shape[1]
        # The one row holds the requests' tokens in the caller's order, then padding: [L, 1, T, ...].
        extras = {n: e[:, None, :t] for n, e in out.extras.items()}
        return (None if logits is None else logits[:, :r]), (None if tokens is None else tokens[:r]), extras

    first = unwrap(
        block_inputs.row_segments(ids, positions, slots, table, full, computed, limits=limits),
        "Invalid forward() inputs",
    )
    phase = Phase.CONTEXT if int(positions.min()) == 0 or max(first.new) > 1 else Phase.TOKEN
    key = unwrap(plan.select(phase, max(first.new), max(first.computed)), "No compiled bucket fits")
    seg = first
    if phase is Phase.CONTEXT and key.length - key.tokens < max(first.computed):
        # Cached tokens past the chosen prefix bucket are computed again with the new ones.
        seg = unwrap(
            block_inputs.row_segments(
                ids, positions, slots, table, full, computed, limits=limits, max_prefix=key.length - key.tokens
            ),
            "Invalid forward() inputs",
        )
    params = _params(model, sampling_params, len(seg.tokens), len(seg.tokens))
    logits, tokens, per_row = _rows(runtime, plan, key, seg, params)
    w = ids.shape[1]
    fills = moe_settings.FILL
    extras = {
        n: block_inputs.in_caller_columns(e, seg, asked=first, width=w, fill=fills.get(n, 0))
        for n, e in per_row.items()
    }
    return logits, tokens, extras


def _rows(
    runtime: Any, plan: BlockPlan, key: Any, seg: Segments, params: Tensor
) -> tuple[Tensor | None, Tensor | None, dict[str, Tensor]]:
    """Run `seg`'s rows in chunks of the program's batch; outputs in the caller's row order (the
    extras [L, B*S, ...] of each chunk as [L, B, S, ...], row r its request's tokens first)."""
    logits_out, tokens_out = [], []
    extras_out: dict[str, list[Tensor]] = {}
    for start in range(0, len(seg.tokens), key.batch):
        part = Segments(
            tokens=seg.tokens[start : start + key.batch],
            computed=seg.computed[start : start + key.batch],
            slots=seg.slots[start : start + key.batch],
            tables=seg.tables[start : start + key.batch],
            first_column=seg.first_column[start : start + key.batch],
        )
        n = len(part.tokens)
        x, blocks = block_inputs.as_rows(part, batch=key.batch, tokens=key.tokens, blocks=plan.blocks(key))
        rows = params[start : start + n]
        padded = torch.cat((rows, rows[:1].expand(key.batch - n, 3)))  # pad rows sample like the first
        out = runtime.run_blocks(key, x, blocks, params=padded)
        if out.logits is not None:
            logits_out.append(out.logits[:n])
        if out.tokens is not None:
            tokens_out.append(out.tokens[:n])
        for name, t in out.extras.items():
            per_row = t.reshape(t.shape[0], key.batch, key.tokens, *t.shape[2:])  # [L, B, S, ...]
            extras_out.setdefault(name, []).append(per_row[:, :n])
    extras = {name: torch.cat(parts, dim=1) for name, parts in extras_out.items()}
    return (torch.cat(logits_out) if logits_out else None), (torch.cat(tokens_out) if tokens_out else None), extras


def _params(model: Any, given: Tensor | None, requests: int, rows: int) -> Tensor:
    """[rows, 3] sampling rows: the requests' (a chunked-prefill client passes one row per possible
    request; the first `requests` are this call's), then greedy-like padding rows."""
    if given is not None:
        t = torch.as_tensor(given)
        if t.dim() == 2 and t.shape[0] > requests and rows > requests:
            given = t[:requests]
    picked: Tensor = model._sampling_rows(given, requests)
    if rows > requests:
        picked = torch.cat((picked, picked[:1].expand(rows - requests, 3)))
    return picked

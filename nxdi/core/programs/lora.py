"""Multi-LoRA serving in the decoder program: stacked adapters, selected per batch row. Pure.

Theory of operation:
- Every adapter loaded on the device owns a slot s of S (`nxdi.core.planning.lora.LoraLayout`):
  per layer and target module, A [S, R, in] and B [S, out, R], ranks zero-padded to
  `max_lora_rank`, each adapter's scaling (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) folded
  into its A when the adapters are stacked (`stack`). Q, K and V adapters share the fused QKV
  linear: their A matrices are stacked along the rank (one product for all three), each keeps its
  own B, and a part no adapter targets gets zeros. With `enable_base_model_only` slot 0 stays
  zero: a row that selects it computes exactly the base model.
- A step's `StepInputs.adapter_ids` [B] picks each row's slot. `forward_outputs` gathers the rows'
  matrices (`index_select`, static shapes, no data-dependent control flow) and runs the decoder
  with each targeted weight wrapped as a `linear.LoraLinear`, which adds `B_b (A_b x)` with two
  batched products. Models without `lora_config` never reach this module: their programs, inputs
  and weights are unchanged.
- Under tensor parallelism a rank holds its slices (`nxdi.core.planning.lora_ranks`): the matrix
  that follows the base layer's split needs nothing more; a plain matrix split with
  `lora_shard_linear_layer` is all-gathered after the rows' selection (`Stacked.a_full`, `b_full`) and cut
  back to its size. A row-parallel layer's adapter output is a partial sum like the base's, which
  the decoder's own all-reduce completes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from nxdi.core.planning import lora as lora_plan
from nxdi.core.planning.lora import LoraLayout
from nxdi.core.programs import decoder
from nxdi.core.programs.collectives import SINGLE, Collectives
from nxdi.core.programs.decoder import DecoderWeights, GatedMLP
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.linear import LoraLinear


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class LoraWeights:
    """The decoder's weights and its stacked adapters."""

    decoder: DecoderWeights
    adapters: tuple[Mapping[str, Stacked], ...]
    """Per layer: target (`qkv`, `o`, `gate`, `up`, `down`) -> its stacked matrices."""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Stacked:
    """One target linear's adapters, every slot, as stored: A [S, R * m, in] and, per output part,
    B [S, N_j, R] or None (the fused QKV's parts are Q, K and V; another linear has one part); with
    `transposed` A [S, in, R * m] and B [S, R, N_j]."""

    a: Tensor
    b: tuple[Tensor | None, ...]
    transposed: bool
    widths: tuple[int, ...]
    """Each output part's width on this rank."""
    a_full: int | None = None
    """Set when A holds this rank's chunk of its input dim: the full input size to gather back to."""
    b_full: int | None = None
    """Set when the one B holds this rank's chunk of its output rows: the full output size."""


def _parts(target: str) -> tuple[str, ...]:
    """The modules whose outputs make up `target`'s, in order."""
    return lora_plan.QKV_MODULES if target == "qkv" else (f"{target}_proj",)


def weights_from_tensors(
    base: DecoderWeights,
    tensors: Mapping[str, Tensor],
    layout: LoraLayout,
    *,
    widths: Mapping[str, tuple[int, ...]] | None = None,
    gathers: Mapping[str, int] | None = None,
) -> LoraWeights:
    """`base` with the stacked adapters `tensors` holds by their `lora_plan` names. Under tensor
    parallelism `widths` gives each target's part widths on a rank and `gathers` the split plain
    matrices (`lora_ranks.part_widths` / `lora_ranks.gathers`); by default one rank holds all."""
    gathers = gathers or {}

    def stacked(i: int, target: str) -> Stacked:
        parts = _parts(target)
        a_name = lora_plan.weight_name(i, target, "a")
        b_names = [lora_plan.b_name(i, m) if m in layout.modules else None for m in parts]
        return Stacked(
            a=tensors[a_name],
            b=tuple(None if n is None else tensors[n] for n in b_names),
            transposed=layout.transposed,
            widths=widths[target] if widths is not None else tuple(layout.dims(m)[1] for m in parts),
            a_full=gathers.get(a_name),
            b_full=gathers.get(b_names[0]) if len(parts) == 1 and b_names[0] is not None else None,
        )

    adapters = tuple({t: stacked(i, t) for t in layout.targets()} for i in range(layout.model.num_layers))
    return LoraWeights(decoder=base, adapters=adapters)


def _row(stacked: Stacked, base: Any, slots: Tensor, coll: Collectives) -> LoraLinear:
    """The rows' adapters of one linear: A [B, R * m, in], each B [B, N_j, R] (a split plain
    matrix gathered from every rank and cut to its size). The rows are selected as stored, so a
    transposed layout's selections stay contiguous and reach the products as views."""

    def rows(t: Tensor, dim: int, full: int | None) -> Tensor:
        """`t`'s rows' slots, gathered along the logical `dim` when split; logical orientation."""
        picked = t.index_select(0, slots)
        stored = 3 - dim if stacked.transposed else dim
        if full is not None:
            picked = coll.all_gather(picked, stored).narrow(stored, 0, full)
        return picked.transpose(1, 2) if stacked.transposed else picked

    a = rows(stacked.a, 2, stacked.a_full)
    b = tuple(None if t is None else rows(t, 1, stacked.b_full) for t in stacked.b)
    return LoraLinear(base=base, a=a, b=b, widths=stacked.widths)


def select(w: LoraWeights, slots: Tensor, coll: Collectives = SINGLE) -> DecoderWeights:
    """The decoder weights for rows whose adapter slots are `slots` [B] int64: every targeted linear
    a `LoraLinear` holding the rows' A and B (`coll` gathers split plain matrices)."""
    layers = []
    for lw, adapters in zip(w.decoder.layers, w.adapters, strict=True):
        attn = lw.attn
        if "qkv" in adapters:
            attn = dataclasses.replace(attn, qkv=_row(adapters["qkv"], attn.qkv, slots, coll))
        if "o" in adapters:
            attn = dataclasses.replace(attn, o=_row(adapters["o"], attn.o, slots, coll))
        mlp = lw.mlp
        if isinstance(mlp, GatedMLP):  # other MLPs carry no adapters (refused by layout_for)
            wrapped: dict[str, Any] = {
                t: _row(adapters[t], getattr(mlp, t), slots, coll) for t in ("gate", "up", "down") if t in adapters
            }
            mlp = dataclasses.replace(mlp, **wrapped)
        layers.append(dataclasses.replace(lw, attn=attn, mlp=mlp))
    return dataclasses.replace(w.decoder, layers=tuple(layers))


def forward_outputs(
    w: LoraWeights, cache: KVCache, x: StepInputs, *, base: Any = decoder.forward_outputs, **options: Any
) -> tuple[Tensor, KVCache, dict[str, Tensor]]:
    """`base` (the decoder's `forward_outputs`) with each row's adapter: x.adapter_ids [B] are the
    rows' slots. Returns what `base` returns."""
    assert x.adapter_ids is not None, "a multi-LoRA program is given every row's adapter slot"
    return base(select(w, x.adapter_ids, options.get("coll", SINGLE)), cache, x, **options)


def scaling(alpha: float | None, rank: int, *, rslora: bool) -> float:
    """PEFT's factor on an adapter's output: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA
    (1.0 when the adapter gives no alpha)."""
    if not alpha:
        return 1.0
    return alpha / (rank**0.5 if rslora else rank)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Adapter:
    """One adapter to stack: its slot, its tensors (PEFT names) and its scaling settings."""

    slot: int
    tensors: Mapping[str, Tensor]
    alpha: float | None = None
    rslora: bool = False


def stack(layout: LoraLayout, adapters: Sequence[Adapter], *, dtype: torch.dtype) -> dict[str, Tensor]:
    """The stacked tensors (`layout.shapes()`, in its order) with every adapter at its slot, its A
    scaled (in fp32, then cast to `dtype`); every other entry zero. Adapters must have passed
    `lora_plan.check_adapter` (their keys and shapes are trusted here)."""
    out = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in layout.logical_shapes().items()}
    for adapter in adapters:
        for key, t in adapter.tensors.items():
            parsed = lora_plan.parse_key(key)
            assert parsed is not None, f"{key}: checked adapters hold only A and B matrices"
            layer, module, matrix = parsed
            if matrix == "A":  # [r, in], at its module's rank rows of the target's A
                r, col = t.shape[0], layout.a_column(module)
                factor = scaling(adapter.alpha, r, rslora=adapter.rslora)
                name = lora_plan.weight_name(layer, lora_plan.TARGET_OF[module], "a")
                out[name][adapter.slot, col : col + r] = t.float() * factor
            else:  # [out, r]
                out[lora_plan.b_name(layer, module)][adapter.slot, :, : t.shape[1]] = t.float()
    if layout.transposed:  # stored [in, out]: each slot's matrices transposed, contiguous
        return {name: t.transpose(1, 2).contiguous().to(dtype) for name, t in out.items()}
    return {name: t.to(dtype) for name, t in out.items()}


def named_tensors(w: LoraWeights, layout: LoraLayout) -> dict[str, Tensor]:
    """The stacked tensors `w` holds, by their `lora_plan` names (the inverse of
    `weights_from_tensors`): the very tensors the programs read, for writing a slot in place."""
    out: dict[str, Tensor] = {}
    for i, adapters in enumerate(w.adapters):
        for target, st in adapters.items():
            out[lora_plan.weight_name(i, target, "a")] = st.a
            for module, b in zip(_parts(target), st.b, strict=True):
                if b is not None:
                    out[lora_plan.b_name(i, module)] = b
    return out


def slot_tensors(layout: LoraLayout, adapter: Adapter, *, dtype: torch.dtype) -> dict[str, Tensor]:
    """One adapter's matrices as one slot of every stacked tensor (`layout.shapes()` without the
    slot dim, zeros where it has no matrix): what a dynamic swap copies into a device slot."""
    one = dataclasses.replace(adapter, slot=0)
    single = attrs.evolve(layout, slots=1, base_slot=False)
    return {name: t[0] for name, t in stack(single, [one], dtype=dtype).items()}

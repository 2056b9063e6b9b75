"""Running a weight plan against checkpoint files, one tensor at a time. Effects: reads checkpoint files.

The plan (`nxdi.core.weight_plan`) is checked against the checkpoint's keys and shapes before any
tensor data is read, so a bad checkpoint fails fast with every problem listed. Then each step reads
its sources, combines and casts them (`nxdi.core.host.weight_ops`) and yields the result; only aliased
outputs (the embedding of tied models) are held back, so the stream itself keeps about one weight
in flight. A rank's plan (`nxdi.core.planning.rank_weights`) reads only the rows of each source it
holds (a safetensors slice; a `.bin` file is memory-mapped, then sliced). The functions NxDI users know map as follows: `get_state_dict(path, config)` is
`get_state_dict` here; `convert_hf_to_neuron_state_dict(sd, config)` is `weight_ops.convert(plan, sd)`;
`_STATE_DICT_MODEL_PREFIX` is `WeightPlan.model_prefix`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core import weight_plan as weights
from nxdi.core.errors import CheckpointError
from nxdi.core.host import weight_ops
from nxdi.effects import checkpoint


def iter_weights(
    plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint, keys: Mapping[str, str]
) -> Iterator[tuple[str, Tensor]]:
    """(nxdi name, tensor) in plan order; `keys` is the mapping `weights.check_checkpoint` returned.

    A tied weight is yielded as the very tensor its alias target was (no copy).
    """
    targets = {s.sources[0] for s in plan.steps if s.combine is weights.Combine.ALIAS}
    held: dict[str, Tensor] = {}
    for step in plan.steps:
        if step.combine is weights.Combine.ALIAS:
            out = held[step.sources[0]]
        else:
            reads = [_read(ckpt, keys[s], step.take(i)) for i, s in enumerate(step.sources)]
            out = weight_ops.apply_step(step, [t for t, _ in reads], [o for _, o in reads])
        if step.name in targets:
            held[step.name] = out
        yield step.name, out


def _read(ckpt: checkpoint.Checkpoint, key: str, take: weights.Take | None) -> tuple[Tensor, int]:
    """The tensor at `key`, or only the rows a rank's Take spans, and the index of its first row."""
    if take is None:
        return ckpt.read(key), 0
    bounds = take.bounds()
    start, stop = bounds if bounds is not None else (0, 1)  # all padding: one row for its dtype and shape
    return ckpt.read_slice(key, dim=take.dim, start=start, stop=stop), start


def load_weights(plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint) -> Result[dict[str, Tensor], CheckpointError]:
    """Every weight of `plan` read from an open checkpoint.

    Returns:
        `Success(dict)` of nxdi name -> tensor in plan order, or `Failure(CheckpointError)` listing
        every missing, unexpected or wrongly shaped key (nothing is read in that case).
    """
    match weights.check_checkpoint(plan, ckpt.shapes()):
        case Success(keys):
            return Success(dict(iter_weights(plan, ckpt, keys)))
        case Failure(err):
            return Failure(err)
    raise AssertionError("unreachable")


def get_state_dict(
    path: str | os.PathLike[str], plan: weights.WeightPlan
) -> Result[dict[str, Tensor], CheckpointError]:
    """The converted weights of the checkpoint at `path` (a model directory or a checkpoint file).

    Raises:
        CheckpointReadError: (a subclass of) when the files cannot be found or read; see
            `nxdi.effects.checkpoint.find_checkpoint`.
    """
    with checkpoint.open_checkpoint(path) as ckpt:
        return load_weights(plan, ckpt)


def example_weights(plan: weights.WeightPlan, path: str | os.PathLike[str]) -> Result[list[Tensor], CheckpointError]:
    """Zeros of the shapes and dtypes `plan` gives (its own steps, aliases left out), from the
    checkpoint's headers alone (no tensor data is read): all that tracing a program needs.

    Returns:
        The tensors in plan order, or the CheckpointError `get_state_dict` would give.
    """
    own = [s for s in plan.steps if s.combine is not weights.Combine.ALIAS]
    with checkpoint.open_checkpoint(path) as ckpt:
        checked = weights.check_checkpoint(plan, ckpt.shapes())
        if isinstance(checked, Failure):
            return Failure(checked.failure())
        keys = checked.unwrap()
        stored = [ckpt.torch_dtype(keys[s.sources[0]]) for s in own]
    out = []
    for s, dtype in zip(own, stored, strict=True):
        like = torch.empty(0, dtype=dtype)
        for t in s.transforms:  # the dtype the step's casts give
            like = weight_ops.apply_transform(like, t)
        out.append(torch.zeros(s.shape, dtype=like.dtype))
    return Success(out)

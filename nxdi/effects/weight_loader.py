"""Running a weight plan against checkpoint files, one tensor at a time. Effects: reads checkpoint files.

The plan (`nxdi.core.weight_plan`) is checked against the checkpoint's keys, shapes and dtypes
(`check_headers`: only floating-point weights, `nxdi.core.weight_checks`) before any tensor data is
read, so a bad checkpoint fails fast with every problem listed. Values are checked for NaN and inf
as they are read when the caller asks (`to_cpu()`), or by one streaming pass over the files at
compile (`scan_source`, which also records the files' identity). Then each step reads
its sources, combines and casts them (`nxdi.core.host.weight_ops`) and yields the result; only aliased
outputs (the embedding of tied models) are held back, so the stream itself keeps about one weight
in flight. A rank's plan (`nxdi.core.planning.rank_weights`) reads only the rows of each source it
holds (a safetensors slice; a `.bin` file is memory-mapped, then sliced). The functions NxDI users know map as follows: `get_state_dict(path, config)` is
`get_state_dict` here; `convert_hf_to_neuron_state_dict(sd, config)` is `weight_ops.convert(plan, sd)`;
`_STATE_DICT_MODEL_PREFIX` is `WeightPlan.model_prefix`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping

import torch
from returns.result import Failure, Result, Success
from torch import Tensor

from nxdi.core import weight_checks
from nxdi.core import weight_plan as weights
from nxdi.core.errors import CheckpointError, Problem
from nxdi.core.host import weight_ops
from nxdi.core.host.quant import layout
from nxdi.core.host.quant import weights as quant_weights
from nxdi.effects import checkpoint, checkpoint_scan


def source_keys(plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint) -> tuple[str, ...]:
    """The checkpoint keys (as stored) that `plan` reads."""
    read = plan.read_keys()
    return tuple(k for k in ckpt.keys() if plan.rename(k) in read)  # noqa: SIM118 (not a dict)


def check_headers(plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint) -> Result[Mapping[str, str], CheckpointError]:
    """`weights.check_checkpoint` (keys and shapes) and `weight_checks.check_dtypes` (floating point
    only) from the headers alone, every problem of both listed.

    Raises:
        CorruptCheckpointError: a header names a dtype torch does not know.
    """
    stored_quantized = {k for s in plan.steps if s.quantized for k in s.sources}
    dtypes = {
        k: str(ckpt.torch_dtype(k)).removeprefix("torch.")
        for k in source_keys(plan, ckpt)
        if plan.rename(k) not in stored_quantized
    }
    shaped, typed = weights.check_checkpoint(plan, ckpt.shapes()), weight_checks.check_dtypes(dtypes)
    problems = [p for r in (shaped, typed) if isinstance(r, Failure) for p in r.failure().problems]
    if plan.quant is not None:
        quant = _quant_problems(plan, ckpt)
        named = {p.field for p in quant}
        problems = quant + [p for p in problems if plan.rename(p.field) not in named]
    return Failure(CheckpointError(problems=tuple(problems))) if problems else shaped


def _quant_problems(plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint) -> list[Problem]:
    """A quantized checkpoint against the configured scheme (`layout.check_quantized_checkpoint`):
    each quantized weight in the quantization dtype with its scale of the scheme's shape, and no
    linear that modules_to_not_convert keeps in float stored quantized. Keys are renamed ones."""
    assert plan.quant is not None
    q = plan.quant
    scheme = quant_weights.parse_quant_scheme(
        quantization_type=q.type,
        quantization_dtype=q.dtype,
        quantization_block_axis=q.block_axis,
        quantization_block_size=q.block_size,
    )
    if isinstance(scheme, Failure):
        return list(scheme.failure().problems)
    metas = {
        plan.rename(k): layout.TensorMeta(shape=shape, dtype=ckpt.torch_dtype(k)) for k, shape in ckpt.shapes().items()
    }
    quantized = [k for s in plan.steps if s.quantized for k in s.sources]
    transposed = [k for s in plan.steps if s.quantized and weights.transposes(s) for k in s.sources]
    kept = [k for s in plan.steps if not s.quantized for k in s.sources if k.endswith(".weight") and q.excludes(k)]
    checked = layout.check_quantized_checkpoint(
        metas, layout.QuantPlan(quantized=quantized, excluded=kept, transposed=frozenset(transposed)), scheme.unwrap()
    )
    return list(checked.failure().problems) if isinstance(checked, Failure) else []


def iter_weights(
    plan: weights.WeightPlan,
    ckpt: checkpoint.Checkpoint,
    keys: Mapping[str, str],
    *,
    nonfinite: dict[str, weight_checks.NonFinite] | None = None,
    overflows: list[Problem] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """(nxdi name, tensor) in plan order; `keys` is the mapping `weights.check_checkpoint` returned.

    A tied weight is yielded as the very tensor its alias target was (no copy). When `nonfinite`
    is given, the NaN and inf values of every tensor read (the part a rank reads) are counted into
    it by checkpoint key. When `overflows` is given, a weight whose cast to the model's dtype would
    turn finite values into inf (`weight_ops.CastOverflow`) is not yielded, and a problem per
    checkpoint tensor that overflows is added to it; otherwise that raises.
    """
    targets = {s.sources[0] for s in plan.steps if s.combine is weights.Combine.ALIAS}
    held: dict[str, Tensor] = {}
    for step in plan.steps:
        if step.combine is weights.Combine.ALIAS:
            if step.sources[0] not in held:  # its target overflowed (recorded)
                continue
            out = held[step.sources[0]]
        else:
            reads = [_read(ckpt, keys[s], step.take(i)) for i, s in enumerate(step.sources)]
            if nonfinite is not None:
                for s, (t, _) in zip(step.sources, reads, strict=True):
                    if (counts := checkpoint_scan.count_nonfinite(t)) is not None:
                        nonfinite[keys[s]] = counts
            try:
                out = weight_ops.apply_step(step, [t for t, _ in reads], [o for _, o in reads])
            except weight_ops.CastOverflow as e:
                if overflows is None:
                    raise
                sources = {keys[s]: t for s, (t, _) in zip(step.sources, reads, strict=True)}
                overflows.extend(weight_ops.overflow_problems(sources, e.dtype))
                continue
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


def load_weights(
    plan: weights.WeightPlan, ckpt: checkpoint.Checkpoint, *, refuse_nonfinite: bool = False
) -> Result[dict[str, Tensor], CheckpointError]:
    """Every weight of `plan` read from an open checkpoint.

    Args:
        refuse_nonfinite: fail when a tensor read holds NaN or inf (counted as it is read, one
            `aminmax` per tensor).

    Returns:
        `Success(dict)` of nxdi name -> tensor in plan order, or `Failure(CheckpointError)` listing
        every missing, unexpected, wrongly shaped or non-floating key (nothing is read in that
        case), or every weight whose cast to the model's dtype would overflow to inf (a float16
        model of a checkpoint with values past 65504), and, with `refuse_nonfinite`, every tensor
        holding NaN or inf.
    """
    match check_headers(plan, ckpt):
        case Success(keys):
            found: dict[str, weight_checks.NonFinite] | None = {} if refuse_nonfinite else None
            overflows: list[Problem] = []
            out = dict(iter_weights(plan, ckpt, keys, nonfinite=found, overflows=overflows))
            problems = (*weight_checks.nonfinite_problems(found or {}), *overflows)
            return Failure(CheckpointError(problems=problems)) if problems else Success(out)
        case Failure(err):
            return Failure(err)
    raise AssertionError("unreachable")


def get_state_dict(
    path: str | os.PathLike[str], plan: weights.WeightPlan, *, refuse_nonfinite: bool = False
) -> Result[dict[str, Tensor], CheckpointError]:
    """The converted weights of the checkpoint at `path` (a model directory or a checkpoint file);
    see `load_weights`.

    Raises:
        CheckpointReadError: (a subclass of) when the files cannot be found or read; see
            `nxdi.effects.checkpoint.find_checkpoint`.
    """
    with checkpoint.open_checkpoint(path) as ckpt:
        return load_weights(plan, ckpt, refuse_nonfinite=refuse_nonfinite)


def scan_source(
    path: str | os.PathLike[str], plan: weights.WeightPlan, *, allow_nonfinite: bool = False
) -> Result[checkpoint_scan.Scan, CheckpointError]:
    """Check the checkpoint at `path` for `plan` (headers first, as `check_headers`), then read every
    byte once (`checkpoint_scan.scan_checkpoint`): the files' identity, and the NaN and inf values
    of the tensors the plan reads, refused unless `allow_nonfinite` (then a warning names them).

    Raises:
        CheckpointReadError: (a subclass of) when the files cannot be found or read.
    """
    with checkpoint.open_checkpoint(path) as ckpt:
        checked = check_headers(plan, ckpt)
        if isinstance(checked, Failure):
            return Failure(checked.failure())
        scan = checkpoint_scan.scan_checkpoint(ckpt, source_keys(plan, ckpt))
    found = dict(scan.nonfinite)
    if allow_nonfinite and found:
        listed = "; ".join(f"{key} ({counts.describe()})" for key, counts in found.items())
        why = "weights holding NaN or inf are accepted (every logit they reach will be NaN)"
        warnings.warn(f"{weight_checks.ALLOW_NONFINITE}=1: {why}: {listed}", stacklevel=2)
    return weight_checks.check_finite(found, allowed=allow_nonfinite).map(lambda _: scan)


def example_weights(plan: weights.WeightPlan, path: str | os.PathLike[str]) -> Result[list[Tensor], CheckpointError]:
    """Zeros of the shapes and dtypes `plan` gives (its own steps, aliases left out), from the
    checkpoint's headers alone (no tensor data is read): all that tracing a program needs.

    Returns:
        The tensors in plan order, or the CheckpointError of `check_headers`.
    """
    own = [s for s in plan.steps if s.combine is not weights.Combine.ALIAS]
    with checkpoint.open_checkpoint(path) as ckpt:
        checked = check_headers(plan, ckpt)
        if isinstance(checked, Failure):
            return Failure(checked.failure())
        keys = checked.unwrap()
        stored = [ckpt.torch_dtype(keys[s.sources[0]]) for s in own]
    out = []
    for s, dtype in zip(own, stored, strict=True):
        like = torch.empty(0, dtype=dtype)
        for t in s.transforms:  # the dtype the step's casts give (the other transforms keep it)
            like = weight_ops.apply_transform(like, t) if isinstance(t, weights.CastFloat) else like
        out.append(torch.zeros(s.shape, dtype=like.dtype))
    return Success(out)

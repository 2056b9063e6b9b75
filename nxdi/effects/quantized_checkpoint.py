"""Writing a quantized checkpoint (NxDI's `save_quantized_state_dict`). Effects: reads a checkpoint,
writes one file.

The source checkpoint is read as stored, quantized by `nxdi.core.host.quant.layout.quantize_state_dict`
(the reference's key layout: base-model keys without `model.`, `lm_head.*`, a `.scale` beside each
quantized `.weight`) and written where `quantized_checkpoints_path` says, as the reference does: into
`model.safetensors` when the path is an existing folder, else as a torch pickle file at the path.
The file is written beside its target and renamed into place, and a target that is (or would
overwrite) a file of the source checkpoint is refused: the user's checkpoint is never modified.
A larger model's checkpoint holding the model (a multimodal Gemma 3: `weight_table.Wrapper`)
gives its language model's weights only, under the model's own keys, so the quantized checkpoint
has the layout of the text model's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError, Problem
from nxdi.core.host.quant import layout
from nxdi.core.host.quant.weights import QuantScheme
from nxdi.core.model_spec import ModelSpec
from nxdi.core.weight_table import WeightTable
from nxdi.effects import checkpoint, files

SAFETENSORS_NAME = "model.safetensors"
"""The file a quantized checkpoint folder gets (the reference's unsharded `model{suffix}.safetensors`)."""


def target_file(out: str | os.PathLike[str]) -> Path:
    """Where the quantized checkpoint goes: `<out>/model.safetensors` for a folder, else `out` itself."""
    p = Path(out)
    return p / SAFETENSORS_NAME if p.is_dir() else p


def save_quantized(
    model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    scheme: QuantScheme,
    modules_to_not_convert: tuple[str, ...] | None,
    *,
    table: WeightTable,
    spec: ModelSpec,
) -> Result[Path, ConfigError]:
    """Quantize the checkpoint at `model_path`, of `spec`'s family (`table`), and write it to `out`
    (see the module docstring).

    Returns:
        Success(the file written), or Failure(ConfigError) naming `quantized_checkpoints_path` when
        it would overwrite a file of the source checkpoint, or every weight the scheme cannot quantize.

    Raises:
        CheckpointReadError (a subclass of): the source checkpoint cannot be found or read.
    """
    source = checkpoint.find_checkpoint(model_path)
    target = target_file(out)
    own = {p.resolve() for p in (*source.shards, *((source.index,) if source.index else ()))}
    if target.resolve() in own:
        why = f"would overwrite {target}, a file of the checkpoint being quantized"
        fix = "point quantized_checkpoints_path at another folder or file"
        return Failure(ConfigError.of("neuron_config.quantized_checkpoints_path", str(out), why, fix))
    state = checkpoint.read_state_dict(model_path)
    wrapper = table.wrapper_for(spec.model_type)
    if wrapper is not None:  # the language model's tensors, keyed as in the model's own checkpoints
        state = {wrapper.unwrap(k): t for k, t in state.items() if not wrapper.skips(k)}
    quantized = layout.quantize_state_dict(state, scheme, modules_to_not_convert, table=table, spec=spec)
    match quantized:
        case Success(tensors):
            if target.suffix == ".safetensors":
                return Success(checkpoint.write_safetensors(target, tensors))
            return Success(files.publish(target, lambda tmp: _save_pickle(tensors, tmp)))
        case Failure(err):
            return Failure(err)
    raise AssertionError("unreachable")


def _save_pickle(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Through a file object: torch names the zip archive after a path's stem, and refuses the
    # temporary file's (it starts with a dot).
    with open(path, "wb") as f:
        torch.save(tensors, f)


def quant_problem(path: str | None) -> Problem | None:
    """The problem with a configured `quantized_checkpoints_path` before loading it (None: it exists)."""
    if path is not None and os.path.exists(path):
        return None
    fix = "quantize the model first with save_quantized_state_dict(model_path, config), or fix the path"
    return Problem.of("neuron_config.quantized_checkpoints_path", path, "does not exist", fix)

"""Reading an EAGLE draft folder into the draft program's weights. Effects: reads config.json and checkpoint files.

The folder holds the draft's `config.json` (a LlamaConfig with its own `num_hidden_layers`, and
`fc_bias` when its fc has a bias) and its checkpoint in any layout `nxdi.effects.checkpoint`
reads, keys with or without `model.` (`nxdi.core.eagle_layout`). Every problem is reported at
once, each naming the file and the tensor (or config key), why, and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from returns.result import Failure, Result, Success

from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.core.eagle_layout import EagleDraft
from nxdi.core.errors import CheckpointError, ConfigError, Problem
from nxdi.core.model_spec import ModelSpec
from nxdi.core.programs import catalog, eagle
from nxdi.effects import checkpoint, weight_loader

CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class EagleCheckpoint:
    """A read EAGLE draft: its architecture, its layout and its weights."""

    spec: ModelSpec
    layout: EagleDraft
    weights: eagle.EagleWeights


def _renamed(problem: Problem, file: Path) -> Problem:
    """`problem` with its field prefixed by the file it is about (`/x/model.safetensors: fc.weight`)."""
    return Problem(field=f"{file}: {problem.field}", value=problem.value, reason=problem.reason, fix=problem.fix)


def _located(error: CheckpointError, ckpt: checkpoint.Checkpoint) -> CheckpointError:
    """Each problem of `error` with the file of its key (a missing key: the checkpoint's index or file)."""
    held = set(ckpt.keys())
    whole = ckpt.files.index or ckpt.files.shards[0]
    return CheckpointError(
        problems=tuple(_renamed(p, ckpt.shard_of(p.field) if p.field in held else whole) for p in error.problems)
    )


def _config(folder: Path) -> Result[tuple[ModelSpec, bool], ConfigError]:
    """The draft's architecture and `fc_bias` from its config.json (problems named `config.json: key`)."""
    file = folder / CONFIG_FILE
    raw = json.loads(file.read_text())
    fc_bias = raw.get("fc_bias", False)
    spec = families.parse_model_spec(raw)
    problems = list(spec.failure().problems) if isinstance(spec, Failure) else []
    if not isinstance(fc_bias, bool):
        problems.append(Problem.of("fc_bias", fc_bias, "must be true or false", "write fc_bias as a JSON boolean"))
    if problems:
        return Failure(ConfigError(problems=tuple(_renamed(p, file) for p in problems)))
    return Success((spec.unwrap(), fc_bias))


def read_eagle_draft(
    path: str | os.PathLike[str], *, input_norm: bool = False, torch_dtype: str = "float32"
) -> Result[EagleCheckpoint, ConfigError | CheckpointError]:
    """The EAGLE draft in folder `path`, read for the draft program.

    Args:
        path: the draft's folder (config.json and the checkpoint).
        input_norm: `enable_eagle_draft_input_norm`: the layers have input norms.
        torch_dtype: the weights' dtype.

    Returns:
        `Success(EagleCheckpoint)`, or a `Failure` listing every problem: of config.json
        (`ConfigError`: a family nxdi does not run, bad sizes, a non-boolean fc_bias), or of the
        checkpoint (`CheckpointError`: lm_head.weight missing, fc of the wrong shape, fc.bias or
        input norms that the configuration does not expect, ...), each field `file: key`.

    Raises:
        FileNotFoundError: no config.json or no checkpoint in the folder.
        json.JSONDecodeError: config.json is not JSON.
    """
    folder = Path(path)
    read = _config(folder)
    if isinstance(read, Failure):
        return Failure(read.failure())
    spec, fc_bias = read.unwrap()
    program = families.record_for(spec.model_type).bind(lambda r: catalog.program_for(r, spec))
    if isinstance(program, Failure):
        return Failure(
            ConfigError(problems=tuple(_renamed(p, folder / CONFIG_FILE) for p in program.failure().problems))
        )
    layout = EagleDraft(input_norm=input_norm, fc_bias=fc_bias)
    table = program.unwrap().table
    plan = weights.weight_plan_for(table, spec, torch_dtype=torch_dtype, eagle_draft=layout)
    if isinstance(plan, Failure):
        return Failure(plan.failure())
    with checkpoint.open_checkpoint(folder) as ckpt:
        loaded = weight_loader.load_weights(plan.unwrap(), ckpt)
        if isinstance(loaded, Failure):
            return Failure(_located(loaded.failure(), ckpt))
    tensors = loaded.unwrap()
    draft = eagle.weights_from_slots(layout.table(table).slots(tensors, spec), spec=spec)
    return Success(EagleCheckpoint(spec=spec, layout=layout, weights=draft))

"""The model families nxdi knows, one record each, and the one door for Hugging Face configs. Pure.

Adding a family: write `nxdi/core/families/<name>.py` with a `RECORD` (see `record.FamilyRecord`
and the README's "Adding a model family"), then add it to `RECORDS` below. Everything else (the
shell classes, `MODEL_TYPES`, the package exports, the family-parametrized tests) follows from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from returns.result import Failure, Result, Success

from nxdi.core.errors import ConfigError
from nxdi.core.families import (
    bloom,
    dbrx,
    gemma3,
    gpt2,
    gpt_neox,
    gptj,
    llama,
    mistral,
    mixtral,
    opt,
    qwen2,
    qwen3,
    qwen3_moe,
)
from nxdi.core.families.reader import ConfigReader
from nxdi.core.families.record import FamilyRecord
from nxdi.core.model_spec import ModelSpec

RECORDS: tuple[FamilyRecord, ...] = (
    llama.RECORD,
    mistral.RECORD,
    qwen2.RECORD,
    qwen3.RECORD,
    gemma3.RECORD,
    mixtral.RECORD,
    qwen3_moe.RECORD,
    dbrx.RECORD,
    opt.RECORD,
    gpt2.RECORD,
    gpt_neox.RECORD,
    gptj.RECORD,
    bloom.RECORD,
)
"""Every known family, in the order they are listed to users."""


def by_model_type() -> Mapping[str, FamilyRecord]:
    """HF model_type -> record."""
    return {t: r for r in RECORDS for t in r.model_types}


def runnable() -> tuple[FamilyRecord, ...]:
    """The families the engine runs (those with a program and a weight table)."""
    return tuple(r for r in RECORDS if r.runnable)


def class_names() -> dict[str, FamilyRecord]:
    """Every documented shell class name the records declare -> its record (`nxdi.shell.models` makes them)."""
    out: dict[str, FamilyRecord] = {}
    for record in RECORDS:
        if record.classes is not None:
            names = record.classes
            for name in (names.inference_config, names.neuron_config, names.causal_lm, names.model):
                if name is not None:
                    out[name] = record
    return out


def record_for(model_type: object) -> Result[FamilyRecord, ConfigError]:
    """The record of HF `model_type`, or a Failure naming the known ones."""
    found = by_model_type().get(model_type) if isinstance(model_type, str) else None
    if found is None:
        known = ", ".join(sorted(by_model_type()))
        return Failure(ConfigError.of("model_type", model_type, f"is not a supported model family ({known})"))
    return Success(found)


def parse_model_spec(hf_config: Mapping[str, Any]) -> Result[ModelSpec, ConfigError]:
    """Parse a Hugging Face `config.json` dict with its family's reader.

    Returns:
        `Success(ModelSpec)`, or `Failure(ConfigError)` listing every missing or inconsistent field,
        each named by its key in the config (nested keys dotted, e.g. `rope_scaling.rope_type`):
        an unknown `model_type`, a missing or non-positive size, heads that do not divide, a bad
        RoPE block, an unsupported activation, more experts per token than experts, ...
    """

    def read(record: FamilyRecord) -> Result[ModelSpec, ConfigError]:
        r = ConfigReader(hf_config)
        fields = record.read(r)
        return Failure(ConfigError(problems=tuple(r.problems))) if r.problems else Success(ModelSpec(**fields))

    return record_for(hf_config.get("model_type")).bind(read)

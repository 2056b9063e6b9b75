"""A checkpoint's Hugging Face `config.json`, read with transformers, its failures as documented
exceptions. Effects: reads config.json.

transformers refuses a bad config.json with its own exception types (OSError for invalid JSON,
huggingface_hub's StrictDataclass errors for a badly typed field or heads that do not divide,
ValueError without a `model_type`). They become `IncompatibleConfigError` naming the file and every
field at fault: nxdi's own reader (`parse_model_spec`) names the fields where it knows the family,
and transformers' message is kept for what it alone found.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from returns.result import Failure

from nxdi.core import families
from nxdi.core.config import codec
from nxdi.core.errors import ConfigError, Problem
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap

CONFIG_JSON = "config.json"

_FIELD = re.compile(r"field '([^']+)'")
"""How huggingface_hub's StrictDataclassFieldValidationError names the field."""
_VALIDATOR = re.compile(r"validator '([^']+)'")
"""How its StrictDataclassClassValidationError names the check (no field: it relates several)."""
_CAUSE = re.compile(r"^[A-Za-z]+(Error|Exception): ")


def config_file(model_path: str | os.PathLike[str]) -> Path:
    """The config.json of a checkpoint folder (or `model_path` itself when it names a file)."""
    path = Path(model_path)
    return path if path.suffix == ".json" else path / CONFIG_JSON


def read_json(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's config.json as a dict.

    Raises:
        FileNotFoundError: there is no config.json there.
        PermissionError: the folder or the file cannot be read.
        IncompatibleConfigError: the file is not a JSON object (the line and column named).
    """
    file = config_file(model_path)
    if not file.is_file():  # PermissionError here when the folder cannot be searched
        raise FileNotFoundError(f"{str(model_path)!r}: no {CONFIG_JSON} (is it a Hugging Face checkpoint folder?)")
    return unwrap(codec.loads(file.read_text(), source=str(file)), f"Cannot read {file}")


def read_hf_config(model_path_or_name: str | os.PathLike[str]) -> Any:
    """transformers' `AutoConfig` of a local checkpoint folder (or a hub name, read as transformers does).

    Raises:
        FileNotFoundError, PermissionError: a local folder without a readable config.json.
        IncompatibleConfigError: transformers refuses the local config.json (see the module docstring).
    """
    from transformers import AutoConfig

    if not Path(model_path_or_name).exists():
        return AutoConfig.from_pretrained(model_path_or_name)
    data = read_json(model_path_or_name)  # a JSON error names its line here, not deep in transformers
    try:
        return AutoConfig.from_pretrained(model_path_or_name)
    except (OSError, ValueError, TypeError, KeyError, _strict_dataclass_error()) as exc:
        if isinstance(exc, (PermissionError, FileNotFoundError)):
            raise
        error = ConfigError(problems=_problems(data, exc))
        raise IncompatibleConfigError(error.render(f"Invalid {config_file(model_path_or_name)}"), error) from None


def _strict_dataclass_error() -> type[Exception]:
    """huggingface_hub's base of the validation errors transformers' configs raise (ValueError if absent)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub, whose configs raise ValueError / TypeError
        return ValueError
    return StrictDataclassError


def _problems(data: Mapping[str, Any], exc: Exception) -> tuple[Problem, ...]:
    """Every problem nxdi's reader finds in `data` (for a known family, or without a model_type),
    plus transformers' own complaint unless it names a field already listed."""
    ours: list[Problem] = []
    model_type = data.get("model_type")
    if model_type is None:
        known = ", ".join(sorted(families.by_model_type()))
        ours.append(Problem.missing("model_type", f"set it in {CONFIG_JSON} (one of {known})"))
    elif model_type in families.by_model_type():
        parsed = families.parse_model_spec(data)
        if isinstance(parsed, Failure):
            ours.extend(parsed.failure().problems)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = _FIELD.search(lines[0]) if lines else None
    field = named.group(1) if named else CONFIG_JSON
    if model_type is None or field in {p.field for p in ours}:
        return tuple(ours)
    # "Validation error for field 'x':" / "Class validation error for validator 'v':", then "Kind: why".
    reason = _CAUSE.sub("", lines[-1]) if lines else type(exc).__name__
    checker = _VALIDATOR.search(lines[0]) if lines else None
    value = data.get(field, "<missing>") if named else checker.group(1) if checker else type(exc).__name__
    return (*ours, Problem.of(field, value, f"is refused by transformers ({reason})"))

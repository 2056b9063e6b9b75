"""Session-scoped fixtures: tiny random Hugging Face models and their checkpoints in every format.

Imported by `tests/conftest.py`. Models and directories are built once per session and shared;
tests must not modify them (copy a directory before corrupting it).

- `tiny_model(variant)`: a transformers model of `nxdi.testing.checkpoints.VARIANTS[variant]`.
- `tiny_checkpoint(variant, fmt)`: the directory of that model saved in `fmt` (a `SaveFormat`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Any]:
    from nxdi.testing import checkpoints

    built: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in built:
            built[variant] = checkpoints.build_model(variant, seed=0)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[str], Any]) -> Callable[..., Path]:
    from nxdi.testing import checkpoints

    root = tmp_path_factory.mktemp("checkpoints")
    saved: dict[tuple[str, Any], Path] = {}

    def get(variant: str, fmt: Any = checkpoints.SaveFormat.SAFETENSORS) -> Path:
        if (variant, fmt) not in saved:
            saved[(variant, fmt)] = checkpoints.save_checkpoint(tiny_model(variant), root / variant / fmt.value, fmt)
        return saved[(variant, fmt)]

    return get

"""Speculation inside one program (fused, EAGLE) and Medusa refuse tensor parallelism on the CPU
engine, through the documented constructor, with an error naming tp_degree, its value, why and
the fix, listed with every other problem of the configuration (one error, not the first only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import nxdi
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from tests.support.fused_models import eagle_config, fused_config, speculating_checkpoints

LM = nxdi.NeuronLlamaForCausalLM
ODS_MISSING = "on_device_sampling_config=None: is required with enable_fused_speculation=True"


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny llama (with Medusa heads beside it), a one-layer draft, and an EAGLE draft of it."""
    return speculating_checkpoints(tmp_path_factory.mktemp("tp-refusals"), medusa_heads=2)


def _refused(target: Path, config: Any) -> str:
    with pytest.raises(IncompatibleConfigError) as caught:
        LM(target, config)
    return str(caught.value)


@pytest.mark.parametrize("kind", ["fused", "eagle"])
def test_fused_and_eagle_refuse_tensor_parallelism_with_every_problem(
    kind: str, drafts: tuple[Path, Path, Path]
) -> None:
    target, draft, eagle = drafts
    setting = "enable_eagle_speculation=True" if kind == "eagle" else "enable_fused_speculation=True"
    make: Callable[..., Any] = eagle_config if kind == "eagle" else fused_config
    alone = _refused(target, make(target, eagle if kind == "eagle" else draft, tp_degree=2))
    assert f"tp_degree=2: does not run with {setting} on the CPU engine yet" in alone, alone
    assert "Fix: set tp_degree=1" in alone and "1 problem" in alone, alone
    both = _refused(
        target, make(target, eagle if kind == "eagle" else draft, tp_degree=2, on_device_sampling_config=None)
    )
    assert "2 problems" in both and "tp_degree=2" in both and ODS_MISSING in both, both


def test_medusa_refuses_tensor_parallelism_with_every_problem(drafts: tuple[Path, Path, Path]) -> None:
    target = drafts[0]
    medusa = {
        "is_medusa": True,
        "num_medusa_heads": 2,
        "medusa_speculation_length": 4,
        "medusa_tree": [[0], [0, 0], [1]],
    }

    def config(**kwargs: Any) -> Any:
        neuron_config = NeuronConfig(torch_dtype="float32", seq_len=64, **medusa, **kwargs)
        return LM.get_config_cls()(neuron_config, load_config=load_pretrained_config(target))

    alone = _refused(target, config(tp_degree=2))
    assert "tp_degree=2: does not run with Medusa (is_medusa=True) on the CPU engine yet" in alone, alone
    assert "Fix: set tp_degree=1" in alone, alone
    both = _refused(target, config(tp_degree=2, flash_decoding_enabled=True))
    assert "tp_degree=2" in both and "flash_decoding_enabled=True" in both, both

"""PEFT LoRA adapters for the multi-LoRA tests: three adapters of different ranks and targets.

Imported by `tests/e2e/test_lora.py` and the XLA tier; needs `peft` (the dev extra).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ADAPTERS: dict[str, dict[str, Any]] = {
    "alpha": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "beta": {"r": 8, "lora_alpha": 16, "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"]},
    "gamma": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "q_proj", "down_proj"], "use_rslora": True},
}
"""Sorted by id, these are adapter indices 1, 2, 3 (index 0: the base model, enable_base_model_only)."""
ROWS = ("alpha", None, "beta", "gamma")
"""Each batch row's adapter (None: the base model), for `engine_fixtures.PROMPTS`' four prompts."""
INDEX = {"alpha": 1, "beta": 2, "gamma": 3}


def save_adapter(base: Any, folder: Path, settings: dict[str, Any], seed: int) -> Path:
    """A PEFT adapter on a copy of `base` with random A and B (init_lora_weights=False, so B is not
    zero, then B scaled up so that every adapter moves a tiny model's greedy tokens), saved."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.save_pretrained(folder)
    return folder


def save_adapters(base: Any, root: Path) -> dict[str, str]:
    """Every adapter of `ADAPTERS` saved under `root/<id>`: id -> folder."""
    return {name: str(save_adapter(base, root / name, s, i)) for i, (name, s) in enumerate(ADAPTERS.items())}

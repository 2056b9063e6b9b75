"""Fused-speculation models built the documented way, for the end-to-end and XLA tests.

`fused_config(target, draft, **neuron_config)` (`eagle_config` with an EAGLE draft): the target's
NeuronConfig (fused speculation on, speculation_length `K`, greedy on-device sampling by default),
the draft's a deep copy of it with enable_fused_speculation=False (as NxDI's example makes it), and
`config.fused_spec_config = FusedSpecNeuronConfig(NeuronLlamaForCausalLM._model_cls, draft_config=...,
draft_model_path=...)`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tests.support.engine_fixtures import SEQ_LEN

K = 4
"""speculation_length of the fused models."""


def speculating_checkpoints(root: Path, *, medusa_heads: int = 3) -> tuple[Path, Path, Path]:
    """Random tiny checkpoints under `root`: the tiny llama (with `medusa_heads` Medusa heads beside
    it), a one-layer llama draft, and an EAGLE draft of the llama: (target, draft, EAGLE draft)."""
    from nxdi.testing import checkpoints
    from nxdi.testing import eagle as reference
    from nxdi.testing import medusa as testing_medusa

    fmt = checkpoints.SaveFormat.SAFETENSORS
    hf = checkpoints.build_model("llama", seed=0)
    target = checkpoints.save_checkpoint(hf, root / "target", fmt)
    testing_medusa.save_medusa_heads(testing_medusa.random_medusa_heads(hf.config, medusa_heads, seed=1), target)
    draft, _ = checkpoints.build_checkpoint(root / "draft", "llama", fmt, seed=7, num_hidden_layers=1)
    eagle = reference.save_eagle_draft(reference.from_target(hf, seed=3), hf.lm_head.weight, root / "eagle")
    return target, draft, eagle


def fused_config(target: Path, draft: Path, **kwargs: Any) -> Any:
    """A LlamaInferenceConfig of the target at `target` fused with the draft at `draft`."""
    import nxdi
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import FusedSpecNeuronConfig, load_pretrained_config

    lm = nxdi.NeuronLlamaForCausalLM
    settings = {
        "torch_dtype": "float32",
        "seq_len": SEQ_LEN,
        "speculation_length": K,
        "enable_fused_speculation": True,
        "on_device_sampling_config": {"top_k": 1},
        **kwargs,
    }
    neuron_config = NeuronConfig(**settings)
    config = lm.get_config_cls()(neuron_config, load_config=load_pretrained_config(target))
    draft_neuron_config = copy.deepcopy(neuron_config)
    draft_neuron_config.enable_fused_speculation = False
    draft_config = lm.get_config_cls()(draft_neuron_config, load_config=load_pretrained_config(draft))
    config.fused_spec_config = FusedSpecNeuronConfig(
        lm._model_cls, draft_config=draft_config, draft_model_path=str(draft)
    )
    return config


def eagle_config(target: Path, draft: Path, **kwargs: Any) -> Any:
    """`fused_config` for EAGLE, as the feature guide's example makes it: the target's NeuronConfig
    also sets enable_eagle_speculation=True, and the draft's (its deep copy) is_eagle_draft=True
    after enable_fused_speculation=False; `draft` is an EAGLE draft folder."""
    config = fused_config(target, draft, enable_eagle_speculation=True, **kwargs)
    config.fused_spec_config.draft_config.neuron_config.is_eagle_draft = True
    return config

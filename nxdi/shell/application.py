"""NeuronApplicationBase: config, weights, and the compile / load / to_cpu life cycle.

`to_cpu()` builds a runtime in memory; `compile(path)` writes the artifacts (configuration,
programs, weights) and `load(path)` brings them back without tracing again.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar

import torch

from nxdi.core import weights as weight_plans
from nxdi.core.model_spec import ModelSpec
from nxdi.core.neuron_checks import cpu_inert_flags
from nxdi.core.neuron_spec import NeuronSpec
from nxdi.core.programs import families, weight_ops
from nxdi.effects import engine
from nxdi.effects import weights as weight_io
from nxdi.effects.runtime import Runtime
from nxdi.shell.config import NeuronConfig
from nxdi.shell.errors import IncompatibleConfigError, unwrap_checkpoint, unwrap_or_raise
from nxdi.shell.inference_config import InferenceConfig


class NeuronApplicationBase:
    """An application model: a config, a checkpoint, and the compiled sub-models that run it.

    Args:
        model_path: the Hugging Face checkpoint folder (or a compiled-model folder, whose
            neuron_config.json supplies the config when `config` is None).
        config: the InferenceConfig; loaded from `model_path` when None.
        neuron_config: replaces `config.neuron_config` when given.

    Raises:
        IncompatibleConfigError: the configuration cannot run on this backend (every problem listed).
    """

    _STATE_DICT_MODEL_PREFIX: ClassVar[str] = weight_plans.STATE_DICT_MODEL_PREFIX
    _NEW_STATE_DICT_MODEL_PREFIX: ClassVar[str] = weight_plans.NEW_STATE_DICT_MODEL_PREFIX

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: InferenceConfig | None = None,
        neuron_config: NeuronConfig | None = None,
    ) -> None:
        if config is None:
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.model_path = str(model_path)
        self.model_spec: ModelSpec = config.model_spec()
        self.family = unwrap_or_raise(families.family_for(self.model_spec), "This model cannot run on the CPU backend")
        self.is_compiled = False
        self.is_loaded_to_neuron = False
        self._runtime: Runtime | None = None
        inert = cpu_inert_flags(self.neuron_config.spec)
        if inert:
            warnings.warn(f"Neuron-only settings have no effect on the CPU backend: {', '.join(inert)}", stacklevel=2)

    # --- configuration ---------------------------------------------------------------------
    @property
    def neuron_config(self) -> NeuronConfig:
        return self.config.neuron_config

    @property
    def spec(self) -> NeuronSpec:
        return self.config.neuron_config.spec

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return InferenceConfig

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        """Require a neuron_config, and reject what the CPU engine cannot run yet (all listed)."""
        if getattr(config, "neuron_config", None) is None:
            raise IncompatibleConfigError("neuron_config: is required but missing from the InferenceConfig")
        from nxdi.core.errors import ConfigError, Problem

        spec = config.neuron_config.spec
        unsupported = [
            Problem.of(name, getattr(spec, name), "is not supported by the CPU engine yet", fix)
            for name, bad, fix in (
                ("tp_degree", spec.tp_degree > 1, "use tp_degree=1 on the CPU backend"),
                ("speculation_length", spec.speculation_length > 0, "set speculation_length=0"),
                ("is_medusa", spec.is_medusa, "set is_medusa=False"),
                ("kv_cache_quant", spec.kv_cache_quant or spec.kv_quant_config is not None, "turn KV quantization off"),
                ("quantized", spec.quantized, "use an unquantized checkpoint"),
                ("lora_config", spec.lora_config is not None, "drop lora_config"),
                ("is_block_kv_layout", spec.is_block_kv_layout, "use the contiguous KV layout"),
                ("token_generation_batches", spec.token_generation_batches is not None, "drop batch buckets"),
            )
            if bad
        ]
        if unsupported:
            error = ConfigError(problems=tuple(unsupported))
            raise IncompatibleConfigError(error.render("Unsupported on the CPU backend"), error)

    def get_compiler_args(self) -> str | None:
        """Extra neuronx-cc arguments; none by default."""
        return None

    # --- weights -----------------------------------------------------------------------------
    def _weight_plan(self) -> weight_plans.WeightPlan:
        plan = weight_plans.weight_plan_for(
            self.model_spec,
            fused_qkv=self.spec.fused_qkv,
            cast_type=self.spec.cast_type,
            torch_dtype=self.spec.torch_dtype,
            model_prefix=self._STATE_DICT_MODEL_PREFIX,
            new_prefix=self._NEW_STATE_DICT_MODEL_PREFIX,
        )
        return unwrap_or_raise(plan)

    @classmethod
    def get_state_dict(cls, model_path: str | os.PathLike[str], config: InferenceConfig) -> dict[str, torch.Tensor]:
        """The checkpoint at `model_path` converted to nxdi names, fused and cast per `config`.

        Raises:
            CheckpointValidationError: missing, unexpected or misshapen tensors (all listed).
            FileNotFoundError / ValueError: no checkpoint, or an unreadable, corrupt or unsafe file.
        """
        app = cls.__new__(cls)
        app.config, app.model_spec = config, config.model_spec()
        return unwrap_checkpoint(weight_io.get_state_dict(model_path, app._weight_plan()))

    @classmethod
    def convert_hf_to_neuron_state_dict(
        cls, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """An in-memory Hugging Face state dict (keys as stored) converted like `get_state_dict`."""
        app = cls.__new__(cls)
        app.config, app.model_spec = config, config.model_spec()
        return unwrap_checkpoint(weight_ops.convert(app._weight_plan(), state_dict))

    def _load_weights(self, source: str | os.PathLike[str]) -> Any:
        tensors = self.get_state_dict(source, self.config)
        return self.family.weights.from_tensors(tensors, spec=self.model_spec)

    # --- life cycle ----------------------------------------------------------------------------
    def to_cpu(self) -> None:
        """Load the weights and run eagerly on the CPU, writing no artifacts."""
        self._runtime = engine.build_runtime(
            self.model_spec, self.spec, self.family, self._load_weights(self.model_path)
        )
        self.is_loaded_to_neuron = True

    def reset(self) -> None:
        """Reset the model state; nothing by default."""

    @staticmethod
    def load_hf_model(model_path: str | os.PathLike[str]) -> Any:
        """The equivalent transformers model, for accuracy checks."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path)

    def _require_runtime(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__} is not loaded: call load(compiled_model_path) or to_cpu() first")
        return self._runtime

    def __repr__(self) -> str:
        state = "loaded" if self._runtime is not None else "compiled" if self.is_compiled else "not loaded"
        return f"{type(self).__name__}({self.model_path!r}, {state})"

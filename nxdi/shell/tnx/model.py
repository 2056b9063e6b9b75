"""`SamplingModel`: transformers-neuronx's `*ForSampling` life cycle on an nxdi causal LM.

`from_pretrained(path, batch_size=, n_positions=, tp_degree=, amp=, context_length_estimate=,
neuron_config=)` builds the family's nxdi model (`nxdi.MODEL_TYPES[model_type]`) with the
equivalent nxdi NeuronConfig: `amp` is `torch_dtype`, `n_positions` is `seq_len` (a list: the
token-generation buckets), `context_length_estimate` the context-encoding buckets, and the
transformers-neuronx `NeuronConfig` maps as `nxdi.shell.tnx.config` declares. `to_neuron()`
compiles into a private folder and loads it (or loads the folder given to `load()` / saved with
presharded weights); `save(dir)` copies the compiled folder there; `sample()` runs
`nxdi.shell.tnx.loop`. There is one engine: the nxdi model is `self.nxdi_model`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from nxdi.core import families
from nxdi.shell import hf_configs, models
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.tnx import arguments, loop
from nxdi.shell.tnx.config import GenerationConfig, NeuronConfig

_MANIFEST = "manifest.json"
"""A file every compiled nxdi folder has (a folder `save()` wrote)."""


def _model_type(path: Path) -> str:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}/config.json: no Hugging Face checkpoint there. nxdi reads local folders only; "
            "download the model to a folder (e.g. with huggingface_hub.snapshot_download) and pass its path"
        )
    return str(hf_configs.read_json(path).get("model_type"))


class SamplingModel:
    """A transformers-neuronx model class (`LlamaForSampling`, ...): build with `from_pretrained`.

    Attributes:
        nxdi_model: the nxdi causal LM that runs it (NxDI's API: forward, compile, load, ...).
        neuron_config: the transformers-neuronx NeuronConfig it was built with.
    """

    _model_types: ClassVar[tuple[str, ...] | None] = None
    """The HF model_types the class loads; None: any runnable family (`NeuronAutoModelForCausalLM`)."""

    def __init__(
        self,
        nxdi_model: NeuronBaseForCausalLM,
        *,
        neuron_config: NeuronConfig,
        prompt_batch_size: int | None = None,
        artifacts: str | None = None,
    ) -> None:
        self.nxdi_model = nxdi_model
        self.neuron_config = neuron_config
        self.prompt_batch_size = prompt_batch_size
        self._artifacts = artifacts
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._compiled: str | None = None
        generation = neuron_config.on_device_generation
        self._rows = None if generation is None else generation.rows(self.batch_size)

    @property
    def batch_size(self) -> int:
        return self.nxdi_model.spec.batch_size

    @property
    def config(self) -> Any:
        """The model's attributes (NxDI's InferenceConfig: `config.eos_token_id`, ...)."""
        return self.nxdi_model.config

    # --- building ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_path: str | os.PathLike[str],
        *,
        batch_size: int = 1,
        n_positions: int | list[int] = 2048,
        tp_degree: int = 1,
        amp: str = "f32",
        context_length_estimate: int | list[int] | None = None,
        neuron_config: NeuronConfig | None = None,
        prompt_batch_size: int | None = None,
        **unsupported: Any,
    ) -> SamplingModel:
        """Build the model of the checkpoint folder `pretrained_model_path` (a HF folder, or one
        `save(dir, sharded_weights=True)` wrote). `tp_degree` defaults to 1 (transformers-neuronx: 2;
        on the CPU each rank is a process). `prompt_batch_size` lets prompts of that batch size
        each give `batch_size // prompt_batch_size` outputs.

        Raises:
            FileNotFoundError: no config.json in the folder (hub ids are not downloaded).
            IncompatibleConfigError: another class's model_type, a family nxdi does not run yet
                (named), an unknown keyword, or settings nxdi refuses (all listed).
        """
        path = Path(pretrained_model_path)
        model_type = _model_type(path)
        record = cls._record(model_type)
        if cls._model_types is None:  # NeuronAutoModelForCausalLM: the family's own class
            names = importlib.import_module("nxdi.shell.tnx.families").names_for(model_type)
            if names:
                cls = getattr(importlib.import_module("nxdi.shell.tnx.families"), names[0])
        tnx_config = neuron_config if neuron_config is not None else NeuronConfig()
        if not isinstance(tnx_config, NeuronConfig):
            raise IncompatibleConfigError(
                f"neuron_config={type(tnx_config).__name__}: pass transformers-neuronx's NeuronConfig "
                "(nxdi.shell.tnx.NeuronConfig), not nxdi's"
            )
        kwargs = arguments.nxdi_kwargs(
            tnx_config,
            problems=[f"{k}={v!r}: is not a from_pretrained argument" for k, v in unsupported.items()],
            batch_size=batch_size,
            n_positions=n_positions,
            tp_degree=tp_degree,
            amp=amp,
            context_length_estimate=context_length_estimate,
            prompt_batch_size=prompt_batch_size,
        )
        causal_lm = models.MODEL_TYPES[model_type]["causal-lm"]
        config_cls = causal_lm.get_config_cls()
        workdir = None
        if tnx_config.quant is not None:
            workdir = tempfile.TemporaryDirectory(prefix="nxdi-tnx-")
            kwargs["quantized_checkpoints_path"] = workdir.name
        neuron = config_cls.get_neuron_config_cls()(**kwargs)
        nxdi_config = config_cls(neuron, load_config=load_pretrained_config(str(path)))
        arguments.report(tnx_config, nxdi_config, record.name)
        saved = path if (path / _MANIFEST).is_file() else None
        model = cls(
            causal_lm(str(path), nxdi_config),
            neuron_config=tnx_config,
            prompt_batch_size=prompt_batch_size,
            artifacts=None if saved is None else str(saved),
        )
        model._workdir = workdir
        return model

    @classmethod
    def _record(cls, model_type: str) -> families.FamilyRecord:
        if cls._model_types is not None and model_type not in cls._model_types:
            raise IncompatibleConfigError(
                f"{cls.__name__} loads model_type {' / '.join(cls._model_types)}, not {model_type!r}. "
                "Fix: use that family's class, or NeuronAutoModelForCausalLM"
            )
        record = families.by_model_type().get(model_type)
        if record is None or not record.runnable:
            runs = ", ".join(sorted(t for r in families.runnable() for t in r.model_types))
            raise IncompatibleConfigError(
                f"model_type {model_type!r} does not run on the nxdi engine yet (no program for it); "
                f"{cls.__name__} works once it does. Runnable model types: {runs}"
            )
        return record

    # --- compile, load, save ----------------------------------------------------------------
    def to_neuron(self) -> None:
        """Compile and load (or, after `load(dir)` or for a saved folder, load only).

        Raises: as nxdi's `compile()` and `load()` (e.g. `ArtifactIntegrityError` when the folder
        given to `load()` was compiled for another configuration)."""
        if self._artifacts is not None:
            self.nxdi_model.load(self._artifacts)
            self._compiled = self._artifacts
            return
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="nxdi-tnx-")
        spec = self.nxdi_model.spec
        if spec.quantized and not any(Path(self._workdir.name).glob("*.safetensors")):
            type(self.nxdi_model).save_quantized_state_dict(self.nxdi_model.model_path, self.nxdi_model.config)
        compiled = str(Path(self._workdir.name) / "compiled")
        self.nxdi_model.compile(compiled)
        self.nxdi_model.load(compiled)
        self._compiled = compiled

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Use the compiled folder `directory` (written by `save`): `to_neuron()` then loads it
        instead of compiling."""
        if not (Path(directory) / _MANIFEST).is_file():
            raise FileNotFoundError(f"{directory}: no compiled model there (no {_MANIFEST}); save(dir) writes one")
        self._artifacts = str(directory)

    def save(self, directory: str | os.PathLike[str], sharded_weights: bool = False) -> None:
        """Write the compiled model to `directory`. With `sharded_weights=True` (always for int8
        weights) the converted weights go there too, with the checkpoint's config.json, so that
        `from_pretrained(directory)` then `to_neuron()` reads neither the original checkpoint nor
        compiles.

        Raises:
            RuntimeError: nothing compiled yet (call `to_neuron()` first).
        """
        if self._compiled is None:
            raise RuntimeError(f"{type(self).__name__}.save(): nothing is compiled yet; call to_neuron() first")
        target = Path(directory)
        if target.resolve() != Path(self._compiled).resolve():
            shutil.copytree(self._compiled, target, dirs_exist_ok=True)
        if sharded_weights or self.nxdi_model.spec.quantized:
            self.nxdi_model.shard_weights(target)
            data = {k: v for k, v in self.nxdi_model.config.hf_dict().items() if not k.startswith("_")}
            (target / "config.json").write_text(json.dumps(data, indent=2, default=str) + "\n")

    def enable_speculative_decoder(self, speculation_length: int | list[int], batch_sizes: Any = None) -> None:
        """Compile speculation programs that score `speculation_length` tokens per step (nxdi's
        `speculation_length`), for `SpeculativeGenerator`. Call before `to_neuron()`.

        Raises:
            IncompatibleConfigError: after to_neuron(), several lengths, or other batch sizes.
        """
        lengths = speculation_length if isinstance(speculation_length, list) else [speculation_length]
        problems = []
        if self._compiled is not None or self._artifacts is not None:
            problems.append("the model is already compiled or loaded: call it before to_neuron() / load()")
        if len(lengths) != 1:
            problems.append(f"speculation_length={speculation_length!r}: nxdi compiles one speculation length")
        if batch_sizes not in (None, self.batch_size, [self.batch_size]):
            problems.append(f"batch_sizes={batch_sizes!r}: the model's batch_size is {self.batch_size}")
        if problems:
            raise IncompatibleConfigError("enable_speculative_decoder(): " + "; ".join(problems))
        config = self.nxdi_model.config
        config.neuron_config.speculation_length = lengths[0]  # re-validated by nxdi's NeuronConfig
        self.nxdi_model = type(self.nxdi_model)(self.nxdi_model.model_path, config)

    # --- generation -------------------------------------------------------------------------
    def update_generation_config(self, generation_config: GenerationConfig) -> None:
        """New on-device sampling parameters for the next `sample()` calls (needs `dynamic=True`;
        per-row lists need `per_batch_line=True`).

        Raises:
            IncompatibleConfigError: no on_device_generation, dynamic=False, or bad values (named).
        """
        current = self.neuron_config.on_device_generation
        if current is None or not (current.dynamic or current.per_batch_line):
            raise IncompatibleConfigError(
                "update_generation_config(): the model was built without on_device_generation=GenerationConfig("
                "dynamic=True); its sampling parameters are fixed. Fix: build it with dynamic=True"
            )
        problems = generation_config.problems(self.batch_size)
        if isinstance(generation_config, GenerationConfig) and generation_config.do_sample != current.do_sample:
            problems.append(f"do_sample={generation_config.do_sample}: the model was built with {current.do_sample}")
        sampling = self.nxdi_model.spec.on_device_sampling_config
        cap = 0 if sampling is None else sampling.global_topk  # what the compiled sampler keeps
        top_k = generation_config.top_k if isinstance(generation_config.top_k, list) else [generation_config.top_k]
        if cap and any(k > cap for k in top_k):
            problems.append(f"top_k={generation_config.top_k!r}: exceeds the compiled global_top_k={cap}")
        if problems:
            raise IncompatibleConfigError("update_generation_config(): " + "; ".join(problems))
        self._rows = generation_config.rows(self.batch_size)

    def sample(
        self,
        input_ids: Tensor,
        sequence_length: int,
        start_ids: Tensor | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_override: int | None = None,
        temperature: float | None = None,
        streamer: Any = None,
        stopping_criteria_list: Any = None,
        no_repeat_ngram_size: int | None = None,
        **unsupported: Any,
    ) -> Tensor:
        """Generate from `input_ids` [B, W] until each row has `sequence_length` tokens (or EOS, or
        the stopping criteria stop it); returns [B, <= sequence_length] ids, prompts included.

        Args:
            start_ids: [B] with continuous batching, each row's sequence slot; otherwise each row's
                count of left-padding tokens (0 when None).
            top_k, top_p, temperature: host sampling (defaults 50, 1.0, 1.0; top_k=1 is greedy).
                With on_device_generation the GenerationConfig decides; a different value is refused.
            streamer: gets `put(tokens [B, 1])` per step and `end()`.
            stopping_criteria_list: called `(input_ids, probs)` after each step; True stops.
            no_repeat_ngram_size: ban tokens that would repeat an n-gram of that size.

        Raises:
            IncompatibleConfigError: unknown arguments, a sequence_length past n_positions, bad
                sampling values, or host sampling options under on-device generation (named).
        """
        model = self.nxdi_model
        if self.prompt_batch_size is not None and input_ids.shape[0] == self.prompt_batch_size:
            input_ids = input_ids.repeat_interleave(self.batch_size // self.prompt_batch_size, dim=0)
        problems = [f"{k}={v!r}: is not a sample() argument" for k, v in unsupported.items()]
        if sequence_length > model.spec.seq_len:
            problems.append(f"sequence_length={sequence_length}: exceeds n_positions={model.spec.seq_len}")
        width = input_ids.shape[1]
        mask = torch.ones_like(input_ids)
        extra: dict[str, Any] = {}
        if start_ids is not None and model.spec.is_continuous_batching:
            extra["seq_ids"] = torch.as_tensor(start_ids, dtype=torch.int32).reshape(-1)
        elif start_ids is not None:
            pads = torch.as_tensor(start_ids, dtype=torch.int64).reshape(-1, 1)
            mask = (torch.arange(width)[None, :] >= pads).to(input_ids.dtype)
            longest = model.spec.max_context_length
            if width > longest and bool((pads >= longest).any()):
                problems.append(
                    f"start_ids={pads.reshape(-1).tolist()}: a row's padding fills the whole first {longest} tokens "
                    "(the largest context_length_estimate) that are encoded in parallel; pad less, or raise it"
                )
        generation = self.neuron_config.on_device_generation
        if generation is not None:
            pick: loop.Pick = loop.device_pick
            given = {"top_k": top_k, "top_p": top_p, "temperature": temperature}
            for name, value in given.items():
                if value is not None and value != getattr(generation, name):
                    problems.append(
                        f"{name}={value!r}: the model samples on device with on_device_generation.{name}="
                        f"{getattr(generation, name)!r}; change it with update_generation_config (dynamic=True)"
                    )
            if no_repeat_ngram_size:
                problems.append(
                    f"no_repeat_ngram_size={no_repeat_ngram_size}: the model samples on device, where n-grams "
                    "are not filtered. Fix: build the model without on_device_generation"
                )
            extra["sampling_params"] = torch.tensor(self._rows, dtype=torch.float32)
        else:
            k = 50 if top_k is None else top_k
            p = 1.0 if top_p is None else top_p
            t = 1.0 if temperature is None else temperature
            problems += arguments.sampling_problems(
                top_k=k, top_p=p, temperature=t, no_repeat_ngram_size=no_repeat_ngram_size
            )
            pick = loop.host_pick(top_k=k, top_p=p, temperature=t, no_repeat_ngram_size=no_repeat_ngram_size)
        if problems:
            raise IncompatibleConfigError(f"{type(self).__name__}.sample(): " + "; ".join(problems))
        eos = self.config.hf_dict().get("eos_token_id") if eos_token_override is None else eos_token_override
        if generation is not None and generation.eos_token_id is not None and eos_token_override is None:
            eos = generation.eos_token_id
        return loop.run(
            model,
            input_ids,
            mask,
            sequence_length=sequence_length,
            pick=pick,
            eos_token_id=eos,
            streamer=streamer,
            stopping_criteria_list=stopping_criteria_list,
            step_kwargs=extra,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.nxdi_model!r})"


class NeuronAutoModelForCausalLM(SamplingModel):
    """Picks the family from the checkpoint's `model_type` (any family nxdi runs)."""

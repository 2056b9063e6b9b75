"""NeuronApplicationBase: config, weights, and the compile / load / to_cpu life cycle.

`to_cpu()` builds a runtime in memory; `compile(path)` writes the artifacts (configuration,
programs, weights) and `load(path)` brings them back without tracing again. With tp_degree > 1 the
ranks run in rank processes this process starts (or, under torchrun, this process is one rank);
`close()` stops them.

(Over 400 lines: it is the documented class, whose every method the seeds name; the work each does
is in `nxdi.effects` and `nxdi.core`, and what stays here is argument checking and docstrings.)
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch

from nxdi.core import eagle_layout, graph_key
from nxdi.core import weight_plan as weight_plans
from nxdi.core.config import cpu_support
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ArtifactError, Problem, problems_of, problems_result
from nxdi.core.host import weight_ops
from nxdi.core.host.quant import config as quant_config
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import host_memory, medusa, partition, rank_weights
from nxdi.core.planning import lora as lora_plan
from nxdi.core.programs import catalog
from nxdi.effects import backends, engine, fused_engine, medusa_heads, quantized_checkpoint, staging
from nxdi.effects import env as env_mod
from nxdi.effects import memory as host_mem
from nxdi.effects import weight_loader as weight_io
from nxdi.effects.backends.base import Backend
from nxdi.effects.distributed import launch
from nxdi.effects.runtime import StepRuntime
from nxdi.shell import fused_speculation, inner_model, lora_dynamic
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError, exception_for, unwrap
from nxdi.shell.inference_config import CONFIG_FILE, InferenceConfig
from nxdi.shell.inner_model import NeuronBaseModel


class NeuronApplicationBase:
    """An application model: a config, a checkpoint, and the compiled sub-models that run it.

    Args:
        model_path: the Hugging Face checkpoint folder (or a compiled-model folder, whose
            neuron_config.json supplies the config when `config` is None).
        config: the InferenceConfig; loaded from `model_path` when None.
        neuron_config: replaces `config.neuron_config` when given.
        backend: the backend to compile and run on, `cpu`, `xla` or `neuron` (nxdi's extension;
            default: `NXDI_BACKEND`, else cpu).

    Raises:
        IncompatibleConfigError: the configuration cannot run on this backend (every problem listed).
        ArtifactIntegrityError: `config` is None and the folder's neuron_config.json is unreadable.
    """

    _config_cls: ClassVar[type[InferenceConfig]] = InferenceConfig
    """What `get_config_cls` returns (the family's InferenceConfig for `nxdi.shell.models` classes)."""
    _model_cls: ClassVar[type[NeuronBaseModel]] = NeuronBaseModel
    """The inner model: the config bound to the program that runs it (`nxdi.shell.inner_model`; the
    family's `Neuron<Family>Model` for `nxdi.shell.models` classes). Clients pass it on as NxDI's
    `FusedSpecNeuronConfig(worker_cls=...)`."""
    _STATE_DICT_MODEL_PREFIX: ClassVar[str] = weight_plans.STATE_DICT_MODEL_PREFIX
    _NEW_STATE_DICT_MODEL_PREFIX: ClassVar[str] = weight_plans.NEW_STATE_DICT_MODEL_PREFIX

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: InferenceConfig | None = None,
        neuron_config: NeuronConfig | None = None,
        *,
        backend: str | None = None,
    ) -> None:
        self._backend_name = backend
        if config is None:
            config = self._read_config(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.model_path = str(model_path)
        self.model_spec: ModelSpec = config.model_spec()
        self.program = self._program_of(config)
        self.is_compiled = False
        self.is_loaded_to_neuron = False
        self._runtime: StepRuntime | None = None
        self._fused = fused_speculation.FusedModel(self) if self.spec.enable_fused_speculation else None
        lora_cfg = self.spec.lora_config
        dynamic = lora_cfg is not None and lora_cfg.dynamic_multi_lora
        self._lora_dynamic = lora_dynamic.DynamicAdapters(self.spec, self.model_spec) if dynamic else None
        """With dynamic_multi_lora: the host adapters and the device slots (`nxdi.shell.lora_dynamic`)."""
        """With enable_fused_speculation: the draft fused with this model, whose compile, load and
        weights go through it (`nxdi.shell.fused_speculation`)."""
        if self.spec.speculation_length > 0 and self.spec.async_mode and self._fused is None:
            # Said of a model, not of a config: a fused pair's draft config (a copy of its target's
            # with enable_fused_speculation=False) never runs on its own.
            warnings.warn(
                "async_mode launches only single-token decode steps ahead (nxdi.core.host.async_steps); this "
                "model's speculation steps (k tokens per row) run synchronously. Fused speculation "
                "(enable_fused_speculation=True) launches whole speculation steps ahead",
                stacklevel=2,
            )
        inert = self.neuron_config._without_effect_on_cpu()
        if inert:
            warnings.warn(
                f"These settings have no effect on the CPU backend: {', '.join(inert)} "
                "(`nxdi config --list` says why for each)",
                stacklevel=2,
            )

    # --- configuration ---------------------------------------------------------------------
    @property
    def neuron_config(self) -> NeuronConfig:
        return self.config.neuron_config

    @property
    def spec(self) -> NeuronSpec:
        return self.config.neuron_config.spec

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        """The InferenceConfig class of this model (`LlamaInferenceConfig` for `NeuronLlamaForCausalLM`)."""
        return cls._config_cls

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        """The NeuronConfig class of this model: its config class's (`LlamaNeuronConfig`,
        `MoENeuronConfig` for a MoE family, else `NeuronConfig`), as a serving client builds it first."""
        return cls.get_config_cls().get_neuron_config_cls()

    @classmethod
    def _read_config(cls, model_path: str | os.PathLike[str]) -> InferenceConfig:
        """The config saved in the folder `model_path` (by compile()).

        Raises:
            FileNotFoundError: the folder holds no neuron_config.json.
            ArtifactIntegrityError: it cannot be read as a configuration of this nxdi (bytes that are
                not text, not JSON, values of the wrong type...), naming the file.
        """
        try:
            return cls.get_config_cls().load(model_path)
        except FileNotFoundError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, AssertionError) as e:
            path = Path(model_path) / CONFIG_FILE
            why = f"cannot be read as a configuration ({type(e).__name__}: {' '.join(str(e).split())})"
            fix = "compile the model into this folder again, or pass config="
            error = ArtifactError(problems=(Problem.of(str(path), "<unreadable>", why, fix),))
            raise exception_for(error) from e

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        """Require a neuron_config, and reject what the CPU engine cannot run (all listed): settings it
        does not implement yet, ranks it cannot lay out (heads over tp_degree, sequence-parallel
        buckets), a fused-speculation draft that does not fit the target (`fused_speculation.check_config`),
        LoRA target modules the model lacks (`lora_plan.layout_for`), and blockwise scale blocks a rank's
        share of a weight would cut (`rank_weights.block_problems`)."""
        if getattr(config, "neuron_config", None) is None:
            raise IncompatibleConfigError("neuron_config: is required but missing from the InferenceConfig")
        spec = config.neuron_config.spec
        problems = (
            problems_of(cpu_support.check_cpu_support(spec), partition.check_partition(config.model_spec(), spec))
            + fused_speculation.check_config(config)
            + tuple(medusa.model_problems(config.model_spec(), spec))
            + _lora_problems(config.model_spec(), spec)
        )
        if not problems and spec.quantized and spec.tp_degree > 1:  # a rank's share of a weight cutting scale blocks
            shard = partition.program_shard_plan(config.model_spec(), spec).unwrap()
            problems = rank_weights.block_problems(cls._weight_plan(config), shard)
        unwrap(problems_result(spec, problems), "Cannot run on the CPU backend")

    def get_compiler_args(self) -> str | None:
        """Extra neuronx-cc arguments; none by default."""
        return None

    # --- weights -----------------------------------------------------------------------------
    @staticmethod
    def _program_of(config: InferenceConfig) -> catalog.Program:
        """The program of the config's model (IncompatibleConfigError when none runs it)."""
        return inner_model.program_of(config)

    @classmethod
    def _weight_plan(cls, config: InferenceConfig, spec: NeuronSpec | None = None) -> weight_plans.WeightPlan:
        """The plan that converts a checkpoint of `config`'s model into its program's weights (the
        quantized checkpoint's layout with `quantized=True`, an EAGLE draft's with `is_eagle_draft`);
        `spec` in place of `config.neuron_config.spec` (a fused draft's, as its pair runs it)."""
        spec = config.neuron_config.spec if spec is None else spec
        draft = eagle_layout.eagle_draft_for(
            is_eagle_draft=spec.is_eagle_draft,
            input_norm=spec.enable_eagle_draft_input_norm,
            fc_bias=bool(getattr(config, "fc_bias", False)),
        )
        plan = weight_plans.weight_plan_for(
            cls._program_of(config).table,
            config.model_spec(),
            cast_type=spec.cast_type,
            torch_dtype=spec.torch_dtype,
            model_prefix=cls._STATE_DICT_MODEL_PREFIX,
            new_prefix=cls._NEW_STATE_DICT_MODEL_PREFIX,
            quant=weight_plans.weight_quant(spec),
            eagle_draft=draft,
        )
        return unwrap(plan)

    @classmethod
    def get_state_dict(cls, model_path: str | os.PathLike[str], config: InferenceConfig) -> dict[str, torch.Tensor]:
        """The checkpoint at `model_path` converted to nxdi names, fused and cast per `config`.

        Raises:
            CheckpointValidationError: missing, unexpected or misshapen tensors (all listed).
            FileNotFoundError / ValueError: no checkpoint, or an unreadable, corrupt or unsafe file.
        """
        return unwrap(weight_io.get_state_dict(model_path, cls._weight_plan(config)))

    @classmethod
    def save_quantized_state_dict(cls, model_path: str | os.PathLike[str], config: InferenceConfig) -> None:
        """Quantize the checkpoint at `model_path` per `config.neuron_config` (quantization_type,
        quantization_dtype, block settings, modules_to_not_convert) and write it to
        `quantized_checkpoints_path`: `model.safetensors` inside it when it is an existing folder,
        else a torch pickle file at that path (the reference's behaviour). Compile and load then read it.
        A multimodal checkpoint (Gemma 3) gives its language model only, saved in the text model's layout.

        Raises:
            IncompatibleConfigError: quantized_checkpoints_path is unset or names a file of the
                source checkpoint, or the scheme cannot quantize a weight (all listed).
            FileNotFoundError / ValueError: no checkpoint at `model_path`, or an unreadable file.
        """
        spec = config.neuron_config.spec
        program = cls._program_of(config)  # a model nxdi runs
        unwrap(quant_config.save_config(spec), "Cannot save a quantized checkpoint")
        scheme = unwrap(quant_config.scheme(spec), "Cannot save a quantized checkpoint")
        cls._weight_plan(config)  # what would not read the quantized layout back is refused before writing
        saved = quantized_checkpoint.save_quantized(
            model_path,
            str(spec.quantized_checkpoints_path),
            scheme,
            spec.modules_to_not_convert,
            table=program.table,
            spec=config.model_spec(),
        )
        unwrap(saved, "Cannot save a quantized checkpoint")

    @classmethod
    def convert_hf_to_neuron_state_dict(
        cls, state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """An in-memory Hugging Face state dict (keys as stored) converted like `get_state_dict`."""
        return unwrap(weight_ops.convert(cls._weight_plan(config), state_dict))

    # --- life cycle ----------------------------------------------------------------------------
    def _engine_model(self) -> engine.EngineModel:
        return engine.EngineModel(program=self.program, model=self.model_spec, spec=self.spec)

    def _graph_key(self) -> str:
        key = graph_key.graph_key(self.spec, self.model_spec, extra=f"{type(self).__name__}/{self.program.record.name}")
        return key if self._fused is None else self._fused.graph_key(key)

    def _backend(self) -> Backend:
        """The backend given to the constructor, else the one `NXDI_BACKEND` names, else cpu."""
        name = self._backend_name or env_mod.read_env().backend or "cpu"
        try:
            return backends.backend_named(name, compiler_args=(self.get_compiler_args() or "").split())
        except ValueError as e:
            raise IncompatibleConfigError(f"{e}. Fix: unset it, or name one of {', '.join(backends.NAMES)}") from None

    def _source(self, path: str | os.PathLike[str]) -> engine.CheckpointSource:
        """The checkpoint at `path`, converted by this model's weight plan (NaN and inf weights
        accepted only with NXDI_ALLOW_NONFINITE_WEIGHTS=1)."""
        env = env_mod.read_env()
        for problem in env.problems:
            if problem.startswith("NXDI_ALLOW_NONFINITE_WEIGHTS"):
                warnings.warn(problem, stacklevel=3)
        allow = env.allow_nonfinite_weights
        heads = str(medusa_heads.heads_path(path)) if self.spec.is_medusa else None  # beside the original checkpoint
        if self.spec.quantized:  # the quantized checkpoint replaces the model's own weights
            problem = quantized_checkpoint.quant_problem(self.spec.quantized_checkpoints_path)
            if problem is not None:
                raise FileNotFoundError(problem.render())
            path = str(self.spec.quantized_checkpoints_path)
        plan = self._weight_plan(self.config)
        return engine.CheckpointSource(path=str(path), plan=plan, allow_nonfinite=allow, medusa_heads=heads)

    def _check_host_memory(self, backend: Backend | None) -> None:
        """Refuse, before anything is allocated, a model whose weights, KV cache and activations do
        not fit in the memory this host has available, when the host holds them (eager, or the cpu
        backend; `nxdi.core.planning.host_memory`).

        Raises:
            IncompatibleConfigError: they do not fit; the message gives every figure and the fix.
        """
        if backend is not None and backend.name != "cpu":
            return
        available = host_mem.available_bytes()
        need = host_memory.host_need_for(self.model_spec, self.spec)
        checked = need.bind(lambda n: host_memory.check_host_memory(n, self.spec, available))
        unwrap(checked, "Does not fit in host memory")

    def _open(self, root: str | os.PathLike[str] | None, checkpoint: str, *, warmup: bool) -> None:
        """Build the runtime (eager when `root` is None, else from the compiled folder), replacing
        any runtime this model had (its rank processes are stopped first)."""
        self.close()
        if root is not None:
            name = self._backend().name
            unwrap(cpu_support.check_backend_support(self.spec, name), f"Cannot run on the {name} backend")
        if root is not None and self.spec.is_block_kv_layout and self._backend().name != "cpu":
            raise IncompatibleConfigError(
                f"is_block_kv_layout=True runs on the cpu backend only yet, not {self._backend().name}: "
                "use the cpu backend, or the contiguous KV cache"
            )
        self._check_host_memory(None if root is None else self._backend())
        if self._lora_dynamic is not None:  # every host adapter read and checked before anything loads
            self._lora_dynamic.start()
        self._runtime = self._start_runtime(root, checkpoint, warmup=warmup)

    def _start_runtime(self, root: str | os.PathLike[str] | None, checkpoint: str, *, warmup: bool) -> StepRuntime:
        """Load the weights and programs (and warm them up): the runtime `_open` installs."""
        if self._fused is not None:
            backend = None if root is None else self._backend()
            return self._fused.start_runtime(
                root, checkpoint, backend=backend, graph_key=self._graph_key(), warmup=warmup
            )
        opened = launch.open_runtime(
            self._engine_model(),
            self._source(checkpoint),
            env_mod.read_env(),
            root=root,
            backend=self._backend(),
            graph_key=self._graph_key(),
            warmup=warmup,
        )
        return unwrap(opened)

    def to_cpu(self) -> None:
        """Load the weights and run the pure programs eagerly on the CPU, writing no artifacts.
        With tp_degree > 1 this starts the rank processes, each reading its slices of the checkpoint.

        Raises:
            CheckpointValidationError: missing, unexpected, misshapen or non-floating tensors, or
                tensors holding NaN or inf unless NXDI_ALLOW_NONFINITE_WEIGHTS=1 (all listed).
            IncompatibleConfigError: start_rank_id / local_ranks_size contradict how the process was started,
                or the weights, KV cache and activations do not fit in the host memory available.
            RankError: a rank process died or hung while starting.
        """
        self._open(None, self.model_path, warmup=False)
        self.is_loaded_to_neuron = True

    def close(self) -> None:
        """Stop the rank processes (tp_degree > 1) and drop the runtime; `load()` or `to_cpu()` again
        to run. Idempotent; garbage collection and interpreter exit do the same."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()
        self.is_loaded_to_neuron = False

    def __enter__(self) -> NeuronApplicationBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, compiled_model_path: str | os.PathLike[str], debug: bool = False) -> None:
        """Trace one program per sub-model and bucket and write the compiled-model folder.

        Writes `neuron_config.json`, `programs/*.pt2` (graphs only, no weights; one program per
        sub-model and bucket serves every rank), with `save_sharded_checkpoint` every rank's
        converted weights in `weights/tp{rank}_sharded_checkpoint.safetensors`, and last
        `manifest.json` with the sub-model, bucket and sha256 of every program. Programs whose graph
        key, sub-model, bucket and backend version are unchanged are reused, not traced again. The
        whole compile is written beside the folder and swapped in at the end, so an interrupted
        compile leaves the previous compile intact (or nothing, on a first compile), and other
        files in the folder stay. Compiles of one folder take turns: another process's compile or
        load of it is waited for (a warning names it; NXDI_LOCK_TIMEOUT limits the wait). Under
        torchrun, global rank 0 compiles while the other ranks wait. With `debug=True` the xla
        backend also writes
        each program's HLO text to `hlo/<program>.hlo.txt` in the folder; other backends keep no
        HLO, and warn.

        Before tracing, every byte of the checkpoint is read once: NaN and inf weights are refused
        (NXDI_ALLOW_NONFINITE_WEIGHTS=1 accepts them, with a warning naming them), and each file's
        name, size, mtime and sha256 are pinned in the manifest, so that `load()` refuses the
        checkpoint if it changes (when the weights are read from it).

        Raises:
            CheckpointValidationError: missing, unexpected, misshapen or non-floating tensors, or
                tensors holding NaN or inf (all listed); nothing is written then.
            IncompatibleConfigError: the rank settings contradict how the process was started, or
                the xla or neuron backend (one process for every rank) is asked for under torchrun,
                or with a quantized KV cache (cpu backend only), or (cpu backend) the loaded model
                would not fit in the host memory available.
            FolderLockedError: another process held the folder longer than NXDI_LOCK_TIMEOUT seconds.
        """
        root = Path(compiled_model_path)
        env = env_mod.read_env()
        backend = self._backend()
        supported = cpu_support.check_backend_support(self.spec, backend.name)
        unwrap(supported, f"Cannot run on the {backend.name} backend")
        unwrap(launch.check_placement(self._engine_model(), env, backend))
        self._check_host_memory(backend)  # what load() will refuse on this host is not compiled either
        hlo = debug and hasattr(backend, "hlo_text")
        if debug and not hlo:
            warnings.warn(f"debug=True: the {backend.name} backend keeps no HLO to write", stacklevel=2)

        def write() -> Any:
            # Everything lands in a build folder that replaces the compiled one as a whole.
            # Never carried over from the old folder: a compile writes its own (weights only with
            # save_sharded_checkpoint; an old folder's shards were made for another compile).
            owned = (CONFIG_FILE, "programs", "manifest.json", "hlo", "weights", fused_engine.DRAFT_SOURCE)
            with staging.building(root, timeout=_lock_timeout(env), on_wait=_waiting, owned=owned) as build:
                self.config.save(build.path)
                if self._fused is not None:  # the draft and this model in one program per bucket
                    compiled = self._fused.compile_into(
                        build.path,
                        backend=backend,
                        graph_key=self._graph_key(),
                        record=[CONFIG_FILE],
                        previous=build.target,
                    )
                else:
                    compiled = engine.compile_model(
                        build.path,
                        self._engine_model(),
                        self._source(self.model_path),
                        backend=backend,
                        graph_key=self._graph_key(),
                        save_weights=self.spec.save_sharded_checkpoint,
                        cache_dir=env.compile_cache_dir,
                        record=[CONFIG_FILE],
                        previous=build.target,
                    )
                result = unwrap(compiled)
                if hlo:
                    unwrap(engine.write_hlo(build.path, backend, build.path / "hlo"))
                return result

        self._last_compile = launch.once(self._engine_model(), env, write)
        self.is_compiled = True

    def shard_weights(self, compiled_model_path: str | os.PathLike[str]) -> None:
        """Write every rank's converted weights to `compiled_model_path/weights/tp{rank}_sharded_checkpoint.safetensors`,
        one rank at a time (each reads only its slices of the checkpoint; under torchrun, rank 0 writes).
        In a compiled folder they are listed in its manifest, and `load()` then reads them instead of
        the checkpoint; a later compile() replaces them (it writes its own only with save_sharded_checkpoint)."""
        model, source = self._engine_model(), self._source(self.model_path)

        env = env_mod.read_env()

        def write() -> None:
            lock = staging.writing(compiled_model_path, purpose="write weights", timeout=_lock_timeout(env))
            with lock as folder:
                if self._fused is not None:
                    self._fused.write_shards(folder)
                    return
                unwrap(engine.write_shards(folder, model, source))

        launch.once(model, env, write)

    def load(self, compiled_model_path: str | os.PathLike[str], *, repin_checkpoint: bool = False) -> None:
        """Load the compiled programs and the weights, without tracing; warm up unless skip_warmup.

        A folder compiled without save_sharded_checkpoint reads its weights from the original
        checkpoint, which compile() pinned (file names, sizes, sha256); a checkpoint changed since
        is refused. `repin_checkpoint=True` (nxdi's extension) accepts it as it is now: it is
        checked as compile() checks it (shapes, dtypes, every value) and pinned in the folder.

        Raises:
            FileNotFoundError: nothing is compiled at the path, or its weights are gone (the folder
                holds none and the original checkpoint is missing).
            ArtifactIntegrityError: a file is missing or altered, or the folder was compiled by
                another nxdi, for another configuration or backend version, or the original
                checkpoint it reads its weights from changed since (every problem named).
            CheckpointValidationError: the weights do not fit the compiled programs (with
                `repin_checkpoint`: also non-floating weights, or NaN or inf ones).
            IncompatibleConfigError: start_rank_id / local_ranks_size contradict how the process was started,
                or the weights, KV cache and activations do not fit in the host memory available.
            RankError: a rank process died or hung while loading.
            FolderLockedError: a compile held the folder longer than NXDI_LOCK_TIMEOUT seconds.
        """
        self._load(compiled_model_path, warmup=not self.spec.skip_warmup, repin=repin_checkpoint)

    def load_weights(self, compiled_model_path: str | os.PathLike[str], *, repin_checkpoint: bool = False) -> None:
        """(Re)load the compiled programs and the weights; the KV cache starts empty (no warm-up).

        Raises: as `load` (`repin_checkpoint` as there).
        """
        self._load(compiled_model_path, warmup=False, repin=repin_checkpoint)

    def _load(self, compiled_model_path: str | os.PathLike[str], *, warmup: bool, repin: bool = False) -> None:
        # Held shared while the folder is read: loads run together, a compile of it waits.
        timeout = _lock_timeout(env_mod.read_env())
        if repin:
            self._repin(compiled_model_path, timeout)
        with staging.reading(compiled_model_path, timeout=timeout, on_wait=_waiting):
            self._open(compiled_model_path, self.checkpoint_path, warmup=warmup)
        self.is_compiled = self.is_loaded_to_neuron = True

    def _repin(self, compiled_model_path: str | os.PathLike[str], timeout: float | None) -> None:
        """Check the original checkpoint as it is now and pin it in the folder's manifest (under
        the folder's exclusive lock; under torchrun, global rank 0 does it while the others wait)."""
        source = self._source(self.checkpoint_path)

        def write() -> None:
            lock = staging.writing(compiled_model_path, purpose="re-pin", timeout=timeout, on_wait=_waiting)
            with lock as folder:
                if self._fused is not None:
                    self._fused.repin(folder, self.checkpoint_path)
                    return
                unwrap(engine.repin_source(folder, self._engine_model(), source))

        launch.once(self._engine_model(), env_mod.read_env(), write)

    def set_seed(self, seed: int) -> None:
        """Restart the on-device sampling random stream: the same seed gives the same draws."""
        self._require_runtime().set_seed(seed)

    def reset(self) -> None:
        """Reset the model state; nothing by default."""

    @staticmethod
    def load_hf_model(model_path: str | os.PathLike[str]) -> Any:
        """The equivalent transformers model, for accuracy checks."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path)

    @property
    def checkpoint_path(self) -> str:
        """The Hugging Face checkpoint the weights come from (recorded in the config by
        load_pretrained_config), else `model_path`."""
        return str(getattr(self.config, "_name_or_path", None) or self.model_path)

    def _require_runtime(self) -> StepRuntime:
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__} is not loaded: call load(compiled_model_path) or to_cpu() first")
        return self._runtime

    def __repr__(self) -> str:
        state = "loaded" if self._runtime is not None else "compiled" if self.is_compiled else "not loaded"
        return f"{type(self).__name__}({self.model_path!r}, {state})"


def _waiting(message: str) -> None:
    """Say that compile() or load() waits for another process holding the folder."""
    warnings.warn(message, stacklevel=2)


def _lock_timeout(env: env_mod.Env) -> float | None:
    """NXDI_LOCK_TIMEOUT, warning when it was set to something that is not a number of seconds."""
    for problem in env.problems:
        if problem.startswith("NXDI_LOCK_TIMEOUT"):
            warnings.warn(problem, stacklevel=3)
    return env.lock_timeout


def _lora_problems(model: ModelSpec, spec: NeuronSpec) -> tuple[Problem, ...]:
    """What `lora_config` asks of `model` that it cannot give (unknown or absent target modules)."""
    if spec.lora_config is None:
        return ()
    return problems_of(lora_plan.layout_for(model, spec.lora_config))

"""InferenceConfig, FusedSpecNeuronConfig and load_pretrained_config (NxDI names and behaviour).

An InferenceConfig is a NeuronConfig plus the model's Hugging Face attributes. Construction order
follows NxDI: neuron_config, fused_spec_config, the load_config hook (or `self.load_config()`),
metadata, kwargs (which override loaded values), `add_derived_config()`, `validate_config()`.
Serialization writes the reference `neuron_config.json` layout as standard JSON, deterministic.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
from returns.result import Failure, Success

from nxdi.core.config import codec, neuron_checks
from nxdi.core.config.fields import to_json
from nxdi.core.families import parse_model_spec
from nxdi.core.families.record import FamilyRecord
from nxdi.core.model_spec import ModelSpec
from nxdi.core.platform import Platform
from nxdi.effects import env as env_mod
from nxdi.effects.files import write_text_atomic
from nxdi.shell import hf_configs
from nxdi.shell.config import MoENeuronConfig, NeuronConfig, _is_torch_dtype
from nxdi.shell.exceptions import MissingAttributesError, unwrap

CONFIG_FILE = "neuron_config.json"


def _class_ref(cls: type) -> dict[str, str]:
    return {"__module__": cls.__module__, "__name__": cls.__name__}


def _resolve_class(ref: Any, field: str) -> Any:
    """`{"__module__": m, "__name__": n}` -> the class; ModuleNotFoundError naming both otherwise."""
    if not isinstance(ref, Mapping) or "__module__" not in ref:
        return ref
    module, name = ref["__module__"], ref.get("__name__")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ModuleNotFoundError(f"{field}: cannot import class {name!r} from module {module!r}") from None


def _jsonable(value: Any) -> Any:
    """Attribute values as the reference's to_dict writes them."""
    if isinstance(value, NeuronConfig):
        return value.to_dict()
    if isinstance(value, (InferenceConfig, FusedSpecNeuronConfig)):
        return value.to_dict()
    if isinstance(value, type):
        return _class_ref(value)
    if _is_torch_dtype(value):
        return str(value).removeprefix("torch.")
    if isinstance(value, types.SimpleNamespace):
        return {k: _jsonable(v) for k, v in vars(value).items()}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class FusedSpecNeuronConfig:
    """Fused speculation: the target's worker class, the draft model's config, path and class."""

    def __init__(
        self,
        worker_cls: Any,
        draft_config: InferenceConfig | None = None,
        draft_model_path: str | None = None,
        draft_model_cls: Any = None,
    ) -> None:
        self.worker_cls = worker_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path
        self.draft_model_cls = draft_model_cls

    def to_dict(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in vars(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], config_cls: type[InferenceConfig]) -> FusedSpecNeuronConfig:
        """Rebuild from JSON, importing the referenced classes (ModuleNotFoundError if one is gone).

        The draft config is rebuilt as its own family's config class: `draft_model_cls`'s when the
        config names one, else the class of the draft's `model_type` (a draft of another family
        than the target, a mixture of experts' MoENeuronConfig), else `config_cls`."""
        worker = _resolve_class(data.get("worker_cls"), "fused_spec_config.worker_cls")
        draft_cls = _resolve_class(data.get("draft_model_cls"), "fused_spec_config.draft_model_cls")
        draft = data.get("draft_config")
        if isinstance(draft, Mapping):
            draft = _draft_config_cls(draft_cls, draft, config_cls).from_dict(draft)
        return cls(worker, draft_config=draft, draft_model_path=data.get("draft_model_path"), draft_model_cls=draft_cls)


def _draft_config_cls(
    draft_cls: Any, draft: Mapping[str, Any], default: type[InferenceConfig]
) -> type[InferenceConfig]:
    """The InferenceConfig class a saved draft config is rebuilt with (see `FusedSpecNeuronConfig.from_dict`)."""
    if hasattr(draft_cls, "get_config_cls"):
        return draft_cls.get_config_cls()  # type: ignore[no-any-return]
    from nxdi.shell.models import CONFIG_TYPES  # the family classes import this module

    model_type = draft.get("model_type")
    found = CONFIG_TYPES.get(model_type) if isinstance(model_type, str) else None
    return found if found is not None else default


class InferenceConfig:
    """A NeuronConfig plus model attributes, loadable from Hugging Face and from neuron_config.json.

    Raises:
        MissingAttributesError: a required attribute is absent (an AssertionError and a ValueError).
        IncompatibleConfigError: the model attributes are inconsistent (every problem listed).
    """

    attribute_map: ClassVar[dict[str, str]] = {}
    _family: ClassVar[FamilyRecord | None] = None
    """The family a `nxdi.shell.models` class describes: its required and derived attributes, its
    NeuronConfig class, and the model_type assumed when the attributes name none. None: a custom model."""
    _neuron_config_cls: ClassVar[type[NeuronConfig]] = NeuronConfig

    def __init__(
        self,
        neuron_config: NeuronConfig,
        fused_spec_config: FusedSpecNeuronConfig | None = None,
        load_config: Callable[[InferenceConfig], None] | None = None,
        metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    # --- attribute aliases ---------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        aliases = self.__dict__.get("attribute_map", type(self).attribute_map)
        if name != "attribute_map" and name in aliases:
            name = aliases[name]
        if name == "neuron_config" and isinstance(value, Mapping):
            value = self.get_neuron_config_cls()(**value)
        elif name == "text_config" and isinstance(value, Mapping):
            # As load_pretrained_config makes it, so a config read back from neuron_config.json
            # (where it is a JSON object) has the same attributes.
            value = types.SimpleNamespace(**value)
        elif name == "neuron_config" and _wants_moe(self.get_neuron_config_cls(), value):
            # A plain NeuronConfig for a mixture-of-experts family: the same settings as a
            # MoENeuronConfig (MoE options at their defaults), so what is compiled is what loads.
            value = self.get_neuron_config_cls()(**value._given)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        aliases = self.__dict__.get("attribute_map", type(self).attribute_map)
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # --- hooks subclasses override ---------------------------------------------------------
    def load_config(self) -> None:
        """Load attributes from another source; nothing by default."""

    def get_required_attributes(self) -> list[str]:
        """Attribute names that must be present: the family's (none for a custom model)."""
        return list(self._family.required_attributes) if self._family is not None else []

    def add_derived_config(self) -> None:
        """Compute attributes derived from others: the family's own (Qwen2's qkv_bias, ...), the cores
        that share a KV head under flash decoding (`min(tp, heads) / kv_heads`), and the padded hidden size."""
        self.num_cores_per_group = 1
        if self._family is None:
            return
        for name, value in self._family.derived_attributes.items():
            setattr(self, name, value)
        spec = self.neuron_config.spec
        text = self.get_text_config()  # a multimodal model's sizes are its language model's
        heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
        if spec.flash_decoding_enabled and isinstance(heads, int) and isinstance(kv, int) and kv > 0:
            self.num_cores_per_group = max(1, min(spec.tp_degree, heads) // kv)
        if spec.padded_hidden_size is not None and not hasattr(text, "original_hidden_size"):
            text.original_hidden_size = getattr(text, "hidden_size", None)
            text.hidden_size = spec.padded_hidden_size

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return cls._neuron_config_cls

    def get_text_config(self) -> Any:
        """The text model's config: `text_config` when the model has one (multimodal), else this config
        (what serving clients read `vocab_size` from)."""
        text = self.__dict__.get("text_config")
        return self if text is None else text

    def validate_config(self) -> None:
        """Check required attributes (all missing ones listed; a multimodal model's are its
        `text_config`'s) and the model attributes."""
        text = self.get_text_config()
        prefix = "" if text is self else "text_config."
        missing = [prefix + name for name in self.get_required_attributes() if not hasattr(text, name)]
        if missing:
            self._check_model_type()
            lines = "\n".join(f"  - {name}: is required but missing" for name in missing)
            raise MissingAttributesError(
                f"Config must define {missing}:\n{lines}\nFix: pass them as keyword arguments or use "
                "load_config=load_pretrained_config(model_path)"
            )
        attributes = {k: v for k, v in vars(self).items() if k != "neuron_config"}
        unwrap(neuron_checks.check_attention_chunking(self.neuron_config.spec, attributes), "Invalid InferenceConfig")
        if self._family is not None:
            self.model_spec()

    def _check_model_type(self) -> None:
        """Raise IncompatibleConfigError when the family refuses these attributes' model_type or
        text_config itself (an unknown model_type; a multimodal `gemma3` without a text_config),
        which is the cause when its model attributes look missing."""
        if self._family is None:
            return
        match parse_model_spec(to_json(self.hf_dict())):
            case Failure(error) if {"model_type", "text_config"} & set(error.fields()):
                kept = tuple(p for p in error.problems if p.field in ("model_type", "text_config"))
                unwrap(Failure(attrs.evolve(error, problems=kept)), "Invalid model configuration")

    # --- the model ---------------------------------------------------------------------------
    def hf_dict(self) -> dict[str, Any]:
        """The Hugging Face attributes (everything but the Neuron-specific ones)."""
        skip = {"neuron_config", "fused_spec_config", "metadata", "attribute_map", "num_cores_per_group"}
        out = {k: _jsonable(v) for k, v in vars(self).items() if k not in skip}
        if self._family is not None:
            out.setdefault("model_type", self._family.model_type)
        return out

    def model_spec(self) -> ModelSpec:
        """The architecture these attributes describe (IncompatibleConfigError listing every problem).

        Parsed from the standard-JSON form `save()` writes, so a configuration is checked the same
        way before compile() as when load() reads it back (a NaN float and the "nan" string it is
        written as are one value, refused alike)."""
        return unwrap(parse_model_spec(to_json(self.hf_dict())), "Invalid model configuration")

    # --- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {k: _jsonable(v) for k, v in vars(self).items()}
        out.setdefault("attribute_map", dict(type(self).attribute_map))
        out.setdefault("fused_spec_config", None)
        return out

    def to_json_string(self) -> str:
        """Deterministic JSON (sorted keys, indent 2, standard JSON)."""
        return codec.dumps(self.to_dict())

    def to_json_file(self, json_file: str | os.PathLike[str]) -> None:
        write_text_atomic(json_file, self.to_json_string() + "\n")

    def save(self, model_path: str | os.PathLike[str]) -> None:
        """Write `model_path/neuron_config.json` (atomically), creating the folder."""
        Path(model_path).mkdir(parents=True, exist_ok=True)
        self.to_json_file(Path(model_path) / CONFIG_FILE)

    @staticmethod
    def get_draft_neuron_class(fused_spec_config_dict: Mapping[str, Any]) -> Any:
        """The draft's application class a saved fused_spec_config names in `draft_model_cls`
        (`{"__module__": ..., "__name__": ...}`, imported), or None when it names none (NxDI's).

        Raises:
            ModuleNotFoundError: the module or class it names cannot be imported.
        """
        ref = fused_spec_config_dict.get("draft_model_cls")
        if not ref:
            return None
        return _resolve_class(ref, "fused_spec_config.draft_model_cls")

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> InferenceConfig:
        """Read `model_path/neuron_config.json`; kwargs override attributes."""
        return cls.from_json_file(Path(model_path) / CONFIG_FILE, **kwargs)

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike[str], **kwargs: Any) -> InferenceConfig:
        path = Path(json_file)
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r}: no such configuration file")
        return cls.from_json_string(path.read_text(), source=str(path), **kwargs)

    @classmethod
    def from_json_string(cls, json_string: str, source: str = CONFIG_FILE, **kwargs: Any) -> InferenceConfig:
        data = unwrap(codec.loads(json_string, source=source), f"Cannot read {source}")
        return cls.from_dict({**data, **kwargs})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InferenceConfig:
        """Build from a to_dict()-shaped mapping (neuron_config and fused_spec_config as dicts)."""
        rest = dict(data)
        neuron = rest.pop("neuron_config", None)
        if neuron is None:
            raise MissingAttributesError("neuron_config: is required but missing from the configuration")
        neuron_config = neuron if isinstance(neuron, NeuronConfig) else _neuron_config_from_dict(cls, neuron)
        fused = rest.pop("fused_spec_config", None)
        if isinstance(fused, Mapping):
            fused = FusedSpecNeuronConfig.from_dict(fused, cls)
        metadata = rest.pop("metadata", None)
        aliases = rest.pop("attribute_map", None)
        ordered = ({"attribute_map": aliases} if aliases is not None else {}) | rest
        return cls(neuron_config, fused_spec_config=fused, metadata=metadata, **ordered)


def _wants_moe(cls: type[NeuronConfig], value: Any) -> bool:
    """`value` is a plain NeuronConfig where the family's class is a MoENeuronConfig."""
    return (
        issubclass(cls, MoENeuronConfig) and isinstance(value, NeuronConfig) and not isinstance(value, MoENeuronConfig)
    )


def _neuron_config_from_dict(cls: type[InferenceConfig], data: Mapping[str, Any]) -> NeuronConfig:
    neuron_cls = cls.get_neuron_config_cls()
    env = env_mod.read_env()
    moe = issubclass(neuron_cls, MoENeuronConfig)
    parsed = codec.parse_neuron_dict(
        data, moe=moe, env_lnc=env.logical_nc_config, platform=env.platform_target or Platform.TRN1
    )
    match parsed:
        case Success(p):
            return neuron_cls.from_spec(p.spec)
        case Failure(_):
            unwrap(parsed, "Invalid neuron_config in configuration file")
    raise AssertionError("unreachable")


def load_pretrained_config(
    model_path_or_name: str | os.PathLike[str] | None = None, hf_config: Any = None
) -> Callable[[InferenceConfig], None]:
    """A load_config hook that copies a Hugging Face config's attributes onto an InferenceConfig.

    The checkpoint's `dtype` (or `torch_dtype`) becomes neuron_config.torch_dtype unless the
    NeuronConfig was given a torch_dtype explicitly. Nested configs become SimpleNamespaces.
    `transformers_version` is the one the checkpoint's config.json records (not the installed one).

    Raises:
        ValueError: both or neither of the two arguments given.
        IncompatibleConfigError (when the hook runs): the folder's config.json is not valid JSON, or
            transformers refuses it (a badly typed field, heads that do not divide, no model_type);
            the message names the file and every field at fault.
        FileNotFoundError, PermissionError (when the hook runs): config.json is missing or unreadable.
    """
    if (model_path_or_name is None) == (hf_config is None):
        raise ValueError("Please provide only one of model_path_or_name or hf_config")

    def load_config(self: InferenceConfig) -> None:
        config = hf_config
        if config is None:
            assert model_path_or_name is not None  # checked above: exactly one of the two is given
            config = hf_configs.read_hf_config(model_path_or_name)
        data = config.to_dict()
        # to_dict() writes the installed transformers version; keep the one the checkpoint was saved with.
        version = getattr(config, "transformers_version", None)
        if version is not None:
            data["transformers_version"] = version
        if model_path_or_name is not None and Path(model_path_or_name).exists():
            # Absolute, so a compiled model that reads its weights from here loads from any directory.
            data["_name_or_path"] = str(Path(model_path_or_name).resolve())
        dtype = data.pop("dtype", None)
        dtype = data.pop("torch_dtype", None) or dtype
        if dtype is not None and not self.neuron_config.spec.overrides_torch_dtype:
            name = str(dtype).removeprefix("torch.")
            self.neuron_config.update(torch_dtype=name, overrides_torch_dtype=False)
        for key, value in list(data.items()):
            if hasattr(getattr(config, key, None), "to_dict") and isinstance(value, Mapping):
                data[key] = types.SimpleNamespace(**value)
                if version is not None:
                    data[key].transformers_version = version
        rope = data.get("rope_parameters")
        if "rope_theta" not in data and isinstance(rope, Mapping) and "rope_theta" in rope:
            data["rope_theta"] = rope["rope_theta"]  # newer transformers nest it; NxDI requires it top level
        self.attribute_map = dict(getattr(config, "attribute_map", {}) or {})
        self.__dict__.update(data)

    return load_config

"""Dynamic multi-LoRA end to end: more adapters than device slots, swapped in on demand.

- A request stream over three adapters on a model with two device slots (plus the base slot) gives
  every row exactly the greedy tokens (fp32) of static serving with all three adapters loaded,
  through `to_cpu()` and compile() + load(); the slots follow the LRU policy.
- `add_adapter(id, path)` / `remove_adapter(id)` at run time; unknown ids, bad adapters, a batch of
  more distinct adapters than slots and a full host are refused, nothing changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell.config import LoraServingConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.testing import checkpoints
from tests.support.engine_fixtures import PROMPTS, load_model, nxdi_generate
from tests.support.lora_adapters import save_adapters

pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 6
STREAM: tuple[tuple[str | None, ...], ...] = (
    ("alpha", None, "beta", "alpha"),
    ("gamma", "beta", None, "gamma"),  # gamma evicts alpha (beta is in the batch)
    ("alpha", "gamma", "alpha", None),  # alpha evicts beta
    ("beta", "beta", "gamma", "gamma"),  # beta evicts alpha, the least recently used
)
SLOTS_AFTER = (("alpha", "beta"), ("gamma", "beta"), ("gamma", "alpha"), ("gamma", "beta"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_dynamic")
    path, hf = checkpoints.build_checkpoint(root / "llama", "llama", checkpoints.SaveFormat.SAFETENSORS)
    return {"root": root, "path": path, "paths": save_adapters(hf, root)}


def _dynamic(world: dict[str, Any], *, compiled: bool = False, tp: int = 1, **lora: Any) -> Any:
    paths = world["paths"]
    settings = {
        "max_loras": 2,
        "lora_ckpt_paths": {"alpha": paths["alpha"]},
        "lora_ckpt_paths_cpu": {"beta": paths["beta"]},
        "enable_base_model_only": True,
        "dynamic_multi_lora": True,
        "max_lora_rank": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        **lora,
    }
    backend = {"backend": "cpu"} if compiled else {}
    model = load_model(
        world["path"],
        "llama",
        workdir=world["root"],
        batch_size=4,
        lora_config=LoraServingConfig(**settings),
        tp_degree=tp,
        **backend,
    )
    return model


@pytest.fixture(scope="module")
def static_tokens(world: dict[str, Any]) -> list[torch.Tensor]:
    """Static serving, all three adapters on the device: each batch of the stream's tokens."""
    config = LoraServingConfig(max_loras=3, lora_ckpt_paths=world["paths"], enable_base_model_only=True)
    model = load_model(world["path"], "llama", batch_size=4, lora_config=config)
    return [nxdi_generate(model, PROMPTS, max_new_tokens=NEW, adapter_ids=[a or 0 for a in rows]) for rows in STREAM]


@pytest.mark.parametrize(
    ("compiled", "tp", "shard"),
    [(False, 1, True), (True, 1, True), (True, 2, True), (False, 2, False)],
    ids=["eager", "compiled", "tp2-sharded-compiled", "tp2-duplicated-eager"],
)
def test_a_stream_over_more_adapters_than_slots_matches_static_serving(
    world: dict[str, Any], static_tokens: list[torch.Tensor], compiled: bool, tp: int, shard: bool
) -> None:
    """At tp 2 every swap reaches both rank processes, each copying its slices into the slot."""
    model = _dynamic(world, compiled=compiled, tp=tp, lora_shard_linear_layer=shard)
    try:
        assert model.lora_device_adapters == ("alpha", None)
        model.add_adapter("gamma", world["paths"]["gamma"])
        for rows, want, slots in zip(STREAM, static_tokens, SLOTS_AFTER, strict=True):
            got = nxdi_generate(model, PROMPTS, max_new_tokens=NEW, adapter_ids=[a or 0 for a in rows])
            assert got.tolist() == want.tolist(), rows
            assert model.lora_device_adapters == slots, rows
    finally:
        model.close()


def test_the_stream_can_fail(static_tokens: list[torch.Tensor]) -> None:
    """Row 0 (one prompt) under alpha, gamma and beta: three different token sequences."""
    row0 = {tuple(static_tokens[b][0].tolist()) for b in (0, 1, 3)}
    assert len(row0) == 3


def test_adapters_added_and_removed_at_run_time_and_bad_requests_change_nothing(world: dict[str, Any]) -> None:
    model = _dynamic(world, max_cpu_loras=3)
    with pytest.raises(IncompatibleConfigError, match=r"adapter_ids: \['gamma'\] name no loaded adapter.*add_adapter"):
        nxdi_generate(model, PROMPTS, max_new_tokens=2, adapter_ids=["gamma", 0, 0, 0])
    assert model.lora_device_adapters == ("alpha", None)
    model.add_adapter("gamma", world["paths"]["gamma"])
    with pytest.raises(IncompatibleConfigError, match="already loaded"):
        model.add_adapter("gamma", world["paths"]["gamma"])
    with pytest.raises(IncompatibleConfigError, match="max_cpu_loras=3"):
        model.add_adapter("delta", world["paths"]["alpha"])
    with pytest.raises(IncompatibleConfigError, match=r"names 3 distinct adapters.*raise lora_config.max_loras"):
        nxdi_generate(model, PROMPTS, max_new_tokens=2, adapter_ids=["alpha", "beta", "gamma", 0])
    assert model.lora_device_adapters == ("alpha", None)
    # indices: alpha 1, beta 2 (the configured ones), gamma 3 (added)
    by_index = nxdi_generate(model, PROMPTS, max_new_tokens=3, adapter_ids=torch.tensor([3, 3, 0, 2]))
    by_name = nxdi_generate(model, PROMPTS, max_new_tokens=3, adapter_ids=["gamma", "gamma", 0, "beta"])
    assert by_index.tolist() == by_name.tolist()
    model.remove_adapter("gamma")
    assert "gamma" not in model.lora_device_adapters
    with pytest.raises(IncompatibleConfigError, match=r"remove_adapter: adapter id 'gamma' is not loaded"):
        model.remove_adapter("gamma")
    with pytest.raises(IncompatibleConfigError, match=r"\[3\] name no loaded adapter"):
        nxdi_generate(model, PROMPTS, max_new_tokens=2, adapter_ids=torch.tensor([3, 0, 0, 0]))


def test_a_bad_adapter_added_at_run_time_is_refused_whole(world: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    src, dst = Path(world["paths"]["alpha"]), world["root"] / "broken"
    dst.mkdir(exist_ok=True)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    model = _dynamic(world)
    with pytest.raises(ValueError) as err:
        model.add_adapter("broken", str(dst))
    text = str(err.value)
    assert "add_adapter('broken').bias='all'" in text and "another base model" in text
    with pytest.raises(IncompatibleConfigError, match="name no loaded adapter"):
        nxdi_generate(model, PROMPTS, max_new_tokens=2, adapter_ids=["broken", 0, 0, 0])


def test_static_models_refuse_add_adapter(world: dict[str, Any]) -> None:
    config = LoraServingConfig(lora_ckpt_paths={"alpha": world["paths"]["alpha"]}, enable_base_model_only=True)
    model = load_model(world["path"], "llama", batch_size=4, lora_config=config)
    with pytest.raises(IncompatibleConfigError, match=r"add_adapter: this model does not swap adapters.*dynamic"):
        model.add_adapter("beta", world["paths"]["beta"])


def test_dynamic_multi_lora_is_refused_where_it_cannot_take_effect(world: dict[str, Any]) -> None:
    paths = {"alpha": world["paths"]["alpha"]}
    config = LoraServingConfig(lora_ckpt_paths=paths, dynamic_multi_lora=True)
    with pytest.raises(IncompatibleConfigError, match="async_mode=True: swaps adapters into the weights"):
        load_model(
            world["path"],
            "llama",
            batch_size=4,
            lora_config=config,
            async_mode=True,
            on_device_sampling_config={"top_k": 1},
        )


def test_host_adapter_settings_without_dynamic_multi_lora_are_refused(world: dict[str, Any]) -> None:
    paths = {"alpha": world["paths"]["alpha"]}
    for lora, field in (
        ({"lora_ckpt_paths_cpu": {"beta": world["paths"]["beta"]}}, "lora_config.lora_ckpt_paths_cpu=1"),
        ({"eviction_policy": "lfu"}, "lora_config.eviction_policy='lfu'"),
        ({"dynamic_multi_lora": True, "lfu_decay_period": 8}, "lora_config.lfu_decay_period=8: decays LFU"),
    ):
        config = LoraServingConfig(lora_ckpt_paths=paths, **lora)
        with pytest.raises(IncompatibleConfigError, match=field):
            load_model(world["path"], "llama", batch_size=4, lora_config=config)


def test_dynamic_multi_lora_runs_on_the_cpu_backend_only() -> None:
    from nxdi.core.config import cpu_support, neuron_parse

    spec = (
        neuron_parse.parse_neuron_spec({"lora_config": {"dynamic_multi_lora": True, "lora_ckpt_paths": {"a": "/a"}}})
        .unwrap()
        .spec
    )
    assert "dynamic_multi_lora" in str(cpu_support.check_backend_support(spec, "xla").failure())
    assert cpu_support.check_backend_support(spec, "cpu").unwrap() is spec

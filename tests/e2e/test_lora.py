"""Multi-LoRA serving end to end: PEFT adapters served in one batch, against transformers + PEFT.

- Three adapters (ranks 2, 4 and 8; different target modules, one on gate/up/down, one rsLoRA)
  and base-model rows in one batch: every row's greedy tokens are transformers + PEFT's with that
  adapter (fp32), and its logits agree within 1e-4, through `to_cpu()` and compile() + load().
- `HuggingFaceGenerationAdapter.generate(adapter_ids=[names])` and `forward(adapter_ids=[indices])`.
- Bad adapters and bad adapter ids are refused with one error naming the adapter, the field and
  the fix, before anything is loaded.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.shell.config import LoraServingConfig
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.testing import checkpoints
from tests.support.engine_fixtures import PAD, PROMPTS, hf_logits, load_model, nxdi_generate, padded
from tests.support.lora_adapters import INDEX, ROWS, save_adapters

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 10


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny llama checkpoint, three adapters beside it, and transformers + PEFT holding all three."""
    root = tmp_path_factory.mktemp("lora")
    path, hf = checkpoints.build_checkpoint(root / "llama", "llama", checkpoints.SaveFormat.SAFETENSORS)
    paths = save_adapters(hf, root)
    reference = peft.PeftModel.from_pretrained(copy.deepcopy(hf), paths["alpha"], adapter_name="alpha")
    for name in ("beta", "gamma"):
        reference.load_adapter(paths[name], adapter_name=name)
    return {"root": root, "path": path, "paths": paths, "peft": reference.eval()}


def _lora_model(
    world: dict[str, Any], *, compiled: bool = False, tp: int = 1, fused_qkv: bool = False, **lora: Any
) -> Any:
    config = LoraServingConfig(
        **{"max_loras": 3, "lora_ckpt_paths": world["paths"], "enable_base_model_only": True, **lora}
    )
    backend = {"backend": "cpu"} if compiled else {}
    return load_model(
        world["path"],
        "llama",
        workdir=world["root"],
        batch_size=4,
        lora_config=config,
        tp_degree=tp,
        fused_qkv=fused_qkv,
        **backend,
    )


@pytest.fixture(scope="module")
def served(world: dict[str, Any]) -> Callable[[bool], Any]:
    built: dict[bool, Any] = {}

    def get(compiled: bool) -> Any:
        if compiled not in built:
            built[compiled] = _lora_model(world, compiled=compiled)
        return built[compiled]

    return get


def _reference(
    world: dict[str, Any], adapter: str | None, prompt: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers + PEFT with `adapter` (None: adapters disabled): greedy new tokens [NEW] and the
    logits [n + NEW - 1, V] of the prompt and the generated tokens."""
    model = world["peft"]
    ids = torch.tensor([list(prompt)])
    settings = {"do_sample": False, "max_new_tokens": NEW, "pad_token_id": PAD, "eos_token_id": None}

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings)[0, len(prompt) :]
        return new, hf_logits(model, [*prompt, *new[:-1].tolist()])

    if adapter is None:
        with model.disable_adapter():
            return run()
    model.set_adapter(adapter)
    return run()


@pytest.fixture(scope="module")
def references(world: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_reference(world, adapter, prompt) for adapter, prompt in zip(ROWS, PROMPTS, strict=True)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_mixed_batch_gives_each_row_its_adapters_tokens_and_logits(
    served: Callable[[bool], Any], references: list[tuple[torch.Tensor, torch.Tensor]], compiled: bool
) -> None:
    model = served(compiled)
    names = [adapter or 0 for adapter in ROWS]  # names, and 0 (the base model's index)
    tokens = nxdi_generate(model, PROMPTS, max_new_tokens=NEW, adapter_ids=names)
    for row, (adapter, prompt) in enumerate(zip(ROWS, PROMPTS, strict=True)):
        want, logits = references[row]
        assert tokens[row].tolist() == want.tolist(), (adapter, row)
        got = _teacher_forced_row(model, names, row, prompt, want)
        torch.testing.assert_close(got, logits[len(prompt) - 1 :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("tp", "shard", "transpose", "compiled"),
    [(1, True, False, True), (2, True, True, False), (2, False, False, True), (4, True, True, True)],
    ids=[
        "tp1-untransposed-compiled",
        "tp2-sharded-eager",
        "tp2-duplicated-untransposed-compiled",
        "tp4-sharded-compiled",
    ],
)
def test_each_layout_and_tensor_parallel_ranks_give_each_row_its_adapters_tokens_and_logits(
    world: dict[str, Any],
    references: list[tuple[torch.Tensor, torch.Tensor]],
    tp: int,
    shard: bool,
    transpose: bool,
    compiled: bool,
) -> None:
    """Rank processes, the adapters' plain matrices split (`lora_shard_linear_layer=True`, gathered each
    step) or duplicated, stored `[in, out]` (`lora_memory_transpose=True`, the default) or `[out, in]`;
    at tp 4 the tiny model's 2 KV heads are replicated, and its adapters' K and V rows with them; the
    duplicated case also reads a fused-QKV checkpoint layout (`fused_qkv=True`)."""
    lora = {"lora_shard_linear_layer": shard, "lora_memory_transpose": transpose}
    model = _lora_model(world, compiled=compiled, tp=tp, fused_qkv=tp == 2 and not shard, **lora)
    try:
        names = [adapter or 0 for adapter in ROWS]
        tokens = nxdi_generate(model, PROMPTS, max_new_tokens=NEW, adapter_ids=names)
        for row, (adapter, prompt) in enumerate(zip(ROWS, PROMPTS, strict=True)):
            want, logits = references[row]
            assert tokens[row].tolist() == want.tolist(), (adapter, row)
            if row in (0, 3):  # two adapters' logits (each takes NEW steps through the ranks)
                got = _teacher_forced_row(model, names, row, prompt, want)
                torch.testing.assert_close(got, logits[len(prompt) - 1 :], atol=1e-4, rtol=1e-4)
    finally:
        model.close()


def _teacher_forced_row(
    model: Any, names: list[Any], row: int, prompt: tuple[int, ...], new: torch.Tensor
) -> torch.Tensor:
    """forward() logits [NEW, V] of `row` in the mixed batch, fed the reference's tokens (every other
    row fed its own prompt's last token again: only `row`'s logits are read)."""
    ids, mask = padded(PROMPTS, "right")
    index = torch.tensor([INDEX[n] if isinstance(n, str) else n for n in names])
    model.reset()
    out = [model.forward(ids, attention_mask=mask, adapter_ids=index).logits[row, -1]]
    positions = mask.sum(-1, keepdim=True)
    feed = ids.gather(1, positions - 1)  # [B, 1]
    for k in range(NEW - 1):
        feed = feed.clone()
        feed[row, 0] = new[k]
        out.append(model.forward(feed, position_ids=positions + k, adapter_ids=index).logits[row, -1])
    return torch.stack(out)


def test_adapters_change_the_tokens(references: list[tuple[torch.Tensor, torch.Tensor]], world: dict[str, Any]) -> None:
    """The comparison above can fail: each adapter's tokens differ from the base model's."""
    for row, adapter in enumerate(ROWS):
        if adapter is not None:
            base, _ = _reference(world, None, PROMPTS[row])
            assert base.tolist() != references[row][0].tolist(), adapter


def test_unknown_adapter_ids_are_refused(served: Callable[[bool], Any]) -> None:
    model = served(False)
    ids, mask = padded(PROMPTS, "right")
    with pytest.raises(
        IncompatibleConfigError, match=r"adapter_ids: \['delta'\] name no loaded adapter.*'alpha' \(1\)"
    ):
        model.forward(ids, attention_mask=mask, adapter_ids=["alpha", "delta", 0, 1])
    with pytest.raises(IncompatibleConfigError, match=r"adapter_ids: \[4\] name no loaded adapter"):
        model.forward(ids, attention_mask=mask, adapter_ids=torch.tensor([1, 2, 3, 4]))
    with pytest.raises(IncompatibleConfigError, match="has 2 entries for a batch of 4"):
        model.forward(ids, attention_mask=mask, adapter_ids=torch.tensor([1, 2]))


def test_adapter_ids_without_lora_config_are_refused(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("llama", batch_size=4)
    ids, mask = padded(PROMPTS, "right")
    with pytest.raises(IncompatibleConfigError, match="adapter_ids: given, but this model has no lora_config"):
        model.forward(ids, attention_mask=mask, adapter_ids=torch.tensor([0, 0, 0, 0]))


def test_without_a_base_slot_every_row_needs_an_adapter(world: dict[str, Any]) -> None:
    model = _lora_model(world, enable_base_model_only=False)
    ids, mask = padded(PROMPTS, "right")
    with pytest.raises(IncompatibleConfigError, match="adapter_ids: None, but every row needs an adapter"):
        model.forward(ids, attention_mask=mask)
    # indices start at 0 without the base slot: "alpha" is 0
    named = model.forward(ids, attention_mask=mask, adapter_ids=["alpha", "beta", "gamma", "alpha"]).logits
    indexed = model.forward(ids, attention_mask=mask, adapter_ids=torch.tensor([0, 1, 2, 0])).logits
    torch.testing.assert_close(named, indexed, atol=0, rtol=0)


def test_adapter_indices_follow_the_order_lora_ckpt_paths_gives(world: dict[str, Any]) -> None:
    """NxDI numbers the adapters in the order `lora_ckpt_paths` lists them, not by id: given as
    gamma, alpha, beta, index 1 (after the base model's 0) is gamma."""
    paths = world["paths"]
    given = {name: paths[name] for name in ("gamma", "alpha", "beta")}
    model = _lora_model(world, lora_ckpt_paths=given)
    ids, mask = padded(PROMPTS, "right")
    named = model.forward(ids, attention_mask=mask, adapter_ids=["gamma", "alpha", "beta", 0]).logits
    indexed = model.forward(ids, attention_mask=mask, adapter_ids=torch.tensor([1, 2, 3, 0])).logits
    torch.testing.assert_close(named, indexed, atol=0, rtol=0)
    reference = _lora_model(world).forward(ids, attention_mask=mask, adapter_ids=["gamma", "alpha", "beta", 0]).logits
    torch.testing.assert_close(named, reference, atol=0, rtol=0)  # same adapters, whatever their slots


def _edit_adapter(
    world: dict[str, Any], name: str, edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]
) -> str:
    """A copy of adapter `alpha` under `name` with its tensors and config edited."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(world["paths"]["alpha"]), world["root"] / name
    dst.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def test_an_adapter_saved_as_bin_is_read_as_its_safetensors(
    world: dict[str, Any], references: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """PEFT's other file format: alpha saved as `adapter_model.bin` (a torch pickle) serves its rows
    the tokens transformers + PEFT gives them."""
    from safetensors.torch import load_file

    src, dst = Path(world["paths"]["alpha"]), world["root"] / "alpha-bin"
    dst.mkdir()
    torch.save(load_file(str(src / "adapter_model.safetensors")), dst / "adapter_model.bin")
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    model = _lora_model({**world, "paths": {**world["paths"], "alpha": str(dst)}})
    tokens = nxdi_generate(model, PROMPTS, max_new_tokens=NEW, adapter_ids=[a or 0 for a in ROWS])
    for row, (want, _) in enumerate(references):
        assert tokens[row].tolist() == want.tolist(), ROWS[row]


def test_bad_adapters_are_refused_each_named(world: dict[str, Any]) -> None:
    def other_base(t: dict[str, torch.Tensor], _: dict[str, Any]) -> None:
        key = next(k for k in t if "layers.0.self_attn.q_proj.lora_A" in k)
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)

    def biased(_: dict[str, torch.Tensor], c: dict[str, Any]) -> None:
        c["bias"] = "all"

    def too_wide(t: dict[str, torch.Tensor], c: dict[str, Any]) -> None:
        key = next(k for k in t if "layers.1.self_attn.v_proj.lora_B" in k)
        t[key] = torch.zeros(t[key].shape[0], 64)

    paths = {
        "other": _edit_adapter(world, "other", other_base),
        "biased": _edit_adapter(world, "biased", biased),
        "wide": _edit_adapter(world, "wide", too_wide),
    }
    config = LoraServingConfig(max_loras=3, lora_ckpt_paths=paths, max_lora_rank=8)
    with pytest.raises(ValueError) as err:
        load_model(world["path"], "llama", batch_size=4, lora_config=config)
    text = str(err.value)
    assert "lora_config.lora_ckpt_paths[other]" in text and "another base model" in text
    assert "lora_config.lora_ckpt_paths[biased].bias='all'" in text
    assert "lora_config.lora_ckpt_paths[wide]" in text and "above lora_config.max_lora_rank=8" in text


def test_a_target_module_the_base_model_lacks_is_refused(world: dict[str, Any]) -> None:
    config = LoraServingConfig(lora_ckpt_paths=world["paths"], target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"lora_config.target_modules=.*embed_tokens.*cannot attach adapters"):
        load_model(world["path"], "llama", batch_size=4, lora_config=config)


def test_settings_that_cannot_take_effect_are_refused(world: dict[str, Any]) -> None:
    for kwargs, field in (
        ({"is_block_kv_layout": True}, "is_block_kv_layout"),
        ({"lora_config": {"lora_bias": "all"}}, "lora_config.lora_bias"),
    ):
        lora = {"lora_ckpt_paths": world["paths"], **kwargs.pop("lora_config", {})}
        with pytest.raises(IncompatibleConfigError, match=field):
            load_model(world["path"], "llama", batch_size=4, lora_config=LoraServingConfig(**lora), **kwargs)


def test_missing_adapter_files_are_refused(world: dict[str, Any]) -> None:
    with pytest.raises(FileNotFoundError, match=r"lora_config\.lora_ckpt_paths"):
        LoraServingConfig(lora_ckpt_paths={"gone": str(world["root"] / "gone")})


@pytest.mark.parametrize(
    ("tp", "shard", "fused"), [(1, True, False), (2, True, False), (2, False, True), (4, True, True), (4, False, False)]
)
def test_the_planned_adapter_memory_is_what_every_rank_allocates(
    world: dict[str, Any], tp: int, shard: bool, fused: bool
) -> None:
    """`nxdi plan`'s per-core LoRA bytes (all slots) and its capacity's bytes per adapter equal the
    stacked adapters each rank reads (at tp 4 with the K and V rows of replicated KV heads)."""
    import attrs

    from nxdi.core.planning import plan
    from nxdi.effects import engine
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES

    lora = LoraServingConfig(
        max_loras=3, lora_ckpt_paths=world["paths"], enable_base_model_only=True, lora_shard_linear_layer=shard
    )
    neuron = NeuronConfig(
        batch_size=4, seq_len=64, torch_dtype="float32", tp_degree=tp, fused_qkv=fused, lora_config=lora
    )
    model = MODEL_TYPES["llama"]["causal-lm"](
        world["path"], CONFIG_TYPES["llama"](neuron, load_config=load_pretrained_config(world["path"]))
    )
    planned = plan.plan_for(model.model_spec, model.spec).unwrap()
    slots = model.spec.lora_config.effective_max_loras
    em = model._engine_model()
    for rank in range(tp):
        stacked = engine.read_extra(attrs.evolve(em, rank=rank), model._source(world["path"])).unwrap()
        held = sum(t.numel() * t.element_size() for t in stacked.values())
        assert planned.memory.lora_bytes_per_core == held, rank
        assert planned.lora is not None and planned.lora.bytes_per_core * slots == held, rank
    one = attrs.evolve(em, spec=attrs.evolve(em.spec, tp_degree=1))
    whole = engine.read_extra(one, model._source(world["path"])).unwrap()
    whole_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    assert held < whole_bytes if tp > 1 else held == whole_bytes  # a rank holds a share

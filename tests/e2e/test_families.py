"""Every family the engine runs, checked from its record alone (a new record is covered without new tests).

For each runnable record: its tiny Hugging Face config (`FamilyRecord.tiny_config`) parses back to
that record, its documented classes exist and are registered, its weight table reads exactly the
keys of a real transformers checkpoint, and the model built through the documented API gives
transformers' logits (fp32, within 1e-4 of the largest) on a prefill and the decode steps after it,
and transformers' greedy tokens on a padded batch, eagerly and through compile() + load().
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

import nxdi
from nxdi.core import families
from nxdi.core import weight_plan as weights
from nxdi.core.families.record import FamilyRecord
from nxdi.shell import models
from nxdi.testing import checkpoints
from nxdi.testing.strategies.decoders import plan_of
from tests.support.engine_fixtures import hf_generate, hf_logits, load_model, nxdi_generate, padded

RECORDS = families.runnable()
PROMPTS = ((1, 5, 7, 9, 11, 3, 4, 5, 6, 7, 8, 9), (3, 4))
NEW_TOKENS = 8


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"max |diff| {err} vs max |logit| {expected.abs().max().item()}"


@pytest.fixture(params=RECORDS, ids=[r.name for r in RECORDS])
def record(request: pytest.FixtureRequest) -> FamilyRecord:
    return request.param  # type: ignore[no-any-return]


def test_the_tiny_config_parses_back_to_its_record(record: FamilyRecord, tiny_model: Callable[[str], Any]) -> None:
    config = tiny_model(record.name).config.to_dict()
    spec = families.parse_model_spec(config).unwrap()
    assert families.record_for(spec.model_type).unwrap() is record
    assert config["model_type"] in record.model_types


def test_the_documented_classes_exist_and_are_registered(
    record: FamilyRecord, tiny_checkpoint: Callable[..., Path]
) -> None:
    assert record.classes is not None and record.classes.causal_lm is not None
    causal_lm = getattr(nxdi, record.classes.causal_lm)
    config_cls = getattr(nxdi, record.classes.inference_config)
    assert causal_lm is getattr(models, record.classes.causal_lm) and causal_lm.get_config_cls() is config_cls
    assert issubclass(causal_lm, nxdi.NeuronBaseForCausalLM) and issubclass(config_cls, nxdi.InferenceConfig)
    assert all(nxdi.MODEL_TYPES[t]["causal-lm"] is causal_lm for t in record.model_types)
    assert models.model_type_of(tiny_checkpoint(record.name)) == record.model_type


def test_the_weight_table_reads_exactly_a_transformers_checkpoint(
    record: FamilyRecord, tiny_model: Callable[[str], Any], tiny_checkpoint: Callable[..., Path]
) -> None:
    # The saved files, not the module's state_dict: transformers keeps MoE experts fused in memory
    # and writes them per expert, as the hub's checkpoints are.
    spec = families.parse_model_spec(tiny_model(record.name).config.to_dict()).unwrap()
    with safetensors.safe_open(tiny_checkpoint(record.name) / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    keys = weights.check_checkpoint(plan_of(spec), shapes).unwrap()
    assert set(keys.values()) == set(shapes)


def test_prefill_and_decode_logits_match_transformers(
    record: FamilyRecord, loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    model = loaded_model(record.name, batch_size=2, output_logits=True)
    hf = tiny_model(record.name)
    ids, mask = padded(PROMPTS, "left")
    model.reset()
    out = model(ids, attention_mask=mask)
    assert out.logits.shape == (2, 1, hf.config.vocab_size) and out.logits.dtype == torch.float32
    sequences = [list(p) for p in PROMPTS]
    for step in range(4):
        for row, seq in enumerate(sequences):
            _close(out.logits[row, 0], hf_logits(hf, seq)[-1])
        nxt = out.logits[:, 0].argmax(-1)
        positions = torch.tensor([[len(s)] for s in sequences])
        for seq, t in zip(sequences, nxt.tolist(), strict=True):
            seq.append(t)
        if step < 3:
            out = model(nxt[:, None], position_ids=positions)


def test_greedy_generation_matches_transformers(
    record: FamilyRecord, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    model = loaded_model(record.name, batch_size=2)
    ours = nxdi_generate(model, PROMPTS, side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_greedy(record.name, PROMPTS, NEW_TOKENS))


def test_compile_then_load_generates_like_transformers(
    record: FamilyRecord,
    tiny_checkpoint: Callable[..., Path],
    hf_greedy: Callable[..., torch.Tensor],
    tmp_path: Path,
) -> None:
    """The documented compile() + load() (traced programs, weights laid out from the checkpoint's
    headers first), not only the eager to_cpu()."""
    model = load_model(tiny_checkpoint(record.name), record.name, workdir=tmp_path, backend="cpu", batch_size=2)
    ours = nxdi_generate(model, PROMPTS, side="left", max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours, hf_greedy(record.name, PROMPTS, NEW_TOKENS))


@pytest.mark.parametrize(("family", "full"), [("qwen3", (0,)), ("qwen3_moe", ())])
def test_qwen_sliding_windows_match_transformers(family: str, full: tuple[int, ...], tmp_path: Path) -> None:
    """`use_sliding_window` with `max_window_layers=1`: Qwen3's layer 0 sees everything and layer 1
    the last 8 positions (Qwen2's rule; Qwen2's tiny config is windowed so already); transformers'
    Qwen3-MoE windows every layer. The 12-token prompts plus 20 new tokens cross the window."""
    hf = checkpoints.build_model(family, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    path = checkpoints.save_checkpoint(hf, tmp_path / family, checkpoints.SaveFormat.SAFETENSORS)
    model = load_model(path, family, batch_size=2)
    spec = model.config.model_spec()
    assert (spec.sliding_window, spec.full_attention_layers) == (8, full)  # the window took effect
    prompts = (PROMPTS[0], (*PROMPTS[0], 2, 3)[-12:])
    ours = nxdi_generate(model, prompts, side="left", max_new_tokens=20)
    assert torch.equal(ours, hf_generate(hf, prompts, max_new_tokens=20))

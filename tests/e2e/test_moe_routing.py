"""A mixture of experts' routing outputs (MoENeuronConfig return_router_logits / return_expert_index)
through forward(), against transformers' `output_router_logits=True`.

- fp32: every layer's router logits of a left-padded two-prompt prefill and of one decode step
  equal transformers' within 1e-5 on the real tokens (padding columns hold 0.0); the chosen experts
  are the top-k of transformers' router logits, best first (padding: -1).
- The same through compile() + load() (the step's signature names the extra outputs, and a folder
  compiled without them is refused by the graph key) and at tp_degree=2 (rank processes, expert
  parallelism, sequence parallelism).
- Without the flags the output fields are None and the compiled step returns logits only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.effects.manifest import read_manifest
from nxdi.shell.config import MoENeuronConfig
from nxdi.shell.exceptions import ArtifactIntegrityError
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import MixtralInferenceConfig, NeuronMixtralForCausalLM
from tests.support.engine_fixtures import PROMPTS, SEQ_LEN, padded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUTING = {"return_router_logits": True, "return_expert_index": True}
ROWS = (PROMPTS[0], PROMPTS[3])  # 10 and 2 tokens: the second row is mostly padding
NEXT = torch.tensor([[5], [6]])
"""One decode step's tokens, one per row."""


def _reference(hf: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """transformers' router logits per layer: the left-padded prefill [B*W, X], then one decode step
    [B, X] (from the base model: the causal LM's auxiliary loss takes the decode step's [B, W+1]
    mask for its [B] tokens and fails)."""
    ids, mask = padded(ROWS, "left")
    with torch.no_grad():
        prefill = hf(ids, attention_mask=mask, output_router_logits=True, use_cache=True)
        step = hf.model(
            NEXT,
            attention_mask=torch.cat((mask, torch.ones_like(NEXT)), dim=1),
            past_key_values=prefill.past_key_values,
            output_router_logits=True,
        )
    return prefill.router_logits, step.router_logits


def _assert_routing_equals(out: Any, reference: tuple[torch.Tensor, ...], real: torch.Tensor) -> None:
    """`out`'s router logits and experts against transformers' router logits, layer by layer, on
    the `real` [B*W] tokens; the others hold 0.0 and -1."""
    assert len(out.router_logits) == len(out.expert_index) == len(reference)
    for logits, experts, want in zip(out.router_logits, out.expert_index, reference, strict=True):
        assert logits.shape == want.shape and logits.dtype == torch.float32
        torch.testing.assert_close(logits[real], want[real], rtol=0, atol=1e-5)
        k = experts.shape[-1]
        assert experts.dtype == torch.int64
        assert torch.equal(experts[real], torch.topk(want[real], k, dim=-1).indices)
        assert (logits[~real] == 0).all() and (experts[~real] == -1).all()


def _check_against_transformers(model: Any, hf: Any) -> None:
    """A left-padded prefill, then one decode step, against transformers."""
    ids, mask = padded(ROWS, "left")
    prefill, step = _reference(hf)
    model.reset()
    _assert_routing_equals(model(ids, attention_mask=mask), prefill, mask.reshape(-1).bool())
    decoded = model(NEXT, position_ids=mask.sum(-1, keepdim=True))
    _assert_routing_equals(decoded, step, torch.ones(NEXT.numel(), dtype=torch.bool))


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_router_logits_and_experts_equal_transformers(
    variant: str, loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    _check_against_transformers(loaded_model(variant, batch_size=2, **ROUTING), tiny_model(variant))


def test_a_right_padded_prompt_keeps_the_callers_columns(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """Right padding: each row's real tokens keep their columns; a single prompt matches transformers' shape."""
    model = loaded_model("mixtral", batch_size=2, **ROUTING)
    ids, mask = padded(ROWS, "right")
    left, _ = _reference(tiny_model("mixtral"))
    model.reset()
    out = model(ids, attention_mask=mask)
    w = ids.shape[1]
    for got, want in zip(out.router_logits, left, strict=True):
        for row, prompt in enumerate(ROWS):
            n = len(prompt)
            mine = got[row * w : row * w + n]
            theirs = want[(row + 1) * w - n : (row + 1) * w]  # left-padded: the row's last n columns
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_without_the_flags_the_fields_are_none(loaded_model: Callable[..., Any]) -> None:
    model = loaded_model("mixtral", batch_size=2)
    ids, mask = padded(ROWS, "left")
    model.reset()
    out = model(ids, attention_mask=mask)
    assert out.router_logits is None and out.expert_index is None
    decoded = model(NEXT, position_ids=mask.sum(-1, keepdim=True))
    assert decoded.router_logits is None and decoded.expert_index is None


def _mixtral(path: Path, **kwargs: Any) -> Any:
    neuron = MoENeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN, batch_size=2, **kwargs)
    return NeuronMixtralForCausalLM(path, MixtralInferenceConfig(neuron, load_config=load_pretrained_config(path)))


def _outputs(folder: Path) -> set[tuple[str, ...]]:
    """The output names of every program compiled in `folder`."""
    return {p.signature.outputs for p in read_manifest(folder).unwrap().programs}


def test_compiled_programs_return_the_routing_as_named_outputs(
    tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any], tmp_path: Path
) -> None:
    path = tiny_checkpoint("mixtral")
    plain, routed = tmp_path / "plain", tmp_path / "routed"
    model = _mixtral(path, **ROUTING)
    model.compile(routed)
    assert _outputs(routed) == {("logits", "router_logits", "expert_index")}
    model.load(routed)
    _check_against_transformers(model, tiny_model("mixtral"))

    without = _mixtral(path)
    without.compile(plain)
    assert _outputs(plain) == {("logits",)}
    without.load(plain)
    ids, mask = padded(ROWS, "left")
    out = without(ids, attention_mask=mask)
    assert out.router_logits is None and out.expert_index is None
    with pytest.raises(ArtifactIntegrityError, match="graph_key"):  # the flags are part of the graph
        _mixtral(path, **ROUTING).load(plain)


@pytest.mark.parametrize(
    "settings",
    [{}, {"moe_ep_degree": 2, "moe_tp_degree": 1, "sequence_parallel_enabled": True}],
    ids=["tp", "ep-sp"],
)
def test_every_rank_routes_alike_at_tp_degree_2(
    settings: dict[str, Any], tp_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    model = tp_model("mixtral", tp_degree=2, batch_size=2, **ROUTING, **settings)
    _check_against_transformers(model, tiny_model("mixtral"))

"""The EAGLE draft: its program against the transformers reference, its checkpoint, its target's
hidden states, its configuration and its trainer.

- The draft program (`nxdi.core.programs.eagle`), loaded from a checkpoint in the EAGLE project's
  layout, equals `nxdi.testing.eagle.EagleDraftModel` within 1e-5 (fp32) over a right-padded
  prefill and then token by token with its cache, with and without input norms, with and without
  an fc bias, with one and two layers.
- A target step asked for its hidden states returns transformers' last hidden state (after the
  final norm) for every token, and the same logits as without.
- Bad draft checkpoints are refused naming the file, the tensor and the fix.
- `train_eagle_draft` reaches its stated agreement, and the engine's program agrees as often.
- Greedy EAGLE speculation (`tests.support.eagle_loop`) gives the target's greedy tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from returns.result import Failure

from nxdi import NeuronConfig, NeuronLlamaForCausalLM, load_pretrained_config
from nxdi.core import families
from nxdi.core.errors import CheckpointError
from nxdi.core.host import weight_ops
from nxdi.core.programs import decoder, eagle, inputs, kv_cache, step
from nxdi.effects import checkpoint
from nxdi.effects import eagle_checkpoint as eagle_io
from nxdi.effects import weight_loader as weight_io
from nxdi.shell.exceptions import CheckpointValidationError, IncompatibleConfigError
from nxdi.testing import checkpoints
from nxdi.testing import eagle as reference
from nxdi.testing.strategies.decoders import plan_of, program_of
from nxdi.testing.training import progression_batch, train_briefly
from tests.support import eagle_loop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AGREEMENT = 0.85
"""What `train_eagle_draft` promises on the tiny Llama trained by `train_briefly` (measured: 0.93)."""


@pytest.fixture(scope="module")
def target() -> Any:
    return checkpoints.build_model("llama", seed=0)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory, target: Any) -> Callable[..., tuple[Any, Path]]:
    """`drafts(input_norm=, fc_bias=, layers=)`: a random reference draft of `target` and its saved folder."""
    root = tmp_path_factory.mktemp("drafts")
    made: dict[tuple[bool, bool, int], tuple[Any, Path]] = {}

    def get(*, input_norm: bool = False, fc_bias: bool = False, layers: int = 1) -> tuple[Any, Path]:
        key = (input_norm, fc_bias, layers)
        if key not in made:
            draft = reference.from_target(target, layers=layers, input_norm=input_norm, fc_bias=fc_bias, seed=7)
            path = reference.save_eagle_draft(draft, target.lm_head.weight, root / f"{input_norm}-{fc_bias}-{layers}")
            made[key] = (draft, path)
        return made[key]

    return get


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("input_norm", "fc_bias", "layers"),
    [(False, False, 1), (True, False, 1), (False, True, 1), (True, True, 1), (False, True, 2)],
)
def test_draft_program_equals_the_reference(
    drafts: Callable[..., tuple[Any, Path]], input_norm: bool, fc_bias: bool, layers: int
) -> None:
    ref, path = drafts(input_norm=input_norm, fc_bias=fc_bias, layers=layers)
    read = eagle_io.read_eagle_draft(path, input_norm=input_norm).unwrap()
    spec, w = read.spec, read.weights
    assert spec.num_layers == layers and (w.fc_bias is not None) == fc_bias
    assert w.decoder.norm is None and all((lw.input_norm is not None) == input_norm for lw in w.decoder.layers)
    g = torch.Generator().manual_seed(1)
    lengths, bucket, steps = [7, 4], 8, 4
    total = max(lengths) + steps
    ids = torch.randint(0, spec.vocab_size, (2, total), generator=g)  # row b's pair tokens, all of them
    hidden = torch.randn(2, total, spec.hidden_size, generator=g)  # ... and the hidden states beside them
    x = inputs.prompt_inputs([ids[b, :n].tolist() for b, n in enumerate(lengths)], length=bucket)
    cache = kv_cache.empty_cache(spec, batch=2, length=16, dtype=torch.float32)
    logits, own, cache = eagle.forward(w, cache, x, hidden[:, :bucket], spec=spec)
    with torch.no_grad():
        for b, n in enumerate(lengths):
            want_logits, want_own = ref(ids[b : b + 1, :n], hidden[b : b + 1, :n])
            _close(logits[b, :n], want_logits[0])
            _close(own[b, :n], want_own[0])
    for i in range(steps):  # one pair per step, each row at its own position, through the cache
        at = torch.tensor(lengths) + i
        rows = torch.arange(2)
        x = inputs.token_inputs(ids[rows, at], at)
        logits, own, cache = eagle.forward(w, cache, x, hidden[rows, at][:, None], spec=spec)
        with torch.no_grad():
            for b in range(2):
                n = int(at[b]) + 1
                want_logits, want_own = ref(ids[b : b + 1, :n], hidden[b : b + 1, :n])
                _close(logits[b, 0], want_logits[0, -1])
                _close(own[b, 0], want_own[0, -1])


def test_keys_with_and_without_the_model_prefix_load_alike(
    drafts: Callable[..., tuple[Any, Path]], target: Any, tmp_path: Path
) -> None:
    ref, bare = drafts(fc_bias=True)
    prefixed = reference.save_eagle_draft(ref, target.lm_head.weight, tmp_path / "prefixed", model_prefix=True)
    assert any(k.startswith("model.fc") for k in safetensors.torch.load_file(prefixed / "model.safetensors"))
    a, b = (eagle_io.read_eagle_draft(p).unwrap().weights for p in (bare, prefixed))
    for x, y in [
        (a.fc, b.fc),
        (a.fc_bias, b.fc_bias),
        (a.decoder.embed, b.decoder.embed),
        (a.decoder.lm_head, b.decoder.lm_head),
    ]:
        torch.testing.assert_close(x, y, atol=0, rtol=0)


# --- the target's hidden states -------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma3"])
def test_target_hidden_states_are_transformers_last_hidden_state(
    variant: str, tiny_checkpoint: Callable[..., Path], tiny_model: Callable[[str], Any]
) -> None:
    path = tiny_checkpoint(variant)
    spec = families.parse_model_spec(json.loads((path / "config.json").read_text())).unwrap()
    program = program_of(spec)
    w = program.weights(weight_io.get_state_dict(path, plan_of(spec)).unwrap(), spec=spec)
    prompts = [[1, 5, 7, 9, 11, 3, 4], [3, 8, 2]]
    x = inputs.prompt_inputs(prompts, length=8)
    cache = kv_cache.empty_cache(spec, batch=2, length=8, dtype=torch.float32)
    params, uniforms = torch.ones(2, 3), torch.full((2,), 0.5)
    plain = step.StepSpec(model=spec)
    asked = step.StepSpec(model=spec, hidden_states=True)
    assert plain.outputs == ("logits",) and asked.outputs == ("logits", decoder.HIDDEN)
    without, _ = step.step(program.forward_outputs, w, cache, x, params, uniforms, spec=plain)
    out, _ = step.step(program.forward_outputs, w, cache, x, params, uniforms, spec=asked)
    assert list(out.named()) == list(asked.outputs) and not without.extras
    # the same logits: without the option the last layer runs at the output tokens only (the
    # decoder's pruning), with it at every token, so the two differ by fp32 rounding alone
    torch.testing.assert_close(out.logits, without.logits)
    hidden = out.extras[decoder.HIDDEN]
    assert hidden.shape == (2, 8, spec.hidden_size)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            want = tiny_model(variant)(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(hidden[b, : len(p)], want, atol=1e-5, rtol=1e-5)


# --- checkpoint errors ----------------------------------------------------------------------------


def _edited(
    path: Path,
    tmp_path: Path,
    edit: Callable[[dict[str, torch.Tensor]], None] = lambda t: None,
    config: Callable[[str], str] = lambda c: c,
) -> Path:
    """A copy of the draft folder at `path` whose tensors `edit` changed (and config.json text `config`)."""
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text(config((path / "config.json").read_text()))
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    edit(tensors)
    checkpoint.write_safetensors(out / "model.safetensors", tensors)
    return out


def _problems(path: Path, **kwargs: Any) -> list[str]:
    read = eagle_io.read_eagle_draft(path, **kwargs)
    assert isinstance(read, Failure), read
    error = read.failure()
    assert isinstance(error, CheckpointError)
    return [p.render() for p in error.problems]


def test_a_draft_without_the_targets_lm_head_is_refused_with_the_fix(
    drafts: Callable[..., tuple[Any, Path]], tmp_path: Path
) -> None:
    path = _edited(drafts()[1], tmp_path, lambda t: t.pop("lm_head.weight"))
    (problem,) = _problems(path)
    assert problem.startswith(f"{path / 'model.safetensors'}: lm_head.weight: is required but missing")
    assert "copy the target's lm_head.weight" in problem


def test_an_fc_of_the_wrong_shape_is_refused(drafts: Callable[..., tuple[Any, Path]], tmp_path: Path) -> None:
    path = _edited(drafts()[1], tmp_path, lambda t: t.update({"fc.weight": t["fc.weight"][:, :64].contiguous()}))
    (problem,) = _problems(path)
    assert problem.startswith(
        f"{path / 'model.safetensors'}: fc.weight=(64, 64): has shape (64, 64), expected (64, 128)"
    )
    assert "[hidden_size, 2 * hidden_size]" in problem


def test_layout_mismatches_are_refused_with_their_fixes(
    drafts: Callable[..., tuple[Any, Path]], tmp_path: Path
) -> None:
    """An fc bias or input norms the configuration does not expect, and input norms it misses."""
    _, normed = drafts(input_norm=True)
    _, plain = drafts()
    unset = _edited(
        drafts(fc_bias=True)[1], tmp_path, config=lambda c: c.replace('"fc_bias": true', '"fc_bias": false')
    )
    (problem,) = _problems(unset)
    assert "fc.bias" in problem and "set fc_bias=True in the draft's config.json" in problem
    (problem,) = _problems(normed)  # read without enable_eagle_draft_input_norm
    assert "layers.0.input_layernorm.weight" in problem and "set enable_eagle_draft_input_norm=True" in problem
    (problem,) = _problems(plain, input_norm=True)
    assert "layers.0.input_layernorm.weight: is required but missing" in problem
    assert "enable_eagle_draft_input_norm=False" in problem


def test_a_final_norm_is_refused(drafts: Callable[..., tuple[Any, Path]], tmp_path: Path) -> None:
    path = _edited(drafts()[1], tmp_path, lambda t: t.update({"norm.weight": torch.ones(64)}))
    (problem,) = _problems(path)
    assert "norm.weight" in problem and "has no final norm" in problem


# --- configuration through the documented classes -------------------------------------------------


def test_a_draft_config_parses_loads_its_weights_and_is_refused_alone(drafts: Callable[..., tuple[Any, Path]]) -> None:
    _, path = drafts(input_norm=True, fc_bias=True)
    neuron_config = NeuronConfig(
        tp_degree=1, batch_size=1, seq_len=32, is_eagle_draft=True, enable_eagle_draft_input_norm=True
    )
    config = NeuronLlamaForCausalLM.get_config_cls()(neuron_config, load_config=load_pretrained_config(path))
    assert config.num_hidden_layers == 1 and config.fc_bias is True
    state = NeuronLlamaForCausalLM.get_state_dict(path, config)
    assert {"fc.weight", "fc.bias", "layers.0.input_layernorm.weight", "lm_head.weight"} <= set(state)
    assert "norm.weight" not in state and state["fc.weight"].shape == (64, 128)
    with pytest.raises(
        IncompatibleConfigError, match="is_eagle_draft=True: marks an EAGLE draft, which runs only inside"
    ):
        NeuronLlamaForCausalLM(str(path), config)
    plain = NeuronLlamaForCausalLM.get_config_cls()(
        NeuronConfig(tp_degree=1, batch_size=1, seq_len=32, is_eagle_draft=True),
        load_config=load_pretrained_config(path),
    )
    with pytest.raises(CheckpointValidationError, match="enable_eagle_draft_input_norm=True"):
        NeuronLlamaForCausalLM.get_state_dict(path, plain)


# --- training -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(target: Any) -> Iterator[tuple[Any, reference.EagleTraining]]:
    model = checkpoints.build_model("llama", seed=0)
    train_briefly(model)
    yield model, reference.train_eagle_draft(model)


def test_a_trained_draft_agrees_with_its_target(trained: tuple[Any, reference.EagleTraining], tmp_path: Path) -> None:
    """The draft's greedy proposals (fed the target's hidden state) equal the target's greedy tokens
    at >= AGREEMENT of held-out positions, in the reference and in the engine's programs."""
    model, result = trained
    assert result.agreement >= AGREEMENT, result.agreement
    path = reference.save_eagle_draft(result.draft, model.lm_head.weight, tmp_path / "draft")
    read = eagle_io.read_eagle_draft(path).unwrap()
    spec = read.spec
    target_spec = families.parse_model_spec(model.config.to_dict()).unwrap()
    program = program_of(target_spec)
    target_w = program.weights(_named(model, target_spec), spec=target_spec)
    seq = progression_batch(spec.vocab_size, batch=16, length=33, generator=torch.Generator().manual_seed(5))
    x = inputs.prompt_inputs(seq.tolist(), length=33)
    cache = kv_cache.empty_cache(target_spec, batch=16, length=33, dtype=torch.float32)
    logits, _, extras = program.forward_outputs(target_w, cache, x, spec=target_spec, all_logits=True, hidden=True)
    pairs, hidden = eagle.pair_inputs(x, extras[decoder.HIDDEN], logits[:, -1].argmax(-1))
    draft_cache = kv_cache.empty_cache(spec, batch=16, length=33, dtype=torch.float32)
    proposed, _, _ = eagle.forward(read.weights, draft_cache, pairs, hidden, spec=spec)
    engine = (proposed[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item()
    assert engine >= AGREEMENT, engine


def _named(model: Any, spec: Any) -> dict[str, torch.Tensor]:
    """A transformers model's weights converted by its family's plan."""
    return weight_ops.convert(plan_of(spec), dict(model.state_dict())).unwrap()


# --- greedy EAGLE speculation (host loop) ---------------------------------------------------------

ACCEPTANCE = 0.5
"""What the trained pair's draft tokens are accepted at, k = 4 (measured: 0.78)."""


def _pair(model: Any, draft: Any, tmp_path: Path) -> eagle_loop.Pair:
    """The target's program and the draft's, read from the draft's saved folder."""
    read = eagle_io.read_eagle_draft(reference.save_eagle_draft(draft, model.lm_head.weight, tmp_path / "pair"))
    spec = families.parse_model_spec(model.config.to_dict()).unwrap()
    program = program_of(spec)
    return eagle_loop.Pair(
        target_forward=program.forward_outputs,
        target_weights=program.weights(_named(model, spec), spec=spec),
        target_spec=spec,
        draft_weights=read.unwrap().weights,
        draft_spec=read.unwrap().spec,
    )


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("which", ["trained", "random"])
def test_greedy_eagle_speculation_gives_the_targets_greedy_tokens(
    trained: tuple[Any, reference.EagleTraining], tmp_path: Path, which: str, k: int
) -> None:
    """Token for token the target's greedy output (the engine's, and transformers' generate), from a
    batch at different positions, whether the draft is good (most tokens accepted) or random (none)."""
    model, result = trained
    draft = result.draft if which == "trained" else reference.from_target(model, seed=3)
    pair = _pair(model, draft, tmp_path)
    seq = progression_batch(pair.target_spec.vocab_size, batch=3, length=12, generator=torch.Generator().manual_seed(9))
    prompts = [seq[0, :5].tolist(), seq[1, :12].tolist(), seq[2, :1].tolist()]
    with torch.no_grad():
        tokens, stats = eagle_loop.generate(pair, prompts, k=k, max_new_tokens=24)
        assert tokens == eagle_loop.greedy(pair, prompts, max_new_tokens=24)
        for p, row in zip(prompts, tokens, strict=True):
            hf = model.generate(
                torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert row == hf[0, len(p) :].tolist()
    if which == "trained" and k == 4:
        assert stats.acceptance >= ACCEPTANCE and stats.target_steps < 24 / 2, stats

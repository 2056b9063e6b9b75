"""Fused speculation through the documented API: `enable_fused_speculation=True` and
`config.fused_spec_config = FusedSpecNeuronConfig(NeuronLlamaForCausalLM._model_cls, draft_config=...,
draft_model_path=...)`, then to_cpu() or compile() + load(), forward() and generate() without an
assistant model.

Drafts (all over the tiny llama's vocabulary): `weak` (one layer of other random weights: low
acceptance), `near` (the target with noise on its lm_head: some accepted, some not), `self` (the
target's own checkpoint: nearly every proposal accepted), and `trained` (a target and a one-layer
draft both briefly trained on the same data: high acceptance).

- greedy tokens equal transformers' greedy tokens at batch 1 and 4, through eager and compiled
  programs, with acceptance below / above stated bounds; only the fused programs run;
- forward()'s fused_outputs as NxDI's clients read them, and their logits against the plain models;
- after rejections both caches hold exactly the accepted tokens (as a prefill of them would);
- at the end of seq_len a step emits only what fits, and the next call is refused; rows at
  different positions cross token-generation buckets up to the last position (greedy, and seeded
  on-device sampling reproducible);
- sampling keeps the target's distribution (chi-square, stated false-failure rate);
- save / load: a fresh object loads the compiled folder (the draft's checkpoint pinned, or its
  weights in the folder) and gives the same tokens;
- async_mode, EOS, and every refusal.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import nxdi
from nxdi.core.host.logit_validation import max_relative_logit_error
from nxdi.core.programs import speculation
from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import ArtifactIntegrityError, IncompatibleConfigError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.testing import checkpoints, training
from tests.support.engine_fixtures import (
    NEW_TOKENS,
    PAD,
    PROMPTS,
    SEQ_LEN,
    hf_generate,
    load_model,
    padded,
    program_calls,
    runtime_of,
)
from tests.support.fused_models import K, fused_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LM = nxdi.NeuronLlamaForCausalLM
TRAINED_PROMPTS: tuple[tuple[int, ...], ...] = ((5, 8, 11, 14, 17), (100, 102), (7, 13, 19, 25, 31, 37, 43), (1,))
"""Progressions, the task the trained pair learned."""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path], tiny_model: Any) -> Any:
    """`pairs(name)` -> (target checkpoint, draft checkpoint, the target as a transformers model)."""
    root = tmp_path_factory.mktemp("fused-pairs")
    made: dict[str, tuple[Path, Path, Any]] = {}
    fmt = checkpoints.SaveFormat.SAFETENSORS

    def get(name: str) -> tuple[Path, Path, Any]:
        if name in made:
            return made[name]
        target, hf = tiny_checkpoint("llama"), tiny_model("llama")
        if name == "weak":
            draft, _ = checkpoints.build_checkpoint(root / name, "llama", fmt, seed=7, num_hidden_layers=1)
        elif name == "self":
            draft = target
        elif name == "near":
            model = checkpoints.build_model("llama", seed=0)
            with torch.no_grad():
                noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
                model.lm_head.weight.add_(noise * model.lm_head.weight.std())
            draft = checkpoints.save_checkpoint(model, root / name, fmt)
        else:
            assert name == "trained"
            hf = checkpoints.build_model("llama", seed=0)
            small = checkpoints.build_model("llama", seed=1, num_hidden_layers=1)
            for m in (hf, small):
                training.train_briefly(m, length=48)
            target = checkpoints.save_checkpoint(hf, root / "trained-target", fmt)
            draft = checkpoints.save_checkpoint(small, root / "trained-draft", fmt)
        made[name] = (target, draft, hf)
        return made[name]

    return get


@pytest.fixture(scope="module")
def fused(pairs: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """`fused(pair, compiled=False, fresh=False, **neuron_config)`: a loaded fused model, shared per arguments."""
    built: dict[str, Any] = {}
    workdir = tmp_path_factory.mktemp("fused-compiled")

    def get(name: str, *, compiled: bool = False, fresh: bool = False, **kwargs: Any) -> Any:
        key = repr((name, compiled, sorted(kwargs.items())))
        if fresh or key not in built:
            target, draft, _ = pairs(name)
            model = LM(target, fused_config(target, draft, **kwargs))
            if compiled:
                folder = workdir / f"c{len(list(workdir.iterdir()))}"
                model.compile(folder)
                model.load(folder)
            else:
                model.to_cpu()
            if fresh:
                return model
            built[key] = model
        return built[key]

    return get


def generate(model: Any, prompts: Sequence[Sequence[int]], **kwargs: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """generate() on the right-padded prompts, no assistant model: the new tokens and the stats."""
    adapter = HuggingFaceGenerationAdapter(model)
    ids, mask = padded(prompts, "right")
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    out = adapter.generate(ids, attention_mask=mask, **settings)
    return out[:, ids.shape[1] :], adapter.speculation_stats


# --- greedy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("pair", ["weak", "trained"])
def test_greedy_fused_speculation_gives_the_targets_greedy_tokens(
    batch: int, pair: str, fused: Callable[..., Any], pairs: Any
) -> None:
    """The weak draft's proposals are mostly rejected (acceptance < 0.5), the trained pair's mostly
    accepted (> 0.8): either way the tokens are the target's greedy tokens, 32 new per row, rows
    advancing by their own counts, through the context and fused programs only."""
    prompts = (PROMPTS if pair == "weak" else TRAINED_PROMPTS)[:batch]
    model = fused(pair, batch_size=batch)
    with program_calls(model) as calls:
        tokens, stats = generate(model, prompts)
    assert torch.equal(tokens, hf_generate(pairs(pair)[2], prompts, max_new_tokens=NEW_TOKENS))
    assert {c.phase.value for c in calls} == {"context_encoding", "fused_speculation"}
    rate = stats["accepted"] / stats["proposed"]
    assert (rate < 0.5) if pair == "weak" else (rate > 0.8), stats
    assert stats["emitted"] == batch * NEW_TOKENS and stats["target_steps"] == len(calls) - 1


def test_the_references_assisted_generation_route_runs_the_same_loop(fused: Callable[..., Any]) -> None:
    """NxDI's accuracy helpers set `prompt_lookup_num_tokens` on a fused model (transformers'
    assisted generation, no assistant_model): the same fused loop, the same tokens."""
    model = fused("weak", batch_size=1)
    plain, _ = generate(model, PROMPTS[:1], max_new_tokens=8)
    assert torch.equal(generate(model, PROMPTS[:1], max_new_tokens=8, prompt_lookup_num_tokens=K)[0], plain)


@pytest.mark.parametrize("sharded", [False, True], ids=["pinned-draft", "weights-in-folder"])
def test_a_compiled_fused_model_loads_in_a_fresh_object(sharded: bool, pairs: Any, tmp_path: Path) -> None:
    """compile() writes one program per bucket holding both models; `NeuronLlamaForCausalLM(folder)`
    reads the config back (FusedSpecNeuronConfig included) and load() gives the same tokens. Without
    save_sharded_checkpoint the draft's weights come from draft_model_path, pinned: a changed draft
    checkpoint is refused (until load(repin_checkpoint=True) accepts it, or shard_weights() puts
    both models' weights in the folder). With save_sharded_checkpoint the folder holds both
    models' weights: no draft checkpoint is read."""
    target, draft, hf = pairs("trained")
    draft = Path(shutil.copytree(draft, tmp_path / "draft"))
    folder = tmp_path / "compiled"
    model = LM(target, fused_config(target, draft, batch_size=4, save_sharded_checkpoint=sharded))
    model.compile(folder)
    programs = sorted(p.name for p in (folder / "programs").iterdir())
    assert programs == [f"context_encoding_{SEQ_LEN}.pt2", f"fused_speculation_{SEQ_LEN + K}.pt2"]
    assert (folder / "draft_source.json").is_file() and (folder / "weights").is_dir() == sharded
    expected = hf_generate(hf, TRAINED_PROMPTS, max_new_tokens=NEW_TOKENS)
    model.load(folder)
    assert torch.equal(generate(model, TRAINED_PROMPTS)[0], expected)
    model.close()
    changed = checkpoints.build_model("llama", seed=3, num_hidden_layers=1)
    checkpoints.save_checkpoint(changed, draft, checkpoints.SaveFormat.SAFETENSORS)
    again = LM(folder)
    assert again.config.fused_spec_config.draft_model_path == str(draft)
    if not sharded:
        with pytest.raises(ArtifactIntegrityError, match=re.escape(str(draft))):
            again.load(folder)
        again.load(folder, repin_checkpoint=True)  # accepts the draft as it is now: another draft,
        assert torch.equal(generate(again, TRAINED_PROMPTS)[0], expected)  # the same greedy tokens
        again.shard_weights(folder)  # both models' weights into the folder: the draft is not read again
        shutil.rmtree(draft)
        again.close()
        (fresh := LM(folder)).load(folder)
        assert torch.equal(generate(fresh, TRAINED_PROMPTS)[0], expected)
        return
    again.load(folder)  # the changed draft checkpoint is never read
    assert torch.equal(generate(again, TRAINED_PROMPTS)[0], expected)


# --- forward(): the fused_outputs contract ------------------------------------------------------------


def test_fused_outputs_follow_the_reference_contract(fused: Callable[..., Any], pairs: Any) -> None:
    """After context encoding: [0] the first token then -1, [1] that token, [2] the mask of the
    prompt, [3] the prompt lengths, [4]/[5] the draft's / target's logits of the last prompt token.
    After a fused step: [0] each row's accepted tokens then -1 (greedy acceptance of the draft's
    argmax proposals, read from [4], against the target's logits [5]), [1] its last accepted
    token, [3] its position plus its count; [4] and [5] equal the plain draft's and target's
    logits over [cur, d_1 .. d_{k-1}]. Rows accept different counts."""
    model = fused("near", batch_size=4, output_logits=True)
    _, draft_path, _ = pairs("near")
    plain = load_model(pairs("near")[0], "llama", batch_size=4)
    draft = load_model(draft_path, "llama", batch_size=4)
    ids, mask = padded(PROMPTS, "right")
    model.reset()
    out = model.forward(ids, attention_mask=mask)
    fo = out.fused_outputs
    lengths = mask.sum(-1, keepdim=True)
    target_logits = plain.forward(ids, attention_mask=mask).logits  # [B, 1, V]
    draft_logits = draft.forward(ids, attention_mask=mask).logits
    assert len(fo) == 6 and fo[0].shape == (4, K) and bool((fo[0][:, 1:] == -1).all())
    assert torch.equal(fo[0][:, 0], target_logits[:, -1].argmax(-1)) and torch.equal(fo[1], fo[0][:, :1])
    assert torch.equal(fo[3], lengths) and torch.equal(fo[2], (torch.arange(SEQ_LEN)[None] < lengths).long())
    _close(fo[5], target_logits)
    _close(fo[4], draft_logits)
    assert out.tokens is fo[0] and out.logits is fo[5]
    seen_counts: set[int] = set()
    for _ in range(4):
        at, cur = fo[3], fo[1]
        fo = model.forward(cur, position_ids=at).fused_outputs
        counts = (fo[3] - at)[:, 0]
        seen_counts.update(counts.tolist())
        proposals = fo[4].argmax(-1)[:, : K - 1]
        expected, expected_counts = speculation.greedy_accept(fo[5], proposals)
        assert torch.equal(counts, expected_counts) and torch.equal(fo[0], expected)
        assert torch.equal(fo[1][:, 0], fo[0].gather(1, (counts - 1)[:, None])[:, 0])
        fed = torch.cat([cur, proposals], 1)  # [B, k]: what both models were given
        for i in range(K):
            _close(fo[5][:, i], plain.forward(fed[:, i : i + 1], position_ids=at + i).logits[:, -1])
            _close(fo[4][:, i], draft.forward(fed[:, i : i + 1], position_ids=at + i).logits[:, -1])
    assert len(seen_counts) > 1, seen_counts


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    for a, b in zip(ours.reshape(-1, ours.shape[-1]), theirs.reshape(-1, theirs.shape[-1]), strict=True):
        assert max_relative_logit_error(b, a) <= 1e-5


def test_rejected_tokens_leave_nothing_in_either_cache(fused: Callable[..., Any], pairs: Any) -> None:
    """After fused steps that accept every proposal (where the draft's k-th step wrote the last
    one) and steps that reject some (the trained pair, on two progressions and two prompts that are
    not), each row's target and draft caches below its next position equal those of plain
    models that encoded only the emitted tokens (the rejected proposals' slots lie at or after it)."""
    model = fused("trained", batch_size=4)
    target_path, draft_path, _ = pairs("trained")
    prompts = (TRAINED_PROMPTS[0], PROMPTS[0], TRAINED_PROMPTS[2], PROMPTS[2])
    ids, mask = padded(prompts, "right")
    model.reset()
    fo = model.forward(ids, attention_mask=mask).fused_outputs
    seqs = [[*p, int(fo[0][r, 0])] for r, p in enumerate(prompts)]
    seen: list[int] = []
    for _ in range(6):
        fo, at = model.forward(fo[1], position_ids=fo[3]).fused_outputs, fo[3]
        counts = (fo[3] - at)[:, 0]
        seen += counts.tolist()
        for r in range(4):
            seqs[r] += fo[0][r, : int(counts[r])].tolist()
    assert K in seen and min(seen) < K, seen
    cache = runtime_of(model).cache
    layers = model.model_spec.num_layers
    for path, offset in ((target_path, 0), (draft_path, layers)):
        one = load_model(path, "llama", batch_size=1)
        for r, seq in enumerate(seqs):
            n = int(fo[3][r])
            assert n == len(seq) - 1  # the last emitted token is fed next, not cached yet
            one.reset()
            one.forward(torch.tensor([seq[:n]]))
            plain = runtime_of(one).cache
            for layer in range(len(plain.k)):
                for ours, theirs in ((cache.k, plain.k), (cache.v, plain.v)):
                    torch.testing.assert_close(
                        ours[offset + layer][r, :, :n], theirs[layer][0, :, :n], atol=1e-5, rtol=1e-4
                    )


# --- the end of seq_len ------------------------------------------------------------------------------


def test_the_last_positions_before_max_length(fused: Callable[..., Any], pairs: Any) -> None:
    """A row at position max_length - 2 whose draft is accepted everywhere emits only the 2 tokens
    that fit (the last at position max_length), the target's greedy ones; a call at max_length is
    refused. generate() to the last position gives the target's greedy tokens."""
    model = fused("self", batch_size=1)
    hf = pairs("self")[2]
    prompt = tuple(torch.randint(3, 150, (SEQ_LEN - 2,), generator=torch.Generator().manual_seed(0)).tolist())
    model.reset()
    fo = model.forward(torch.tensor([prompt])).fused_outputs
    assert int(fo[3]) == SEQ_LEN - 2
    fo = model.forward(fo[1], position_ids=fo[3]).fused_outputs
    assert int(fo[3]) == SEQ_LEN and fo[0][0, 2:].tolist() == [-1] * (K - 2)
    expected = hf_generate(hf, [prompt], max_new_tokens=3)
    assert fo[0][0, :2].tolist() == expected[0, 1:].tolist()
    with pytest.raises(IncompatibleConfigError, match=f"position {SEQ_LEN} is past max_length={SEQ_LEN}"):
        model.forward(fo[1], position_ids=fo[3])
    prompts = PROMPTS[2:3]  # 14 tokens + 51 new tokens: positions up to 64
    tokens, _ = generate(model, prompts, max_new_tokens=SEQ_LEN + 1 - len(prompts[0]))
    assert torch.equal(tokens, hf_generate(hf, prompts, max_new_tokens=SEQ_LEN + 1 - len(prompts[0])))
    with pytest.raises(IncompatibleConfigError, match="more than max_length"):
        generate(model, prompts, max_new_tokens=SEQ_LEN + 2 - len(prompts[0]))


BUCKETS = {"enable_bucketing": True, "token_generation_buckets": [16, 32, 48, 64], "context_encoding_buckets": [16, 64]}
"""Four token-generation buckets: generation to the end of seq_len crosses three boundaries."""


def test_rows_cross_token_generation_buckets_to_the_last_position(fused: Callable[..., Any], pairs: Any) -> None:
    """Four rows of different prompt lengths (so at different positions, accepting different counts)
    generate to the last position of seq_len through every token-generation bucket: each fused step
    runs the smallest program holding its rows, and the tokens are the target's greedy tokens.
    On-device sampling with a seed gives the same tokens on every run, and at top_k=1 the greedy ones."""
    new = SEQ_LEN + 1 - max(len(p) for p in TRAINED_PROMPTS)
    expected = hf_generate(pairs("trained")[2], TRAINED_PROMPTS, max_new_tokens=new)
    model = fused("trained", batch_size=4, **BUCKETS)
    with program_calls(model) as calls:
        tokens, stats = generate(model, TRAINED_PROMPTS, max_new_tokens=new)
    assert torch.equal(tokens, expected)
    assert {c.length for c in calls if c.phase.value == "fused_speculation"} == {b + K for b in (16, 32, 48, 64)}
    assert 0 < stats["accepted"] < stats["proposed"], stats
    sampled = fused("trained", batch_size=4, on_device_sampling_config={"do_sample": True}, **BUCKETS)
    runs = []
    for _ in range(2):
        sampled.set_seed(5)
        runs.append(generate(sampled, TRAINED_PROMPTS, max_new_tokens=new, do_sample=True, top_k=8)[0])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], expected)
    sampled.set_seed(5)
    assert torch.equal(generate(sampled, TRAINED_PROMPTS, max_new_tokens=new, do_sample=True, top_k=1)[0], expected)


# --- sampling ------------------------------------------------------------------------------------------


def test_sampled_fused_speculation_keeps_the_targets_distribution(fused: Callable[..., Any], pairs: Any) -> None:
    """The first two new tokens of sampled runs (top_k=3: 9 possible pairs); the second comes from
    the first fused step: the draft's greedy proposal (the target's own argmax: the `self` draft)
    accepted, or a residual draw. Against their exact probability
    p(t1) p(t2 | t1) from the plain target's logits, a chi-square test over the pairs with at
    least 5 expected draws fails when its p-value is below 1e-4 (the false-failure rate; the
    seed is fixed, so the outcome is too)."""
    model = fused("self", batch_size=4, on_device_sampling_config={"do_sample": True})
    one = load_model(pairs("self")[0], "llama", batch_size=1)
    prompt = PROMPTS[0]

    def top3(logits: torch.Tensor) -> dict[int, float]:
        values, ids = logits.float().topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    exact: dict[tuple[int, int], float] = {}
    one.reset()
    for t1, p1 in top3(one.forward(torch.tensor([prompt])).logits[0, -1]).items():
        one.reset()
        for t2, p2 in top3(one.forward(torch.tensor([(*prompt, t1)])).logits[0, -1]).items():
            exact[(t1, t2)] = p1 * p2
    model.set_seed(11)
    counts: dict[tuple[int, int], int] = {}
    runs, accepted, proposed = 200, 0, 0
    for _ in range(runs):
        tokens, stats = generate(model, [prompt] * 4, max_new_tokens=2, do_sample=True, top_k=3, temperature=1.0)
        accepted, proposed = accepted + stats["accepted"], proposed + stats["proposed"]
        for t1, t2 in tokens.tolist():
            counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    n = 4 * runs
    assert set(counts) <= set(exact), "a pair outside the target's top 3 x top 3"
    cells = [(pair, p * n) for pair, p in exact.items() if p * n >= 5]
    stat = sum((counts.get(pair, 0) - e) ** 2 / e for pair, e in cells)
    p_value = float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4, (stat, counts, exact)
    assert 0 < accepted < proposed, "both accepted proposals and residual draws are exercised"


# --- async_mode and EOS ----------------------------------------------------------------------------------


def test_async_mode_gives_the_same_tokens_and_runs_steps_ahead(fused: Callable[..., Any], pairs: Any) -> None:
    ahead = fused("weak", batch_size=4, async_mode=True, fresh=True)
    try:
        tokens, _ = generate(ahead, PROMPTS)
        assert torch.equal(tokens, generate(fused("weak", batch_size=4), PROMPTS)[0])
        assert ahead.async_stats.used > 0, ahead.async_stats
    finally:
        ahead.close()


def test_eos_stops_each_row_at_its_own_token(fused: Callable[..., Any], pairs: Any) -> None:
    hf = pairs("weak")[2]
    reference = hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS)
    eos = int(reference[0, 5])
    expected = hf_generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    tokens, _ = generate(fused("weak", batch_size=4), PROMPTS, eos_token_id=eos)
    assert torch.equal(tokens, expected) and int(tokens[0, 6]) == PAD


# --- refusals ----------------------------------------------------------------------------------------


def test_what_fused_speculation_cannot_run_is_refused_with_every_problem(pairs: Any, tmp_path: Path) -> None:
    target, draft, _ = pairs("weak")
    config = LM.get_config_cls()(
        NeuronConfig(
            torch_dtype="float32", seq_len=SEQ_LEN, speculation_length=K, enable_fused_speculation=True, tp_degree=2
        ),
        load_config=load_pretrained_config(target),
    )
    with pytest.raises(IncompatibleConfigError) as refused:
        LM(target, config)
    for text in ("fused_spec_config=None: is required", "on_device_sampling_config=None: is required", "tp_degree=2"):
        assert text in str(refused.value)
    other, _ = checkpoints.build_checkpoint(tmp_path / "v", "llama", checkpoints.SaveFormat.SAFETENSORS, vocab_size=200)
    config = fused_config(target, other)
    config.fused_spec_config.draft_config.neuron_config.update(batch_size=2, seq_len=128)
    with pytest.raises(IncompatibleConfigError) as refused:
        LM(target, config)
    for field in ("draft_config.vocab_size=200", "neuron_config.batch_size=2", "neuron_config.max_length=128"):
        assert field in str(refused.value)
    config = LM.get_config_cls()(
        NeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN), load_config=load_pretrained_config(target)
    )
    config.fused_spec_config = fused_config(target, draft).fused_spec_config
    with pytest.raises(IncompatibleConfigError, match="enable_fused_speculation=False"):
        LM(target, config)


def test_what_a_fused_model_cannot_do_at_run_time_is_refused(fused: Callable[..., Any]) -> None:
    model = fused("weak", batch_size=1)
    ids, mask = padded(PROMPTS[:1], "right")
    fo = model.forward(ids, attention_mask=mask).fused_outputs
    with pytest.raises(IncompatibleConfigError, match=r"input_ids: a fused-speculation step takes"):
        model.forward(torch.cat([fo[1], fo[1]], 1), position_ids=fo[3] + torch.arange(2))
    for extra, message in (
        ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
        ({"do_sample": True, "top_k": 5}, "samples greedily"),
        ({"assistant_model": fused("weak", batch_size=4)}, "runs its own draft"),
    ):
        with pytest.raises(IncompatibleConfigError, match=message):
            generate(model, PROMPTS[:1], max_new_tokens=4, **extra)

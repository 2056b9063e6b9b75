"""A mixture of experts' routing outputs (return_router_logits / return_expert_index) with the block
(paged) KV layout: per token of the call's `input_ids`, in its columns, as with the contiguous cache.

- fp32, eager, compiled (cpu backend) and at tp_degree=2: a right-padded two-prompt prefill (10 and
  2 tokens) over scattered blocks, then three decode steps, route every real token as the
  contiguous cache does within 1e-5 (the same experts), and as transformers does for each
  prompt alone; padding holds 0.0 / -1.
- Prefix caching: a cache hit returns the routing of the tokens after `computed_context_lens`
  only, also when the program computes some cached tokens again (its prefix bucket is shorter).
- Chunked prefill: the one row [1, T] of several requests' tokens routes as [T, X], token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdi.effects.manifest import read_manifest
from nxdi.shell.config import MoENeuronConfig
from nxdi.shell.inference_config import load_pretrained_config
from nxdi.shell.models import MixtralInferenceConfig, NeuronMixtralForCausalLM
from tests.support.engine_fixtures import PROMPTS, SEQ_LEN, padded, program_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUTING = {"return_router_logits": True, "return_expert_index": True}
BS = 4
"""pa_block_size."""
BLOCKS = dict(
    ROUTING,
    batch_size=2,
    ctx_batch_size=1,  # a two-row prefill runs as two programs: the rows' outputs are put together
    is_continuous_batching=True,
    is_block_kv_layout=True,
    pa_block_size=BS,
    pa_num_blocks=32,
)
ROWS = (PROMPTS[0], PROMPTS[3])  # 10 and 2 tokens
TABLES = ((17, 3, 25, 8, 30), (11, 5))
"""Each row's blocks, scattered (positions 0..19 and 0..7)."""
STEPS = ((5, 6), (7, 8), (9, 10))
"""Three decode steps' tokens, one per row."""


def _slots(table: Sequence[int], positions: range) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


def _table(table: Sequence[int], width: int = 6) -> list[int]:
    return [*table, *[0] * (width - len(table))]


def _prefill_blocks(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    lengths = mask.sum(-1).tolist()
    w = ids.shape[1]
    return model(
        ids,
        attention_mask=mask,
        slot_mapping=torch.tensor([_slots(t, range(n)) + [-1] * (w - n) for t, n in zip(TABLES, lengths, strict=True)]),
        block_table=torch.tensor([_table(t) for t in TABLES]),
    )


def _decode_blocks(model: Any, tokens: Sequence[int], positions: Sequence[int]) -> Any:
    return model(
        torch.tensor([[t] for t in tokens]),
        position_ids=torch.tensor([[p] for p in positions]),
        slot_mapping=torch.tensor([_slots(t, range(p, p + 1)) for t, p in zip(TABLES, positions, strict=True)]),
        block_table=torch.tensor([_table(t) for t in TABLES]),
        full_context_lens=torch.tensor([[p + 1] for p in positions]),
        computed_context_lens=torch.tensor([[p] for p in positions]),
    )


def _assert_same_routing(got: Any, want: Any, real: torch.Tensor) -> None:
    """`got`'s routing outputs equal `want`'s on the `real` [B*W] tokens; the others hold 0.0 / -1."""
    assert got.router_logits is not None and got.expert_index is not None, "the routing outputs are missing"
    assert len(got.router_logits) == len(want.router_logits) == len(got.expert_index)
    for logits, experts, theirs, their_experts in zip(
        got.router_logits, got.expert_index, want.router_logits, want.expert_index, strict=True
    ):
        assert logits.shape == theirs.shape and logits.dtype == torch.float32
        assert experts.shape == their_experts.shape and experts.dtype == torch.int64
        torch.testing.assert_close(logits[real], theirs[real], rtol=0, atol=1e-5)
        assert torch.equal(experts[real], their_experts[real])
        assert (logits[~real] == 0).all() and (experts[~real] == -1).all()


def _transformers(hf: Any, sequences: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, ...]]:
    """transformers' router logits per layer [n, X] of each sequence alone (no padding)."""
    with torch.no_grad():
        return [hf(torch.tensor([list(s)]), output_router_logits=True).router_logits for s in sequences]


def _run_and_compare(blocks: Any, contiguous: Any, hf: Any) -> None:
    """Prefill ROWS, then STEPS, on both models; the block model's routing against both references."""
    ids, mask = padded(ROWS, "right")
    contiguous.reset()
    blocks.reset()
    want = contiguous(ids, attention_mask=mask)
    got = _prefill_blocks(blocks, ids, mask)
    _assert_same_routing(got, want, mask.reshape(-1).bool())
    w = ids.shape[1]
    sequences = [list(p) for p in ROWS]
    per_step = [got]
    positions = [len(p) for p in ROWS]
    for tokens in STEPS:
        want = contiguous(torch.tensor([[t] for t in tokens]), position_ids=torch.tensor([[p] for p in positions]))
        got = _decode_blocks(blocks, tokens, positions)
        _assert_same_routing(got, want, torch.ones(len(tokens), dtype=torch.bool))
        per_step.append(got)
        for seq, t in zip(sequences, tokens, strict=True):
            seq.append(t)
        positions = [p + 1 for p in positions]
    for r, theirs in enumerate(_transformers(hf, sequences)):
        n = len(ROWS[r])
        for layer, want_layer in enumerate(theirs):
            prefill = per_step[0].router_logits[layer][r * w : r * w + n]
            decoded = torch.stack([out.router_logits[layer][r] for out in per_step[1:]])
            torch.testing.assert_close(torch.cat((prefill, decoded)), want_layer, rtol=0, atol=1e-5)


def test_block_routing_equals_the_contiguous_cache_and_transformers(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    blocks = loaded_model("mixtral", **BLOCKS)
    _run_and_compare(blocks, loaded_model("mixtral", batch_size=2, **ROUTING), tiny_model("mixtral"))


def test_compiled_block_programs_return_the_routing(
    loaded_model: Callable[..., Any],
    tiny_checkpoint: Callable[..., Path],
    tiny_model: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    path = tiny_checkpoint("mixtral")
    neuron = MoENeuronConfig(torch_dtype="float32", seq_len=SEQ_LEN, **BLOCKS)
    blocks = NeuronMixtralForCausalLM(path, MixtralInferenceConfig(neuron, load_config=load_pretrained_config(path)))
    blocks.compile(tmp_path)
    outputs = {p.signature.outputs for p in read_manifest(tmp_path).unwrap().programs}
    assert outputs == {("logits", "router_logits", "expert_index")}
    blocks.load(tmp_path)
    _run_and_compare(blocks, loaded_model("mixtral", batch_size=2, **ROUTING), tiny_model("mixtral"))


def test_every_rank_routes_alike_with_blocks_at_tp_degree_2(
    tp_model: Callable[..., Any], loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    blocks = tp_model("mixtral", tp_degree=2, **BLOCKS)
    _run_and_compare(blocks, loaded_model("mixtral", batch_size=2, **ROUTING), tiny_model("mixtral"))


PREFIX = dict(
    BLOCKS,
    batch_size=1,
    is_prefix_caching=True,
    enable_bucketing=True,
    context_encoding_buckets=[8, 16, 32],
    prefix_buckets=[8, 16],
)
PROMPT = (*PROMPTS[2][:14], 20, 21)
"""16 tokens: a hit of 12 runs on the (8 new, 8 prefix) program, which computes 4 cached ones again."""


def test_a_prefix_cache_hit_routes_only_the_tokens_after_the_cached_prefix(
    loaded_model: Callable[..., Any],
) -> None:
    model = loaded_model("mixtral", **PREFIX)
    model.reset()
    table, n = (9, 2, 14, 6), len(PROMPT)

    def prefill(hit: int) -> Any:
        return model(
            torch.tensor([PROMPT]),
            position_ids=torch.arange(n)[None],
            slot_mapping=torch.tensor([_slots(table, range(hit, n)) + [-1] * hit]),
            block_table=torch.tensor([_table(table)]),
            full_context_lens=torch.tensor([[n]]),
            computed_context_lens=torch.tensor([[hit]]),
        )

    whole = prefill(0)
    with program_calls(model) as calls:
        hit = prefill(12)
    assert [k.length - k.tokens for k in calls] == [8], "4 of the 12 cached tokens are computed again"
    real = torch.arange(n) >= 12
    _assert_same_routing(hit, whole, real)


CHUNKED = dict(
    BLOCKS, batch_size=1, ctx_batch_size=1, chunked_prefill_config={"max_num_seqs": 4}, max_context_length=16
)


def test_chunked_prefill_routes_every_token_of_the_row(
    loaded_model: Callable[..., Any], tiny_model: Callable[[str], Any]
) -> None:
    """Two calls: A's first 6 tokens with B's whole prompt, then A's last 4 with B's first decode token."""
    model = loaded_model("mixtral", **CHUNKED)
    model.reset()
    a, b = PROMPTS[0], PROMPTS[3]
    tables = ((21, 4, 13), (7, 30))
    parts_per_call = (((0, 0, 6), (1, 0, 2)), ((0, 6, 10), (1, 2, 3)))  # (request, start, end)
    sequences = [list(a), [*b, 40]]
    outs = []
    for parts in parts_per_call:
        ids = [sequences[r][p] for r, s, e in parts for p in range(s, e)]
        outs.append(
            model(
                torch.tensor([ids]),
                position_ids=torch.tensor([[p for _, s, e in parts for p in range(s, e)]]),
                slot_mapping=torch.tensor([x for r, s, e in parts for x in _slots(tables[r], range(s, e))]),
                block_table=torch.tensor([_table(t, 3) for t in tables]),
                full_context_lens=torch.tensor([e for _, _, e in parts]),
                computed_context_lens=torch.tensor([s for _, s, _ in parts]),
            )
        )
    theirs = _transformers(tiny_model("mixtral"), sequences)
    for out, parts in zip(outs, parts_per_call, strict=True):
        t = sum(e - s for _, s, e in parts)
        assert len(out.router_logits) == len(theirs[0])
        for layer, logits in enumerate(out.router_logits):
            assert logits.shape[0] == t == out.expert_index[layer].shape[0]
            want = torch.cat([theirs[r][layer][s:e] for r, s, e in parts])
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
            k = out.expert_index[layer].shape[-1]
            assert torch.equal(out.expert_index[layer], torch.topk(want, k, dim=-1).indices)

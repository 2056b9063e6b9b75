"""GQA head math and weight sharding against REFERENCE §4 and the transformers-neuronx guide."""

from __future__ import annotations

import pytest
from returns.result import Failure, Success

from nxdi.core.planning import gqa, sharding
from nxdi.core.platform import Platform
from tests.support.planner_configs import LLAMA_3_8B, LLAMA_31_70B, MIXTRAL_8X7B, OPT_13B, spec

R, M = gqa.GQAStrategy.REPLICATE_TO_TP_DEGREE, gqa.GQAStrategy.CONVERT_TO_MHA


@pytest.mark.parametrize(
    ("q", "kv", "tp", "strategy", "q_rank", "kv_rank", "repeat"),
    [
        (32, 8, 32, R, 1, 1, 1),  # Llama-3-8B: KV x4 replicated, Q unpadded
        (64, 8, 32, R, 2, 1, 2),  # Llama-3-70B
    ],
)
def test_reference_table_rows(
    q: int, kv: int, tp: int, strategy: gqa.GQAStrategy, q_rank: int, kv_rank: int, repeat: int
) -> None:
    chosen, notes = gqa.determine_strategy(tp, kv)
    c = gqa.shardable_head_counts(tp, q, kv, chosen).unwrap()
    assert (chosen, notes) == (strategy, ())
    assert (c.q_padded, c.kv_padded) == (q, tp)
    assert (c.q_per_rank, c.kv_per_rank, c.kv_groups) == (q_rank, kv_rank, repeat)
    layout = gqa.head_layout(c)
    assert layout.kv_sources == tuple(j // (tp // kv) for j in range(tp))  # each KV head repeated tp/kv times


def test_llama_70b_rank_heads() -> None:
    layout = gqa.head_layout(gqa.shardable_head_counts(32, 64, 8, R).unwrap())
    for r in range(32):
        assert layout.rank_q_heads(r) == (2 * r, 2 * r + 1) and layout.rank_kv_heads(r) == (r // 4,)


def test_tp1_with_8_kv_heads_converts_to_mha_with_a_note() -> None:
    strategy, notes = gqa.determine_strategy(1, 8)
    assert strategy is M and len(notes) == 1 and "CONVERT_TO_MHA" in notes[0]
    c = gqa.shardable_head_counts(1, 32, 8, strategy).unwrap()
    assert (c.q_padded, c.kv_padded) == (32, 8)  # nothing actually needs converting at tp=1


def test_interleaved_q_padding_for_replicate() -> None:
    c = gqa.shardable_head_counts(16, 24, 8, R).unwrap()  # q' = 32: one zero head after each group of 3
    assert (c.q_padded, c.kv_padded) == (32, 16)
    N = None
    assert gqa.head_layout(c).q_sources == (
        0,
        1,
        2,
        N,
        3,
        4,
        5,
        N,
        6,
        7,
        8,
        N,
        9,
        10,
        11,
        N,
        12,
        13,
        14,
        N,
        15,
        16,
        17,
        N,
        18,
        19,
        20,
        N,
        21,
        22,
        23,
        N,
    )


def test_tail_padding_for_mha() -> None:
    c = gqa.shardable_head_counts(8, 25, 25, M).unwrap()  # gpt2-xl-like: 25 heads over 8 ranks
    assert (c.q_padded, c.kv_padded, c.q_per_rank) == (32, 32, 4)
    layout = gqa.head_layout(c)
    assert layout.q_sources == (*range(25), *([None] * 7)) and layout.kv_sources == layout.q_sources
    c = gqa.shardable_head_counts(12, 32, 8, M).unwrap()  # GQA converted: KV repeated 4x then tail padded
    assert gqa.head_layout(c).kv_sources == (*(h // 4 for h in range(32)), None, None, None, None)


def test_replicate_is_refused_when_tp_is_not_a_multiple_of_kv() -> None:
    assert isinstance(gqa.shardable_head_counts(12, 32, 8, R), Failure)


@pytest.mark.parametrize(("tp", "kv", "q", "group"), [(32, 4, 8, 2), (32, 1, 8, 8), (16, 8, 32, 2)])
def test_flash_decoding_groups(tp: int, kv: int, q: int, group: int) -> None:
    assert gqa.flash_decoding_group(tp, q, kv) == Success(group)


def test_flash_decoding_needs_whole_groups() -> None:
    assert gqa.flash_decoding_group(4, 32, 8).failure().fields() == {"flash_decoding_enabled"}


def test_transformers_neuronx_strategies() -> None:
    T = gqa.TnxStrategy
    kw = dict(q=32, kv=8, head_dim=128)
    assert gqa.determine_tnx_strategy(None, tp=8, batch_sizes=[1], **kw) == (T.SHARD_OVER_HEADS, ())
    s, notes = gqa.determine_tnx_strategy(None, tp=32, batch_sizes=[1], **kw)
    assert s is T.REPLICATED_HEADS and "replicating" in notes[0]
    s, notes = gqa.determine_tnx_strategy(T.SHARD_OVER_BATCH, tp=32, batch_sizes=[4], **kw)
    assert s is T.REPLICATED_HEADS and len(notes) == 2
    assert gqa.determine_tnx_strategy(T.SHARD_OVER_BATCH, tp=32, batch_sizes=[32, 64], **kw)[0] is T.SHARD_OVER_BATCH
    assert gqa.determine_tnx_strategy(T.ALL_GATHER_HEADS, tp=32, batch_sizes=[1], **kw)[0] is T.ALL_GATHER_HEADS

    def heads(strategy: gqa.TnxStrategy, tp: int, batch: int) -> tuple[int, int, int, int]:
        h = gqa.tnx_heads_per_rank(strategy, tp=tp, batch_size=batch, **kw).unwrap()
        return h.q_heads_per_rank, h.kv_cache_heads_per_rank, h.kv_cache_batch_per_rank, h.kv_weight_columns_per_rank

    assert heads(T.SHARD_OVER_HEADS, 8, 4) == (4, 1, 4, 128)
    assert heads(T.SHARD_OVER_BATCH, 32, 64) == (1, 8, 2, 32)
    assert heads(T.REPLICATED_HEADS, 32, 4) == (1, 1, 4, 128)
    assert heads(T.ALL_GATHER_HEADS, 32, 4) == (1, 1, 4, 32)  # a quarter of a KV head's columns per rank
    assert isinstance(gqa.tnx_heads_per_rank(T.SHARD_OVER_HEADS, tp=32, batch_size=1, **kw), Failure)


def test_llama_3_8b_weight_table_at_tp32() -> None:
    plan = sharding.shard_plan(spec(LLAMA_3_8B), tp=32).unwrap()
    rules = {w.name: (w.rule, w.dim, w.padded_shape, w.rank_shape(5)) for w in plan.weights}
    C, Rw, Rep = sharding.ShardRule.COLUMN_PARALLEL, sharding.ShardRule.ROW_PARALLEL, sharding.ShardRule.REPLICATED
    a, m = "layers.{i}.self_attn", "layers.{i}.mlp"
    assert rules[f"{a}.q_proj.weight"] == (C, 0, (4096, 4096), (128, 4096))
    assert rules[f"{a}.k_proj.weight"] == (C, 0, (4096, 4096), (128, 4096))  # 8 KV heads replicated to 32
    assert rules[f"{a}.o_proj.weight"] == (Rw, 1, (4096, 4096), (4096, 128))
    assert rules[f"{m}.gate_proj.weight"] == (C, 0, (14336, 4096), (448, 4096))
    assert rules[f"{m}.down_proj.weight"] == (Rw, 1, (4096, 14336), (4096, 448))
    assert rules["layers.{i}.input_layernorm.weight"] == (Rep, None, (4096,), (4096,))
    assert rules["embed_tokens.weight"] == (C, 1, (128256, 4096), (128256, 128))
    assert rules["lm_head.weight"] == (C, 0, (128256, 4096), (4008, 4096))
    k = plan.weight(f"{a}.k_proj.weight")
    assert (
        k.rank_spans[5] == ((640, 768),)
        and k.remap is not None
        and k.remap.indices()[640:768] == tuple(range(128, 256))
    )  # rank 5 holds a copy of KV head 1


def test_vocab_parallel_and_padding() -> None:
    opt = spec(OPT_13B)  # vocab 50272 is not a multiple of 24
    plan = sharding.shard_plan(opt, tp=24, vocab_parallel=True).unwrap()
    embed = plan.weight("embed_tokens.weight")
    assert embed.rule is sharding.ShardRule.VOCAB_PARALLEL and embed.padded_shape == (50280, 5120)
    assert embed.rank_shape(0) == (2095, 5120) and embed.remap is not None
    assert embed.remap.indices()[-8:] == (None,) * 8
    assert "embed_positions.weight" in {w.name for w in plan.weights}
    assert plan.counts.q_padded == 48 and any("zero Q heads" in n for n in plan.notes)


def test_fused_qkv_rank_holds_its_q_k_v() -> None:
    plan = sharding.shard_plan(spec(LLAMA_31_70B), tp=32, fused_qkv=True).unwrap()
    w = plan.weight("layers.{i}.self_attn.Wqkv.weight")
    assert w.shape == ((64 + 16) * 128, 8192) and w.padded_shape == ((64 + 64) * 128, 8192)
    assert w.rank_spans[1] == ((256, 512), (8192 + 128, 8192 + 256), (12288 + 128, 12288 + 256))
    assert w.rank_shape(1) == (512, 8192)


def test_valid_tp_degrees_per_platform() -> None:
    assert sharding.valid_tp_degrees(Platform.TRN1, 1) == (1, 2, 8, 16, 32)
    assert sharding.valid_tp_degrees(Platform.INF2, 1) == (1, 2, 4, 8, 24)
    assert sharding.valid_tp_degrees(Platform.TRN2, 2) == (1, 2, 4, 8, 16, 32, 64)
    assert sharding.valid_tp_degrees(Platform.TRN1, 1, instance="trn1.2xlarge") == (1, 2)
    assert sharding.check_tp_degree(8, platform=Platform.TRN1, lnc=1) == Success(8)
    err = sharding.check_tp_degree(4, platform=Platform.TRN1, lnc=1, instance="trn1.2xlarge").failure()
    assert len(err.problems) == 2 and err.fields() == {"tp_degree"}
    assert sharding.check_tp_degree(4, platform=Platform.INF2, lnc=2).failure().fields() == {"logical_nc_config"}


def test_sequence_parallel_feasibility() -> None:
    assert sharding.check_sequence_parallel(32, [128, 256]) == Success(32)
    err = sharding.check_sequence_parallel(24, [128, 240, 256]).failure()
    assert "[128, 256]" in err.problems[0].reason


def test_multi_head_models_get_no_strategy_warning() -> None:
    """OPT-style MHA (40 Q = 40 KV) at tp 8: CONVERT_TO_MHA changes nothing, so nothing to warn about."""
    strategy, notes = gqa.determine_strategy(8, 40, q=40)
    assert strategy is M and notes == ()
    assert gqa.determine_strategy(8, 10, q=40)[1] != ()


def test_mixtral_8x7b_experts_at_tp32_with_8_expert_groups() -> None:
    """moe_ep_degree=8, moe_tp_degree=4: ranks 4g..4g+3 hold expert g, each a quarter of its width."""
    plan = sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32, moe_ep=8).unwrap()
    gate = plan.weight("layers.{i}.mlp.experts.gate_proj.weight")
    down = plan.weight("layers.{i}.mlp.experts.down_proj.weight")
    assert gate.rank_shape(5) == (1, 3584, 4096) and down.rank_shape(5) == (1, 4096, 3584)
    assert gate.expert_spans is not None and gate.expert_spans[5] == (1, 2)  # rank 5: expert group 1
    assert gate.rank_spans[5] == ((3584, 7168),) and down.rank_spans[5] == ((3584, 7168),)  # quarter 1
    assert plan.weight("layers.{i}.mlp.router.weight").rank_shape(5) == (8, 4096)  # every rank routes
    assert sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32).unwrap().weight(gate.name).rank_shape(5) == (8, 448, 4096)
    for ep in (3, 16, 64):  # divides neither tp nor the 8 experts, or not both
        bad = sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32, moe_ep=ep)
        assert isinstance(bad, Failure) and bad.failure().problems[0].field == "moe_ep_degree"


def test_hybrid_sharding_gives_every_rank_token_generations_copy_of_the_experts() -> None:
    """NxD's `mlp_op_tkg`: context encoding's layout under `experts`, token generation's under
    `experts_tkg`, each with its own expert groups; an ep degree that does not divide is named."""
    plan = sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32, moe_ep=1, tkg_ep=8).unwrap()
    assert plan.hybrid and not sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32, moe_ep=8).unwrap().hybrid
    cte = plan.weight("layers.{i}.mlp.experts.gate_proj.weight")
    tkg = plan.weight("layers.{i}.mlp.experts_tkg.gate_proj.weight")
    assert cte.rank_shape(5) == (8, 448, 4096) and cte.expert_spans is None
    assert tkg.rank_shape(5) == (1, 3584, 4096) and tkg.expert_spans is not None and tkg.expert_spans[5] == (1, 2)
    assert plan.experts_per_rank(5) == (8, 448) and plan.experts_per_rank(5, token_generation=True) == (1, 3584)
    bad = sharding.shard_plan(spec(MIXTRAL_8X7B), tp=32, moe_ep=3, tkg_ep=16)
    assert isinstance(bad, Failure)
    fields = [p.field for p in bad.failure().problems]
    assert fields == ["hybrid_sharding_config.moe_cte_ep_degree", "hybrid_sharding_config.moe_tkg_ep_degree"]

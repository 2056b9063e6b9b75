"""Cross-field rules of NeuronSpec, each returning the problems it finds. Pure.

Every rule runs on every spec, so a user sees all problems at once. Rules follow the reference's
ValueError / AssertionError / IncompatibleConfigError conditions (REFERENCE §2.1) and the seeds'
documented requirements; each problem names the field, the value, why, and the fix.
`check_neuron_spec` runs the rules of a spec alone; `check_attention_chunking` the ones that also
need model attributes. What the CPU engine and each backend refuse is `nxdi.core.config.cpu_support`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from returns.result import Result

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import ConfigError, Problem, problems_result
from nxdi.core.planning import eagle_tree, medusa

Rule = Callable[[NeuronSpec], Iterator[Problem]]


def _lengths(s: NeuronSpec) -> Iterator[Problem]:
    if s.max_context_length > s.max_length:
        yield Problem.of(
            "max_context_length",
            s.max_context_length,
            f"cannot be more than max_length={s.max_length}",
            "lower max_context_length or raise max_length/seq_len",
        )
    if s.attention_dtype is not None and s.attention_dtype != s.torch_dtype and s.cast_type != "as-declared":
        yield Problem.of(
            "attention_dtype",
            s.attention_dtype,
            f"differs from torch_dtype={s.torch_dtype!r}, which needs cast_type='as-declared'",
            "set cast_type='as-declared' or drop attention_dtype",
        )


def _bucket_list(name: str, buckets: tuple[int, ...] | None, limit: int, limit_name: str) -> Iterator[Problem]:
    if buckets is None:
        return
    if not buckets:
        yield Problem.of(name, list(buckets), "is empty", "give at least one bucket or leave it unset")
        return
    if any(b <= 0 for b in buckets):
        yield Problem.of(name, list(buckets), "has a non-positive bucket", "use positive lengths")
    if len(set(buckets)) != len(buckets):
        yield Problem.of(name, list(buckets), "has duplicate buckets", "list each length once")
    if max(buckets) > limit:
        yield Problem.of(
            name, list(buckets), f"has a bucket above {limit_name}={limit}", f"keep buckets <= {limit_name}"
        )


def _buckets(s: NeuronSpec) -> Iterator[Problem]:
    yield from _bucket_list(
        "context_encoding_buckets", s.context_encoding_buckets, s.max_context_length, "max_context_length"
    )
    yield from _bucket_list("token_generation_buckets", s.token_generation_buckets, s.max_length, "max_length")
    batches = s.token_generation_batches
    if batches is not None and (not batches or max(batches) > s.tkg_batch_size or min(batches) <= 0):
        yield Problem.of(
            "token_generation_batches",
            list(batches),
            f"must be non-empty batch sizes in 1..tkg_batch_size={s.tkg_batch_size}",
            "keep every batch bucket <= tkg_batch_size",
        )
    if batches is not None:
        clashing = [
            name
            for name, on in (
                ("speculation_length", s.speculation_length > 0),
                ("enable_fused_speculation", s.enable_fused_speculation),
                ("enable_eagle_speculation", s.enable_eagle_speculation),
                ("is_medusa", s.is_medusa),
                ("token_tree_config", s.token_tree_config is not None),
                ("chunked_prefill_config", s.chunked_prefill_config is not None),
                ("is_prefix_caching", s.is_prefix_caching),
                ("is_block_kv_layout", s.is_block_kv_layout),
            )
            if on
        ]
        if clashing:
            yield Problem.of(
                "token_generation_batches",
                list(batches),
                f"(batch bucketing) is not supported with {', '.join(clashing)}",
                "drop token_generation_batches or those features",
            )


def _features(s: NeuronSpec) -> Iterator[Problem]:
    if s.quantized and s.quantized_checkpoints_path is None:
        yield Problem.of("quantized_checkpoints_path", None, "is required when quantized=True", "set the path")
    if s.is_full_model_shuffled and not (s.is_mxfp4_compute or s.is_eagle_draft):
        yield Problem.of("is_full_model_shuffled", True, "needs is_mxfp4_compute or is_eagle_draft")
    if s.async_mode and s.on_device_sampling_config is None:
        yield Problem.of(
            "async_mode",
            True,
            "needs on-device sampling: a step launched ahead is fed the tokens the previous step sampled",
            "set on_device_sampling_config, or async_mode=False",
        )
    if s.is_medusa and s.async_mode:
        yield Problem.of("async_mode", True, "is not supported with Medusa (is_medusa=True)", "set async_mode=False")
    if s.is_medusa and (s.medusa_speculation_length <= 0 or s.num_medusa_heads <= 0):
        yield Problem.of("is_medusa", True, "needs medusa_speculation_length > 0 and num_medusa_heads > 0", "set both")
    if s.enable_fused_speculation and s.speculation_length <= 0:
        yield Problem.of("speculation_length", s.speculation_length, "must be > 0 with fused speculation")
    if s.enable_fused_speculation and s.is_medusa:
        why = "is a speculation mode of its own: a model speculates with Medusa heads or a fused draft, not both"
        yield Problem.of("is_medusa", True, why, "set is_medusa=False or enable_fused_speculation=False")
    cp = s.chunked_prefill_config
    if cp is not None and not s.is_block_kv_layout:
        yield Problem.of("chunked_prefill_config", "set", "needs is_block_kv_layout=True", "enable the block KV layout")
    if cp is not None and not cp.tkg_model_enabled and s.batch_size != 1:
        yield Problem.of("batch_size", s.batch_size, "must be 1 when chunked prefill has no token-generation model")
    if s.tensor_capture_config is not None and s.on_device_sampling_config is None:
        yield Problem.of("tensor_capture_config", "set", "needs on-device sampling", "set on_device_sampling_config")
    yield from _kv_quant(s)
    odc = s.on_device_sampling_config
    if odc is not None and odc.global_topk > 0 and odc.top_k > odc.global_topk:
        yield Problem.of(
            "on_device_sampling_config.top_k",
            odc.top_k,
            f"exceeds global_topk={odc.global_topk}",
            "raise global_topk or lower top_k",
        )


def _kv_quant(s: NeuronSpec) -> Iterator[Problem]:
    """A direct cast has no scales, so only the per-tensor methods (the defaults) go with it (NxD's
    `KVQuantizationConfig` asserts the same)."""
    kq = s.kv_quant_config
    if kq is None or not kq.direct_cast:
        return
    for name in ("k_quant_method", "v_quant_method"):
        value = getattr(kq, name)
        if value != "per_tensor_symmetric":
            why = "must be per_tensor_symmetric with direct_cast=True (a direct cast uses no scales)"
            yield Problem.of(f"kv_quant_config.{name}", value, why, f"remove {name}, or set direct_cast=False")


def _parallel(s: NeuronSpec) -> Iterator[Problem]:
    if s.tp_degree % s.cp_degree:
        yield Problem.of(
            "cp_degree",
            s.cp_degree,
            f"must divide tp_degree={s.tp_degree} (TP Degree must be evenly divisible by CP Degree)",
        )
    if s.mlp_cp_degree > 1 and not s.sequence_parallel_enabled:
        yield Problem.of("mlp_cp_degree", s.mlp_cp_degree, "> 1 needs sequence_parallel_enabled=True")
    if s.strided_context_parallel_kernel_enabled and s.cp_degree <= 1:
        yield Problem.of("strided_context_parallel_kernel_enabled", True, "needs cp_degree > 1")
    if s.sequence_parallel_enabled and s.max_context_length % s.tp_degree:
        yield Problem.of(
            "sequence_parallel_enabled",
            True,
            f"needs max_context_length={s.max_context_length} divisible by tp_degree={s.tp_degree}",
            "pick a context length that is a multiple of tp_degree",
        )
    yield from _attention_dp(s)
    yield from _moe_degrees(s)


def _moe_degrees(s: NeuronSpec) -> Iterator[Problem]:
    """The MoE layers' ranks: moe_ep_degree expert groups of moe_tp_degree ranks make up tp_degree
    (moe_tp_degree 1 with moe_ep_degree 1 means unset: every rank splits every expert); with
    `hybrid_sharding_config`, its context-encoding and token-generation pairs each make up tp_degree
    and replace moe_tp_degree/moe_ep_degree (which may then only repeat the context-encoding pair)."""
    if s.moe is None:
        return
    tp, moe_tp, moe_ep = s.tp_degree, s.moe.moe_tp_degree, s.moe.moe_ep_degree
    h = s.moe.hybrid_sharding_config
    if h is not None:
        for phase in ("cte", "tkg"):
            p_tp, p_ep = getattr(h, f"moe_{phase}_tp_degree"), getattr(h, f"moe_{phase}_ep_degree")
            if p_tp * p_ep != tp:
                why = (
                    f"x moe_{phase}_ep_degree={p_ep} must equal tp_degree={tp}: the ranks are laid out as expert groups"
                )
                fix = f"set moe_{phase}_tp_degree={tp // p_ep}" if tp % p_ep == 0 else f"use an ep degree dividing {tp}"
                yield Problem.of(f"hybrid_sharding_config.moe_{phase}_tp_degree", p_tp, why, fix)
        for name, value, cte in (
            ("moe_tp_degree", moe_tp, h.moe_cte_tp_degree),
            ("moe_ep_degree", moe_ep, h.moe_cte_ep_degree),
        ):
            if value != 1 and value != cte:
                why = "is replaced by hybrid_sharding_config's degrees, which differ"
                yield Problem.of(name, value, why, "leave it 1 (hybrid_sharding_config sets both phases)")
        return
    if moe_ep == 1 and moe_tp not in (1, tp):
        why = f"must equal tp_degree={tp} (moe_tp_degree x moe_ep_degree = tp_degree, moe_ep_degree=1)"
        yield Problem.of("moe_tp_degree", moe_tp, why, f"set moe_tp_degree={tp} or leave it 1")
    elif moe_ep > 1 and moe_tp * moe_ep != tp:
        why = f"x moe_ep_degree={moe_ep} must equal tp_degree={tp}: the ranks are laid out as expert groups"
        fix = f"set moe_tp_degree={tp // moe_ep}" if tp % moe_ep == 0 else f"use a moe_ep_degree dividing {tp}"
        yield Problem.of("moe_tp_degree", moe_tp, why, fix)


def _attention_dp(s: NeuronSpec) -> Iterator[Problem]:
    dp = s.attention_dp_degree
    if dp <= 1:
        return
    if s.tp_degree % dp:
        yield Problem.of(
            "attention_dp_degree",
            dp,
            f"must divide tp_degree={s.tp_degree} (TP Degree must be evenly divisible by DP Degree)",
        )
    if s.tkg_batch_size % dp:
        yield Problem.of(
            "attention_dp_degree",
            dp,
            f"must divide tkg_batch_size={s.tkg_batch_size} (Batch Size must be evenly divisible by DP Degree)",
        )
    if s.cp_degree > 1 and (s.cp_degree < dp or s.cp_degree % dp):
        yield Problem.of("cp_degree", s.cp_degree, f"must be a multiple of attention_dp_degree={dp}")
    if not s.is_continuous_batching:
        yield Problem.of("is_continuous_batching", False, "must be enabled when running attention DP")
    if s.attn_block_tkg_nki_kernel_cache_update and not s.kv_cache_update_with_kernel:
        yield Problem.of("kv_cache_update_with_kernel", False, "is needed for block cache update with attention DP")
    if s.ep_dispatch_cc_option == "RS_AG" and s.tp_degree > s.tkg_batch_size:
        yield Problem.of("ep_dispatch_cc_option", "RS_AG", f"needs tp_degree <= tkg_batch_size={s.tkg_batch_size}")


def _requires(s: NeuronSpec, flag: str, needs: tuple[str, ...], why: str) -> Iterator[Problem]:
    if getattr(s, flag) and not any(getattr(s, n) for n in needs):
        yield Problem.of(flag, True, why, f"set {' or '.join(needs)}")


def _kernels(s: NeuronSpec) -> Iterator[Problem]:
    yield from _requires(s, "qkv_kernel_enabled", ("fused_qkv",), "needs fused_qkv=True")
    yield from _requires(s, "quantized_mlp_kernel_enabled", ("mlp_kernel_enabled",), "needs mlp_kernel_enabled=True")
    yield from _requires(
        s, "rmsnorm_quantize_kernel_enabled", ("quantized_mlp_kernel_enabled",), "needs the quantized MLP kernel"
    )
    qkv = ("qkv_kernel_enabled", "qkv_nki_kernel_enabled")
    yield from _requires(s, "attn_block_tkg_nki_kernel_enabled", qkv, "needs a QKV kernel")
    for flag in ("attn_block_tkg_nki_kernel_cache_update", "attn_block_tkg_nki_kernel_cascaded_attention"):
        yield from _requires(s, flag, ("attn_block_tkg_nki_kernel_enabled",), "needs attn_block_tkg_nki_kernel_enabled")
    if s.qkv_cte_nki_kernel_fuse_rope and not (s.qkv_kernel_enabled and s.qkv_nki_kernel_enabled):
        yield Problem.of("qkv_cte_nki_kernel_fuse_rope", True, "needs qkv_kernel_enabled and qkv_nki_kernel_enabled")
    for flag in ("qkv_kernel_enabled", "mlp_kernel_enabled"):
        if getattr(s, flag) and s.torch_dtype != "bfloat16":
            yield Problem.of(flag, True, f"needs torch_dtype='bfloat16', not {s.torch_dtype!r}")
    for flag, clash in (
        ("attn_block_tkg_nki_kernel_enabled", ("flash_decoding_enabled", "is_chunked_prefill")),
        ("k_cache_transposed", ("flash_decoding_enabled", "is_chunked_prefill", "is_block_kv_layout")),
    ):
        bad = [c for c in clash if getattr(s, flag) and getattr(s, c)]
        if bad:
            yield Problem.of(flag, True, f"is incompatible with {', '.join(bad)}")
    if s.activation_quantization_type is not None:
        if s.mlp_kernel_enabled or s.quantized_mlp_kernel_enabled:
            yield Problem.of(
                "activation_quantization_type", s.activation_quantization_type, "is incompatible with the MLP kernels"
            )
        if s.activation_quantization_type == "static" and s.fused_qkv:
            yield Problem.of("activation_quantization_type", "static", "is incompatible with fused_qkv=True")


RULES: tuple[Rule, ...] = (
    _lengths,
    _buckets,
    _features,
    _parallel,
    _kernels,
    medusa.rule_problems,
    eagle_tree.rule_problems,
)


def check_neuron_spec(spec: NeuronSpec) -> Result[NeuronSpec, ConfigError]:
    """Run every cross-field rule.

    Returns:
        `Success(spec)`, or `Failure(ConfigError)` listing every violated rule.
    """
    return problems_result(spec, (p for rule in RULES for p in rule(spec)))


def check_attention_chunking(spec: NeuronSpec, model_attributes: Mapping[str, Any]) -> Result[NeuronSpec, ConfigError]:
    """The model-dependent rules (REFERENCE §2.3): chunked attention (a model's `attention_chunk_size`
    below seq_len) rules out several features, and a windowed context encoding must use the model's
    `sliding_window` when the model has that attribute.

    Returns:
        `Failure` naming every `neuron_config.` setting chunked attention rules out, a chunk size that
        context parallelism cannot split, and a windowed_context_encoding_size off the sliding window.
    """
    problems = []
    chunk = model_attributes.get("attention_chunk_size")
    if isinstance(chunk, int) and chunk < spec.seq_len:
        for name, bad in (
            ("flash_decoding_enabled", spec.flash_decoding_enabled),
            ("attn_block_tkg_nki_kernel_enabled", spec.attn_block_tkg_nki_kernel_enabled),
            ("is_prefix_caching", spec.is_prefix_caching),
            ("chunked_prefill_config", spec.chunked_prefill_config is not None),
            ("padding_side", spec.padding_side != "right"),
            ("attention_dp_degree", spec.attention_dp_degree != 1),
        ):
            if bad:
                value = getattr(spec, name)
                problems.append(
                    Problem.of(f"neuron_config.{name}", value, "is not yet supported with chunked attention")
                )
        if chunk % spec.cp_degree or (spec.seq_len % chunk) % spec.cp_degree:
            why = f"is incompatible with cp_degree={spec.cp_degree}"
            problems.append(Problem.of("attention_chunk_size", chunk, why))
    window = spec.windowed_context_encoding_size
    if window is not None and window != model_attributes.get("sliding_window", window):
        problems.append(Problem.of("neuron_config.windowed_context_encoding_size", window, "must equal sliding_window"))
    return problems_result(spec, problems)

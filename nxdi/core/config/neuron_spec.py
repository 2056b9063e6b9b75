"""NeuronSpec: the validated, immutable compile-and-run configuration (NxDI `NeuronConfig`). Pure.

Field names are NxDI's attribute names, so the shell can expose them unchanged. Each field is
declared once with `setting(...)` (`nxdi.core.config.fields`; `_general(...)` and the other
partials below fix its group): its one-line documentation, whether it changes a compiled graph
(`graph=False`: it does not; `nxdi.core.graph_key` hashes the rest), what it does on the CPU
backend, and whether it holds a dtype name (names like `"bfloat16"`, since the planners import no
torch).

Values here are already resolved: derived defaults (max_context_length = seq_len, ...) are filled
in by `nxdi.core.config.neuron_parse.parse_neuron_spec`, cross-field rules live in
`nxdi.core.config.neuron_checks`. Attributes the reference computes and never takes as input
(`buckets`, `world_size`, `kv_cache_tiling`, ...) are properties, not fields.

(Over 400 lines: one documented declaration per NeuronConfig attribute, about 135 of them. The
table is the module; splitting it would split the reference users read.)
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Literal

import attrs

from nxdi.core.config.fields import (
    MAX_AXES,
    MAX_BATCH,
    MAX_COUNT,
    MAX_DEGREE,
    MAX_LNC,
    MAX_SIZE,
    MAX_TOKENS,
    Group,
    JsonMap,
    OnCpu,
    setting,
)
from nxdi.core.config.sub_specs import ChunkedPrefillSpec, KVQuantSpec, LoraSpec, MoESpec, OnDeviceSamplingSpec

DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}

SCALE_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
"""`quantization_scale_dtype` -> the dtype name the program holds quantization scales in."""


class Phase(enum.Enum):
    """Which compiled sub-model a spec describes."""

    CONTEXT = "context_encoding"
    TOKEN = "token_generation"
    SPECULATION = "speculation"
    FUSED_SPECULATION = "fused_speculation"
    """A draft model and its target in one program (`enable_fused_speculation`)."""


_general = functools.partial(setting, group=Group.GENERAL)
_distributed = functools.partial(setting, group=Group.DISTRIBUTED)
_attention = functools.partial(setting, group=Group.ATTENTION)
_batching = functools.partial(setting, group=Group.BATCHING)
_sampling = functools.partial(setting, group=Group.SAMPLING)
_bucketing = functools.partial(setting, group=Group.BUCKETING)
_quantization = functools.partial(setting, group=Group.QUANTIZATION)
_speculation = functools.partial(setting, group=Group.SPECULATION)
_paged = functools.partial(setting, group=Group.PAGED)
_lora = functools.partial(setting, group=Group.LORA)
_kernels = functools.partial(setting, group=Group.KERNELS, cpu="Neuron kernel")
_compiler = functools.partial(setting, group=Group.COMPILER)
_debugging = functools.partial(setting, group=Group.DEBUGGING)
_moe = functools.partial(setting, group=Group.MOE)


@attrs.frozen(kw_only=True)
class NeuronSpec:
    """Every NxDI NeuronConfig attribute, resolved."""

    batch_size: int = _general(1, "Sequences processed per request (the compiled batch).", bounds=(1, MAX_BATCH))
    padding_side: Literal["right", "left"] = _general(
        "right",
        'Side on which inputs are padded: "right" or "left".',
        cpu="prompts may be padded on either side; nxdi compacts them",
    )
    allow_input_truncation: bool = _general(
        False, "Truncate inputs longer than the largest bucket instead of raising an error.", graph=False
    )
    seq_len: int = _general(
        128, "Longest sequence (prompt plus generated tokens) one request may reach, in tokens.", bounds=(1, MAX_TOKENS)
    )
    n_active_tokens: int = _general(
        128,
        "Tokens processed per forward pass in the traced input; default seq_len (max_context_length for context encoding, 1 for token generation).",
        cpu="the programs' shapes come from the bucket tables",
        bounds=(1, MAX_TOKENS),
    )
    n_positions: int = _general(
        128,
        "Positions (KV length) of the traced example input, in tokens; default seq_len; each bucket compiles with its own value.",
        cpu="the programs' shapes come from the bucket tables",
        bounds=(1, MAX_TOKENS),
    )
    max_context_length: int = _general(
        128, "Longest prompt, in tokens; default seq_len; must not exceed max_length.", bounds=(1, MAX_TOKENS)
    )
    max_new_tokens: int | None = _general(
        None,
        "Most tokens generated per request; default seq_len - max_context_length, or None when that is 0.",
        graph=False,
        # The derived default is negative when max_context_length > seq_len, as in the reference.
        bounds=(-MAX_TOKENS, MAX_TOKENS),
    )
    max_length: int = _general(
        128,
        "Longest total sequence and KV cache length, in tokens; default seq_len (not derived from context plus new tokens).",
        bounds=(1, MAX_TOKENS),
    )
    on_cpu: bool = _general(False, "Trace and run the model on the host instead of Neuron devices.", graph=False)
    output_logits: bool = _general(
        False,
        "Return logits alongside the tokens sampled on device, for debugging (slower); default False; forced True by tensor_capture_config.",
    )
    is_prefill_stage: bool | None = _general(
        None,
        "Marks a sub-model as context encoding (True) or token generation (False); set per sub-model, not by users.",
        cpu="set per sub-model by nxdi",
    )
    torch_dtype: DType = _general(
        "bfloat16",
        "dtype for weights and compute: float32, float16 or bfloat16 (also float8_e4m3fn, float8_e5m2).",
        dtype=True,
    )
    overrides_torch_dtype: bool = _general(
        False,
        "Whether torch_dtype takes precedence over the checkpoint's dtype; default True when torch_dtype is given, else False.",
        graph=False,
    )
    cast_type: Literal["config", "as-declared"] = _general(
        "config", 'Weight casting at load: "config" casts all to torch_dtype, "as-declared" keeps each declared dtype.'
    )
    rpl_reduce_dtype: DType | None = _general(
        None,
        "dtype for all-reduce in RowParallelLinear layers; default None (the input tensor's dtype).",
        cpu=OnCpu.WITH_TP,
        dtype=True,
    )
    attention_dtype: DType | None = _attention(
        None,
        'dtype for attention and the KV cache; default None (input dtype); differing from torch_dtype needs cast_type "as-declared".',
        cpu_note="the KV cache is stored in it",
        dtype=True,
    )
    vocab_parallel: bool = _distributed(
        False,
        "Shard the embedding along the vocabulary dim instead of the hidden dim.",
        cpu=OnCpu.WITH_TP,
    )
    enable_cte_modular_flow: bool = _debugging(
        False,
        "Use the modular context-encoding flow, a time-to-first-token optimization.",
        cpu="Neuron compile flow only",
    )
    layer_boundary_markers: bool = _debugging(
        False, "Mark decoder-layer boundaries in the compiled graph.", cpu="Neuron compile flow only"
    )
    async_mode: bool = _general(
        False,
        "Run the runtime asynchronously, overlapping host logic with device execution; needs on-device sampling; not with Medusa.",
        graph=False,
    )
    skip_warmup: bool = _general(
        False, "Skip the warmup run at model load that speeds up the first request.", graph=False
    )
    save_sharded_checkpoint: bool = _general(
        False, "Save per-rank sharded weights in the compiled checkpoint instead of sharding at load.", graph=False
    )
    skip_sharding: bool = _general(
        False,
        "Skip weight sharding during compilation when the compiled path already holds sharded weights.",
        graph=False,
        cpu="weights are converted once at compile or load",
    )
    weights_to_skip_layout_optimization: tuple[str, ...] = _general(
        (),
        'Weight-name patterns excluded from weight layout optimization; default empty (".*lora.*" added for dynamic multi-LoRA).',
        cpu="Neuron weight layout only",
    )
    fused_qkv: bool = _attention(
        False,
        "Fuse the Q, K and V projection weights into one matrix (Wqkv) for larger matmuls.",
        cpu_note="the CPU programs always fuse Q, K and V",
    )
    sequence_parallel_enabled: bool = _distributed(
        False,
        "Split context-encoding activations along the sequence dim; max_context_length must divide by tp_degree.",
        cpu=OnCpu.WITH_TP,
    )
    weight_gather_seq_len_threshold: int = _attention(
        32768,
        "With sequence parallelism, sequence length in tokens from which weights are gathered instead of activations.",
        cpu="the CPU programs always gather activations",
        bounds=(1, MAX_TOKENS),
    )
    attn_cls: str = _attention(
        "NeuronLlamaAttention", "Name of the attention module class.", cpu="the program follows the model's family"
    )
    qk_layernorm: bool = _attention(
        False,
        "Apply layer normalization to the query and key projections.",
        cpu="q/k norms follow the model's config (qk_norm)",
    )
    pre_rope_rmsnorm: bool = _attention(
        False,
        "Apply QK RMS normalization after the QKV projection and before RoPE.",
        cpu="q/k norms follow the model's config (qk_norm)",
    )
    flash_decoding_enabled: bool = _attention(
        False,
        "Flash decoding: shard each sequence's KV cache across a group of cores in token generation.",
        cpu=OnCpu.WITH_TP,
    )
    disable_kv_cache_tiling: bool = _attention(
        False,
        "Turn off KV-cache tiling (128-token tiles, used with fused or EAGLE speculation when max_length is a multiple of 128).",
        cpu="Neuron cache layout only",
    )
    k_cache_transposed: bool = _attention(
        False,
        "Store K as (batch, heads, head_dim, seq); not with flash decoding, chunked prefill or block KV.",
        cpu="Neuron cache layout only",
    )
    ctx_batch_size: int = _batching(
        1, "Batch size of the context-encoding model, in sequences; default batch_size.", bounds=(1, MAX_BATCH)
    )
    tkg_batch_size: int = _batching(
        1, "Batch size of the token-generation model, in sequences; default batch_size.", bounds=(1, MAX_BATCH)
    )
    max_batch_size: int = _batching(
        1,
        "Largest batch under continuous batching, in sequences; default batch_size.",
        cpu="batches are bounded by ctx/tkg_batch_size",
        bounds=(1, MAX_BATCH),
    )
    is_continuous_batching: bool = _batching(
        False,
        "Continuous batching: sequences enter and leave the batch by seq_id; required for attention DP.",
        cpu_note="forward() always honours seq_ids",
    )
    kv_cache_batch_size: int = _batching(
        1,
        "Sequence rows in the KV cache; default batch_size, or tkg_batch_size // attention_dp_degree with attention DP.",
        bounds=(1, MAX_BATCH),
    )
    kv_cache_padding_size: int = _batching(
        0,
        "Extra KV-cache rows that absorb discarded writes; default 0 (1 with attention DP on trn1 or without cascaded attention).",
        cpu_note="they take out-of-range and duplicate seq_ids, which are refused without them",
        bounds=(0, MAX_BATCH),
    )
    apply_seq_ids_mask: bool = _batching(
        False,
        "Redirect KV writes of rows whose seq_id is -1 to a pad slot (cache gets 128 extra positions).",
        cpu_note="rows of seq_id -1 write no cache row at all, so no extra positions are needed",
    )
    on_device_sampling_config: OnDeviceSamplingSpec | None = _sampling(
        None,
        "Sampling inside the compiled model, with these settings (OnDeviceSamplingConfig); default None (logits returned).",
    )
    disable_argmax_kernel: bool = _sampling(
        False, "Do not use the argmax kernel for greedy on-device sampling.", cpu="Neuron kernel"
    )
    enable_bucketing: bool = _bucketing(
        False, "Compile several length buckets (automatic: powers of two from 128, the maximum last)."
    )
    bucket_n_active_tokens: bool = _bucketing(
        False,
        "Bucket the active-token count with the positions; set True for context encoding per sub-model.",
        cpu="set per sub-model by nxdi",
    )
    context_encoding_buckets: tuple[int, ...] | None = _bucketing(
        None,
        "Context-encoding bucket lengths, in tokens, each <= max_context_length; kept sorted; default None (automatic).",
        bounds=(1, MAX_TOKENS),
    )
    prefix_buckets: tuple[int, ...] | None = _bucketing(
        None,
        "Prefix-length buckets, in tokens, for prefix caching; kept sorted; default None (automatic).",
        bounds=(0, MAX_TOKENS),
    )
    token_generation_buckets: tuple[int, ...] | None = _bucketing(
        None,
        "Token-generation bucket lengths, in tokens, each <= max_length; kept sorted; default None (automatic).",
        bounds=(1, MAX_TOKENS),
    )
    token_generation_batches: tuple[int, ...] | None = _bucketing(
        None,
        "Batch-size buckets for token generation, each 1..tkg_batch_size; not with speculation, prefix caching or block KV.",
        cpu_note="a decode batch runs on the smallest batch bucket that holds it",
        bounds=(1, MAX_BATCH),
    )
    quantized: bool = _quantization(False, "Load quantized weights from quantized_checkpoints_path.")
    quantized_checkpoints_path: str | None = _quantization(
        None,
        "Folder (safetensors or pickle) or pickle file of the quantized checkpoint; required when quantized.",
        graph=False,
        cpu=OnCpu.WITH_QUANTIZED,
    )
    quantization_type: Literal["per_tensor_symmetric", "per_channel_symmetric", "blockwise_symmetric"] = _quantization(
        "per_tensor_symmetric",
        "per_tensor_symmetric, per_channel_symmetric or blockwise_symmetric; default per_tensor_symmetric (per_channel with a quantized MLP).",
        cpu=OnCpu.WITH_QUANTIZED,
    )
    quantization_dtype: Literal["int8", "f8e4m3", "f8e5m2", "mxfp4"] = _quantization(
        "int8",
        "Weight quantization dtype: int8, f8e4m3, f8e5m2 or mxfp4; default int8 (f8e4m3 with a quantized MLP).",
        cpu=OnCpu.WITH_QUANTIZED,
    )
    quantization_block_size: tuple[int, ...] | None = _quantization(
        None,
        "Block shape for blockwise_symmetric quantization.",
        cpu=OnCpu.WITH_QUANTIZED,
        bounds=(1, MAX_SIZE),
    )
    quantization_block_axis: tuple[int, ...] | None = _quantization(
        None,
        "Axes the blockwise quantization blocks span.",
        cpu=OnCpu.WITH_QUANTIZED,
        bounds=(-MAX_AXES, MAX_AXES),
    )
    quantization_scale_dtype: Literal["f32", "bf16", "f16"] = _quantization(
        "f32", "dtype of quantization scales: f32, bf16 or f16.", cpu=OnCpu.WITH_QUANTIZED
    )
    is_mxfp4_compute: bool = _quantization(
        False,
        "Compute with MXFP4 weights, whose hidden and intermediate dims are shuffled.",
        cpu="Neuron MXFP4 compute only",
    )
    is_full_model_shuffled: bool = _quantization(
        False,
        "Weights of the whole model are pre-shuffled; needs is_mxfp4_compute or is_eagle_draft.",
        cpu="Neuron MXFP4 layout only",
    )
    modules_to_not_convert: tuple[str, ...] | None = _quantization(
        None,
        "Module names kept unquantized (e.g. lm_head, layers.0.self_attn); default None (all modules quantized).",
        cpu=OnCpu.WITH_QUANTIZED,
    )
    draft_model_modules_to_not_convert: tuple[str, ...] | None = _quantization(
        None,
        "The fused draft's modules_to_not_convert (replacing its own): draft modules kept in float; "
        "list every layer for a float draft.",
        cpu=OnCpu.WITH_FUSED,
    )
    kv_cache_quant: bool = _quantization(
        False, "Store the KV cache as float8_e4m3fn (half the bytes of bf16), dequantized to torch_dtype on read."
    )
    kv_quant_config: KVQuantSpec | None = _quantization(
        None,
        "KV-cache quantization settings (a dict or KVQuantSpec): dtype, direct cast, K/V scale granularity; "
        "set alone, it quantizes the cache too.",
    )
    activation_quantization_type: Literal["static", "dynamic"] | None = _quantization(
        None,
        'Activation quantization: "static" or "dynamic"; not with MLP kernels, static not with fused_qkv.',
        cpu=OnCpu.REFUSED,
    )
    quantize_clamp_bound: float = _quantization(
        math.inf, "Bound that values are clamped to before quantization.", cpu="used with quantization only"
    )
    speculation_length: int = _speculation(
        0,
        "Tokens a speculation step scores per row (the last token and k-1 draft tokens); > 0 compiles speculation programs.",
        bounds=(0, MAX_COUNT),
    )
    spec_batch_size: int = _speculation(
        1,
        "Batch size of the speculation model, in sequences; default batch_size.",
        bounds=(1, MAX_BATCH),
    )
    trace_tokengen_model: bool = _speculation(
        True,
        "Compile token-generation programs; False on a target used with a separate draft: it then decodes only in speculation steps.",
    )
    enable_fused_speculation: bool = _speculation(
        False,
        "Fuse draft and target into one program per bucket; needs speculation_length > 0, fused_spec_config and "
        "on-device sampling; default False (True with EAGLE).",
    )
    enable_eagle_speculation: bool = _speculation(
        False,
        "EAGLE speculation: the draft also gets the target's previous hidden state; forces fused speculation.",
        cpu_note="EAGLE v1 with a flat draft: the fused_spec_config's draft_config must set is_eagle_draft",
    )
    eagle_rolling_buffer_kernel_enabled: bool = _kernels(False, "Rolling-buffer kernel for EAGLE speculation.")
    is_eagle3: bool = _speculation(False, "The EAGLE draft is an EAGLE-3 model.", cpu=OnCpu.REFUSED)
    is_eagle_draft: bool = _speculation(
        False,
        "Marks the config of an EAGLE draft model (fc over [embedding; target hidden state], no final norm).",
        cpu_note="its weights load as an EAGLE draft; it runs only inside EAGLE speculation, never on its own",
    )
    enable_eagle_draft_input_norm: bool = _speculation(
        False,
        "Apply input normalization in the EAGLE draft model (every layer's input_layernorm); default False.",
        cpu_note="read by the EAGLE draft's weight layout; no effect on a target model",
    )
    token_tree_config: JsonMap | None = _speculation(
        None,
        "EAGLE token tree: {node id: [child ids]}, root 0, leaves implicit; speculation_length = its node count.",
        cpu_note="greedy EAGLE fused speculation over the tree; each step emits up to depth + 1 tokens",
    )
    is_medusa: bool = _speculation(
        False,
        "Medusa speculation: extra LM heads (<model dir>/medusa_heads.pt) propose a token tree; needs the three settings below.",
    )
    medusa_speculation_length: int = _speculation(
        0,
        "Tree nodes one Medusa step scores per row, the root included (the tree is padded to it); > len(medusa_tree).",
        cpu=OnCpu.WITH_MEDUSA,
        bounds=(0, MAX_COUNT),
    )
    num_medusa_heads: int = _speculation(
        0,
        "Number of Medusa LM heads (head i proposes the token i + 2 ahead); at least the tree's depth.",
        cpu=OnCpu.WITH_MEDUSA,
        bounds=(0, MAX_COUNT),
    )
    medusa_tree: tuple[tuple[int, ...], ...] | None = _speculation(
        None,
        "Medusa tree: paths of top-k choice indices per depth, prefix-closed (e.g. medusa_mc_sim_7b_63.json).",
        cpu=OnCpu.WITH_MEDUSA,
        bounds=(0, MAX_COUNT),
    )
    is_block_kv_layout: bool = _paged(
        False,
        "Store the KV cache in fixed-size blocks (paged attention) instead of one row per sequence.",
    )
    pa_num_blocks: int = _paged(
        1,
        "Number of blocks in the block KV cache (used with is_block_kv_layout); default batch_size.",
        bounds=(1, MAX_TOKENS),
    )
    pa_block_size: int = _paged(
        128,
        "Tokens per block of the block KV cache (used with is_block_kv_layout); default seq_len.",
        bounds=(1, MAX_TOKENS),
    )
    is_prefix_caching: bool = _paged(False, "Reuse cached KV blocks for prompts that share a prefix.")
    windowed_context_encoding_size: int | None = _paged(
        None,
        "Window, in tokens, for windowed context encoding; must equal the model's sliding_window if both are set.",
        cpu="sliding windows are applied as attention masks",
        bounds=(1, MAX_TOKENS),
    )
    chunked_prefill_config: ChunkedPrefillSpec | None = _paged(
        None,
        "Chunked prefill settings; setting it enables chunked prefill and needs is_block_kv_layout.",
    )
    tensor_replacement_config: JsonMap | None = _debugging(
        None,
        "Replace intermediate tensors with reference ones for accuracy debugging (ref_dir, neuron_dir, tf_map).",
        cpu=OnCpu.REFUSED,
    )
    tensor_capture_config: JsonMap | None = _debugging(
        None,
        "Capture intermediate tensors for debugging; needs on-device sampling and forces output_logits.",
        cpu=OnCpu.REFUSED,
    )
    lora_config: LoraSpec | None = _lora(
        None,
        "Multi-LoRA serving settings (LoraServingConfig); setting it enables multi-LoRA serving.",
    )
    tp_degree: int = _distributed(
        1,
        "Tensor-parallel degree, in NeuronCores (rank processes on the CPU); attention heads should divide by it.",
        bounds=(1, MAX_DEGREE),
    )
    cp_degree: int = _distributed(
        1,
        "Context-parallel degree for context encoding; must divide tp_degree.",
        cpu=OnCpu.REFUSED,
        bounds=(1, MAX_DEGREE),
    )
    mlp_cp_degree: int = _distributed(
        1,
        "Context-parallel degree for MLP layers; > 1 needs sequence_parallel_enabled.",
        cpu=OnCpu.REFUSED,
        bounds=(1, MAX_DEGREE),
    )
    attention_dp_degree: int = _distributed(
        1,
        "Attention data-parallel degree in token generation; must divide tp_degree and tkg_batch_size; needs continuous batching.",
        cpu=OnCpu.REFUSED,
        bounds=(1, MAX_DEGREE),
    )
    pp_degree: int = _distributed(1, "Pipeline-parallel degree, in stages.", cpu=OnCpu.REFUSED, bounds=(1, MAX_DEGREE))
    ep_degree: int = _distributed(1, "Expert-parallel degree, in ranks.", cpu=OnCpu.REFUSED, bounds=(1, MAX_DEGREE))
    enable_ve_data_parallel: bool = _distributed(
        False, "Run the vision encoder data-parallel across world_size / tp_degree groups.", cpu="no vision encoder"
    )
    start_rank_id: int = _distributed(
        0,
        "First global rank this process serves (with torchrun: this node's first rank).",
        graph=False,
        bounds=(0, MAX_COUNT),
    )
    local_ranks_size: int = _distributed(
        1,
        "Ranks this process serves (with torchrun: this node's ranks); default tp_degree * pp_degree * ep_degree (the world size).",
        graph=False,
        bounds=(1, MAX_COUNT),
    )
    logical_nc_config: int = _distributed(
        1,
        "Physical NeuronCores per logical core (LNC); NEURON_LOGICAL_NC_CONFIG overrides it; default 2 on trn2 and trn3, else 1.",
        cpu="Neuron cores only",
        bounds=(1, MAX_LNC),
    )
    lm_head_pad_alignment_size: int = _distributed(
        1,
        "Alignment, times logical_nc_config, that the LM head's sharded vocab dim is padded to.",
        cpu="Neuron layout only",
        bounds=(1, MAX_SIZE),
    )
    attn_kernel_enabled: bool | None = _kernels(
        None, "Flash-attention kernel for context encoding: None lets the model decide, True/False request it."
    )
    strided_context_parallel_kernel_enabled: bool = _kernels(
        False, "Strided context-parallel attention kernel; needs cp_degree > 1."
    )
    qkv_kernel_enabled: bool = _kernels(False, "Fused QKV projection kernel; needs fused_qkv and torch_dtype bfloat16.")
    qkv_nki_kernel_enabled: bool = _kernels(False, "Use the NKI implementation of the QKV kernel.")
    qkv_cte_nki_kernel_fuse_rope: bool = _kernels(
        False,
        "Fuse RoPE into the context-encoding QKV NKI kernel; needs qkv_kernel_enabled and qkv_nki_kernel_enabled.",
    )
    qkv_kernel_nbsd_layout: bool = _kernels(False, "Have the QKV kernel produce its output in NBSD layout.")
    mlp_kernel_enabled: bool = _kernels(
        False, "MLP kernel; needs torch_dtype bfloat16; also set by deprecated mlp_tkg_nki_kernel_enabled."
    )
    fused_rmsnorm_skip_gamma: bool = _kernels(
        False, "Fold the input RMSNorm weight into the QKV and MLP kernel weights so the fused norm skips gamma."
    )
    mlp_kernel_fuse_residual_add: bool = _kernels(False, "Fuse the residual add into the MLP kernel.")
    qkv_kernel_fuse_residual_add: bool = _kernels(False, "Fuse the residual add into the QKV kernel.")
    quantized_mlp_kernel_enabled: bool = _kernels(
        False, "FP8 quantized MLP kernel; needs mlp_kernel_enabled; sets per_channel_symmetric f8e4m3 quantization."
    )
    out_proj_kernel_enabled: bool = _kernels(False, "Attention output-projection kernel.")
    attn_block_tkg_nki_kernel_enabled: bool = _kernels(
        False,
        "Block token-generation attention NKI kernel; needs a QKV kernel; not with flash decoding or chunked prefill.",
    )
    attn_block_tkg_nki_kernel_cache_update: bool = _kernels(
        False, "Let the block token-generation attention kernel update the KV cache; needs that kernel."
    )
    attn_block_tkg_nki_kernel_cascaded_attention: bool = _kernels(
        False, "Cascaded attention in the block token-generation attention kernel; needs that kernel."
    )
    attn_block_tkg_nki_kernel_use_online_softmax: bool = _kernels(
        True, "Use online softmax in the block token-generation attention kernel."
    )
    attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb: bool = _kernels(
        False, "Disable GpSimd SBUF-to-SBUF transfers in the block token-generation attention kernel."
    )
    attn_block_cte_nki_kernel_enabled: bool = _kernels(
        False, "Deprecated switch that turns on the qkv, qkv_nki, attn and out_proj kernels."
    )
    rmsnorm_quantize_kernel_enabled: bool = _kernels(
        False, "Fused RMSNorm-and-quantize kernel; needs quantized_mlp_kernel_enabled."
    )
    moe_fused_nki_kernel_enabled: bool | None = _kernels(
        None, "Fused MoE NKI kernel; None leaves the choice to the model."
    )
    router_topk_nki_kernel_enabled: bool | None = _kernels(
        None, "MoE router top-k NKI kernel; None leaves the choice to the model."
    )
    expert_mlp_nki_kernel_enabled: bool | None = _kernels(
        None, "MoE expert MLP NKI kernel; None leaves the choice to the model."
    )
    shared_mlp_nki_kernel_enabled: bool | None = _kernels(
        None, "MoE shared-expert MLP NKI kernel; None leaves the choice to the model."
    )
    kv_cache_update_with_kernel: bool = _kernels(
        False,
        "Update the KV cache with a kernel instead of padded-row writes; default False (True with attention DP and cascaded attention).",
    )
    cc_pipeline_tiling_factor: int = _compiler(
        2,
        "Pipeline tiling factor for collectives; > 1 with an MLP kernel tiles collectives manually.",
        cpu="Neuron collectives only",
        bounds=(1, MAX_COUNT),
    )
    seq_len_threshold_for_cc_tiling: int = _compiler(
        16384,
        "Sequence length threshold, in tokens, for collective tiling.",
        cpu="Neuron collectives only",
        bounds=(1, MAX_TOKENS),
    )
    target: Literal["trn1", "trn2", "trn3", "inf2"] | None = _compiler(
        None,
        "Platform to compile for: trn1, trn2, trn3 or inf2; default None (the platform nxdi runs on).",
        cpu="chooses Neuron defaults (LNC, kernels); the CPU backend runs on the host",
    )
    enable_spill_reload_dge: bool = _compiler(
        False, "Use DGE for spill/reload DMAs to cut DMA ring memory for long contexts.", cpu="Neuron compiler only"
    )
    dma_order_config: JsonMap | None = _compiler(
        None, "Compiler DMA ordering settings (JSON object).", cpu="Neuron compiler only"
    )
    enable_output_completion_notifications: bool = _compiler(
        False, "Have the runtime signal completion of each output tensor.", graph=False, cpu="Neuron runtime only"
    )
    scratchpad_page_size: int | None = _compiler(
        None,
        "Scratchpad page size shared by compiler and runtime; default None, or 1024 when max_context_length >= 32768.",
        cpu="Neuron runtime only",
        bounds=(1, MAX_SIZE),
    )
    padded_hidden_size: int | None = _compiler(
        None,
        "Hidden size the model is padded to, replacing hidden_size; default None (no padding).",
        cpu=OnCpu.REFUSED,
        bounds=(1, MAX_SIZE),
    )
    padded_intermediate_size: int | None = _compiler(
        None,
        "MLP intermediate size the model is padded to; default None (no padding).",
        cpu=OnCpu.REFUSED,
        bounds=(1, MAX_SIZE),
    )
    disable_numeric_cc_token: bool = _compiler(
        False,
        "Drop the numeric token the collectives add (extra add/multiply), as some MoE models need.",
        cpu="Neuron collectives only",
    )
    switch_cc: bool = _compiler(
        False,
        "Use the alternate rank-to-group mapping for context- and data-parallel collectives.",
        cpu="Neuron collectives only",
    )
    ep_dispatch_cc_option: Literal["AR_AG", "RS_AG", "AG_AR"] = _compiler(
        "AR_AG",
        "Collectives for expert-parallel dispatch: AR_AG, RS_AG or AG_AR; default AR_AG; RS_AG with attention DP needs tp <= tkg batch.",
        cpu="Neuron collectives only",
    )
    moe: MoESpec | None = _moe(
        None,
        "Mixture-of-experts options, set through MoENeuronConfig's flat attributes; default None (dense model).",
    )

    # --- derived (the reference computes these; never inputs) ------------------------------
    @property
    def buckets(self) -> tuple[int, ...]:
        """The reference's generic bucket list attribute: [seq_len] (per-submodel tables are planned)."""
        return (self.seq_len,)

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree * self.ep_degree

    @property
    def kv_cache_tiling(self) -> bool:
        spec_on = self.enable_eagle_speculation or self.enable_fused_speculation
        tiled = self.max_length > 128 and self.max_length % 128 == 0
        return spec_on and tiled and not self.disable_kv_cache_tiling

    @property
    def enable_long_context_mode(self) -> bool:
        return self.max_context_length >= 32768

    @property
    def tile_cc(self) -> bool:
        return self.cc_pipeline_tiling_factor > 1 and (self.mlp_kernel_enabled or self.quantized_mlp_kernel_enabled)

    @property
    def lm_head_pad(self) -> bool:
        return self.logical_nc_config > 1

    @property
    def is_chunked_prefill(self) -> bool:
        return self.chunked_prefill_config is not None

    @property
    def enable_token_tree(self) -> bool:
        return self.token_tree_config is not None

    @property
    def is_hidden_dim_shuffled(self) -> bool:
        return self.is_mxfp4_compute

    @property
    def is_intermediate_dim_shuffled(self) -> bool:
        return self.is_mxfp4_compute

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.torch_dtype]

    @property
    def kv_dtype(self) -> str:
        """dtype of the KV cache: the quantized dtype, else attention_dtype, else torch_dtype."""
        if self.kv_quant_config is not None:
            return self.kv_quant_config.quant_dtype
        if self.kv_cache_quant:
            return "float8_e4m3fn"
        return self.attention_dtype or self.torch_dtype


DERIVED: tuple[str, ...] = (
    "buckets",
    "world_size",
    "kv_cache_tiling",
    "enable_long_context_mode",
    "tile_cc",
    "lm_head_pad",
    "is_chunked_prefill",
    "enable_token_tree",
    "is_hidden_dim_shuffled",
    "is_intermediate_dim_shuffled",
)
"""Properties written to neuron_config.json like the reference does, recomputed (never read) on load."""


def context_spec(spec: NeuronSpec) -> NeuronSpec:
    """The context-encoding sub-model: batch ctx_batch_size, all prompt tokens active."""
    return attrs.evolve(
        spec,
        is_prefill_stage=True,
        batch_size=spec.ctx_batch_size,
        n_active_tokens=spec.max_context_length,
        bucket_n_active_tokens=True,
    )


def token_spec(spec: NeuronSpec) -> NeuronSpec:
    """The token-generation sub-model: batch tkg_batch_size, one active token, no sequence parallelism."""
    return attrs.evolve(
        spec,
        is_prefill_stage=False,
        batch_size=spec.tkg_batch_size,
        n_active_tokens=1,
        bucket_n_active_tokens=False,
        sequence_parallel_enabled=False,
    )

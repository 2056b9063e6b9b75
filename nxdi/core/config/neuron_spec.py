"""NeuronSpec: the validated, immutable compile-and-run configuration (NxDI `NeuronConfig`). Pure.

Field names are NxDI's attribute names, so the shell can expose them unchanged. Values here are
already resolved: derived defaults (max_context_length = seq_len, ...) are filled in by
`nxdi.core.config.neuron_parse.parse_neuron_spec`, cross-field rules live in `nxdi.core.config.neuron_checks`.
Attributes the reference computes and never takes as input (`buckets`, `world_size`,
`kv_cache_tiling`, ...) are properties, not fields.

Fields marked `runtime` (metadata `graph=False`) do not change a compiled graph; every other field
does, which is what `nxdi.core.graph_key` hashes. dtypes are names (`"bfloat16"`), since the
planners import no torch.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Literal

import attrs

from nxdi.core.config.fields import JsonMap
from nxdi.core.config.sub_specs import ChunkedPrefillSpec, KVQuantSpec, LoraSpec, MoESpec, OnDeviceSamplingSpec

DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


class Phase(enum.Enum):
    """Which compiled sub-model a spec describes."""

    CONTEXT = "context_encoding"
    TOKEN = "token_generation"
    SPECULATION = "speculation"


def _runtime(default: Any) -> Any:
    """A field that does not change the compiled graph."""
    return attrs.field(default=default, metadata={"graph": False})


_pos = attrs.validators.gt(0)
_nonneg = attrs.validators.ge(0)


@attrs.frozen(kw_only=True)
class NeuronSpec:
    """Every NxDI NeuronConfig attribute, resolved."""

    # --- general ---------------------------------------------------------------------------
    batch_size: int = attrs.field(default=1, validator=_pos)
    """Sequences per request (the compiled batch)."""
    padding_side: Literal["right", "left"] = "right"
    allow_input_truncation: bool = _runtime(False)
    """Truncate prompts longer than the largest bucket instead of failing."""
    seq_len: int = attrs.field(default=128, validator=_pos)
    """Longest sequence (prompt + generated tokens) one request may reach."""
    n_active_tokens: int = attrs.field(default=128, validator=_pos)
    n_positions: int = attrs.field(default=128, validator=_pos)
    max_context_length: int = attrs.field(default=128, validator=_pos)
    """Longest prompt; defaults to seq_len."""
    max_new_tokens: int | None = _runtime(None)
    """seq_len - max_context_length, or None when that is 0."""
    max_length: int = attrs.field(default=128, validator=_pos)
    """Longest total length; defaults to seq_len (not derived from context + new tokens)."""
    on_cpu: bool = _runtime(False)
    output_logits: bool = False
    """Also return logits when sampling on device."""
    is_prefill_stage: bool | None = None
    """Set per sub-model by context_spec/token_spec, never by users."""
    torch_dtype: DType = "bfloat16"
    overrides_torch_dtype: bool = _runtime(False)
    """True when torch_dtype was given explicitly, so a checkpoint's dtype does not replace it."""
    cast_type: Literal["config", "as-declared"] = "config"
    rpl_reduce_dtype: DType | None = None
    attention_dtype: DType | None = None
    vocab_parallel: bool = False
    enable_cte_modular_flow: bool = False
    layer_boundary_markers: bool = False
    async_mode: bool = _runtime(False)
    skip_warmup: bool = _runtime(False)
    save_sharded_checkpoint: bool = _runtime(False)
    skip_sharding: bool = _runtime(False)
    weights_to_skip_layout_optimization: tuple[str, ...] = ()
    # --- attention -------------------------------------------------------------------------
    fused_qkv: bool = False
    sequence_parallel_enabled: bool = False
    weight_gather_seq_len_threshold: int = attrs.field(default=32768, validator=_pos)
    attn_cls: str = "NeuronLlamaAttention"
    qk_layernorm: bool = False
    pre_rope_rmsnorm: bool = False
    flash_decoding_enabled: bool = False
    disable_kv_cache_tiling: bool = False
    k_cache_transposed: bool = False
    # --- batching --------------------------------------------------------------------------
    ctx_batch_size: int = attrs.field(default=1, validator=_pos)
    tkg_batch_size: int = attrs.field(default=1, validator=_pos)
    max_batch_size: int = attrs.field(default=1, validator=_pos)
    is_continuous_batching: bool = False
    kv_cache_batch_size: int = attrs.field(default=1, validator=_pos)
    kv_cache_padding_size: int = attrs.field(default=0, validator=_nonneg)
    apply_seq_ids_mask: bool = False
    # --- sampling --------------------------------------------------------------------------
    on_device_sampling_config: OnDeviceSamplingSpec | None = None
    disable_argmax_kernel: bool = False
    # --- bucketing -------------------------------------------------------------------------
    enable_bucketing: bool = False
    bucket_n_active_tokens: bool = False
    context_encoding_buckets: tuple[int, ...] | None = None
    prefix_buckets: tuple[int, ...] | None = None
    token_generation_buckets: tuple[int, ...] | None = None
    token_generation_batches: tuple[int, ...] | None = None
    # --- quantization ----------------------------------------------------------------------
    quantized: bool = False
    quantized_checkpoints_path: str | None = _runtime(None)
    quantization_type: Literal["per_tensor_symmetric", "per_channel_symmetric", "blockwise_symmetric"] = (
        "per_tensor_symmetric"
    )
    quantization_dtype: Literal["int8", "f8e4m3", "f8e5m2", "mxfp4"] = "int8"
    quantization_block_size: tuple[int, ...] | None = None
    quantization_block_axis: tuple[int, ...] | None = None
    quantization_scale_dtype: Literal["f32", "bf16", "f16"] = "f32"
    is_mxfp4_compute: bool = False
    is_full_model_shuffled: bool = False
    modules_to_not_convert: tuple[str, ...] | None = None
    draft_model_modules_to_not_convert: tuple[str, ...] | None = None
    kv_cache_quant: bool = False
    kv_quant_config: KVQuantSpec | None = None
    activation_quantization_type: Literal["static", "dynamic"] | None = None
    quantize_clamp_bound: float = math.inf
    # --- speculation -----------------------------------------------------------------------
    speculation_length: int = attrs.field(default=0, validator=_nonneg)
    spec_batch_size: int = attrs.field(default=1, validator=_pos)
    trace_tokengen_model: bool = True
    """Compile a token-generation sub-model (False for a speculation target that uses a draft)."""
    enable_fused_speculation: bool = False
    enable_eagle_speculation: bool = False
    eagle_rolling_buffer_kernel_enabled: bool = False
    is_eagle3: bool = False
    is_eagle_draft: bool = False
    enable_eagle_draft_input_norm: bool = False
    token_tree_config: JsonMap | None = None
    is_medusa: bool = False
    medusa_speculation_length: int = attrs.field(default=0, validator=_nonneg)
    num_medusa_heads: int = attrs.field(default=0, validator=_nonneg)
    medusa_tree: tuple[tuple[int, ...], ...] | None = None
    # --- paged attention, prefix caching, chunked prefill -----------------------------------
    is_block_kv_layout: bool = False
    pa_num_blocks: int = attrs.field(default=1, validator=_pos)
    pa_block_size: int = attrs.field(default=128, validator=_pos)
    is_prefix_caching: bool = False
    windowed_context_encoding_size: int | None = None
    chunked_prefill_config: ChunkedPrefillSpec | None = None
    # --- debugging, LoRA -------------------------------------------------------------------
    tensor_replacement_config: JsonMap | None = None
    tensor_capture_config: JsonMap | None = None
    lora_config: LoraSpec | None = None
    # --- parallelism -----------------------------------------------------------------------
    tp_degree: int = attrs.field(default=1, validator=_pos)
    cp_degree: int = attrs.field(default=1, validator=_pos)
    mlp_cp_degree: int = attrs.field(default=1, validator=_pos)
    attention_dp_degree: int = attrs.field(default=1, validator=_pos)
    pp_degree: int = attrs.field(default=1, validator=_pos)
    ep_degree: int = attrs.field(default=1, validator=_pos)
    enable_ve_data_parallel: bool = False
    start_rank_id: int = _runtime(0)
    local_ranks_size: int = attrs.field(default=1, validator=_pos)
    logical_nc_config: int = attrs.field(default=1, validator=_pos)
    """Physical NeuronCores per logical core (env NEURON_LOGICAL_NC_CONFIG > kwarg > platform)."""
    lm_head_pad_alignment_size: int = attrs.field(default=1, validator=_pos)
    # --- kernels (Neuron only; accepted and serialized, no effect on CPU) --------------------
    attn_kernel_enabled: bool | None = None
    strided_context_parallel_kernel_enabled: bool = False
    qkv_kernel_enabled: bool = False
    qkv_nki_kernel_enabled: bool = False
    qkv_cte_nki_kernel_fuse_rope: bool = False
    qkv_kernel_nbsd_layout: bool = False
    mlp_kernel_enabled: bool = False
    fused_rmsnorm_skip_gamma: bool = False
    mlp_kernel_fuse_residual_add: bool = False
    qkv_kernel_fuse_residual_add: bool = False
    quantized_mlp_kernel_enabled: bool = False
    out_proj_kernel_enabled: bool = False
    attn_block_tkg_nki_kernel_enabled: bool = False
    attn_block_tkg_nki_kernel_cache_update: bool = False
    attn_block_tkg_nki_kernel_cascaded_attention: bool = False
    attn_block_tkg_nki_kernel_use_online_softmax: bool = True
    attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb: bool = False
    attn_block_cte_nki_kernel_enabled: bool = False
    rmsnorm_quantize_kernel_enabled: bool = False
    moe_fused_nki_kernel_enabled: bool | None = None
    router_topk_nki_kernel_enabled: bool | None = None
    expert_mlp_nki_kernel_enabled: bool | None = None
    shared_mlp_nki_kernel_enabled: bool | None = None
    kv_cache_update_with_kernel: bool = False
    # --- compiler --------------------------------------------------------------------------
    cc_pipeline_tiling_factor: int = attrs.field(default=2, validator=_pos)
    seq_len_threshold_for_cc_tiling: int = attrs.field(default=16384, validator=_pos)
    target: Literal["trn1", "trn2", "inf2"] | None = None
    """Platform to compile for; None means the platform nxdi runs on (trn1 when not on Neuron)."""
    enable_spill_reload_dge: bool = False
    dma_order_config: JsonMap | None = None
    enable_output_completion_notifications: bool = _runtime(False)
    scratchpad_page_size: int | None = None
    padded_hidden_size: int | None = None
    padded_intermediate_size: int | None = None
    disable_numeric_cc_token: bool = False
    switch_cc: bool = False
    ep_dispatch_cc_option: Literal["AR_AG", "RS_AG", "AG_AR"] = "AR_AG"
    # --- mixture of experts (MoENeuronConfig) ---------------------------------------------
    moe: MoESpec | None = None
    """MoE options; set by MoENeuronConfig and flattened into its attributes."""

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


def is_graph_field(name: str) -> bool:
    """Whether changing field `name` changes a compiled graph."""
    return bool(attrs.fields_dict(NeuronSpec)[name].metadata.get("graph", True))


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

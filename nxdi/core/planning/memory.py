"""Device memory per core: weights, KV cache, LoRA adapters and activations against the core's HBM. Pure.

Theory of operation (all figures per logical core; every rank holds the same amount):
- Weights: the rank's slice of every weight of the sharding plan, so padded Q heads, replicated KV
  heads and zero-padded intermediate/vocab sizes are counted. `lm_head` is counted even when tied to the
  embedding, since the reference keeps a separate copy on device. With weight quantization, linear
  weights (lm_head included) take one byte per value (mxfp4 too: an overestimate) plus scales in
  `quantization_scale_dtype` (one per tensor, one per output row per channel, or one per block of
  the blockwise grid), except those `modules_to_not_convert` keeps; embeddings and norms keep the
  dtype.
- KV cache: `kv_layout.KVLayout.bytes_per_rank`.
- LoRA: `max_loras` adapter slots (the base model's included) at what the engine allocates per slot
  (`lora_ranks.bytes_per_slot`), or `lora.bytes_per_core`'s estimate for an adapter known by size.
- Speculation (`speculation_memory`): a fused draft's weights and KV cache, Medusa heads, EAGLE's
  hidden-state cache; with fused speculation every KV cache row (the target's and the draft's)
  holds `max_length + speculation_length` slots (`MemoryRequest.max_length` is that length).
- Activations: an estimate of the largest live tensors of one layer while encoding the largest
  context bucket: 4 hidden-state buffers `[B, S, E]`, the rank's q/k/v `[B, S, (H_r + 2 K_r) * D]` and
  MLP intermediate `[B, S, 2 F_r]` in the compute dtype, fp32 attention scores over query tiles of at
  most 1024 rows `[B, H_r, min(S, 1024), S]`, and fp32 last-token logits `[B, V_r]`.
- The verdict compares the sum with the platform's HBM per core; `min_tp_degree` is the smallest
  TP degree valid on the platform (and instance) whose plan fits.
"""

from __future__ import annotations

import math

import attrs
from returns.result import Result, Success

from nxdi.core.config.neuron_spec import DTYPE_BYTES, NeuronSpec
from nxdi.core.errors import ConfigError
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import gqa, kv_layout, lora, lora_ranks, sharding, speculation_memory
from nxdi.core.planning.speculation_memory import SpeculationLoad
from nxdi.core.platform import PLATFORMS, Platform
from nxdi.core.weight_plan import kept_in_float, weight_quant

SCORE_TILE_ROWS = 1024
"""Query rows whose attention scores are assumed live at once (flash-attention style tiling)."""
SCALE_BYTES = 4


@attrs.frozen(kw_only=True)
class LoraLoad:
    """Adapters resident on device."""

    adapter: lora.AdapterSize
    max_loras: int = attrs.field(validator=attrs.validators.ge(0))
    shard_linear_layer: bool = True
    layout: lora.LoraLayout | None = None
    """Where the engine puts the adapters (a `lora_config`'s): per-core bytes exactly as it allocates
    them (`lora_ranks.bytes_per_slot`); None: `lora.bytes_per_core`'s estimate from the size."""


@attrs.frozen(kw_only=True)
class MemoryRequest:
    """The run settings the memory planner needs (NeuronConfig names where they exist)."""

    tp_degree: int = attrs.field(validator=attrs.validators.gt(0))
    batch_size: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    """Context-encoding batch (activations)."""
    max_context_length: int = attrs.field(default=128, validator=attrs.validators.gt(0))
    """Largest context-encoding bucket (activations)."""
    max_length: int = attrs.field(default=128, validator=attrs.validators.gt(0))
    kv_cache_batch_size: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    kv_cache_padding_size: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    torch_dtype: str = attrs.field(default="bfloat16", validator=attrs.validators.in_(DTYPE_BYTES))
    attention_dtype: str | None = None
    kv_cache_quant: bool = False
    kv_quant_dtype: str = kv_layout.KV_QUANT_DTYPE
    weight_quant_dtype: str | None = None
    """Storage dtype of quantized decoder linear weights (`int8`, `f8e4m3`, ...); None when not quantized."""
    per_channel_scales: bool = False
    scale_bytes: int = SCALE_BYTES
    """Bytes of one quantization scale (`quantization_scale_dtype`: float32 unless set)."""
    scale_block: tuple[int, int] | None = None
    """Blockwise quantization: the rows and columns of a linear weight one scale covers (1: a scale per
    element along that axis); None for one scale per row (`per_channel_scales`) or per tensor."""
    quant_skip: tuple[str, ...] = ()
    """`modules_to_not_convert`: linears whose module path contains one of these stay in the dtype."""
    strategy: gqa.GQAStrategy | None = None
    fused_qkv: bool = False
    vocab_parallel: bool = False
    flash_decoding_enabled: bool = False
    moe_ep_degree: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    """Expert groups a mixture of experts' experts are split over (`sharding.expert_group_size`)."""
    moe_tkg_ep_degree: int | None = None
    """Hybrid sharding: token generation's expert groups, a second copy of the experts per rank
    (None: token generation uses the one layout)."""
    lora: LoraLoad | None = None
    speculation: SpeculationLoad | None = None
    """What speculation adds (a draft, Medusa heads, EAGLE's hidden states); None without it."""
    platform: Platform = Platform.TRN1
    logical_nc_config: int | None = None
    """None means the platform default."""
    instance: str | None = None

    @property
    def lnc(self) -> int:
        return self.logical_nc_config or PLATFORMS[self.platform].default_lnc


@attrs.frozen(kw_only=True)
class MemoryPlan:
    """Memory per core and in total, and the verdict."""

    tp_degree: int
    weights_bytes_per_core: int
    kv_cache_bytes_per_core: int
    lora_bytes_per_core: int
    activation_bytes_per_core: int
    hbm_per_core_bytes: int
    draft_weights_bytes_per_core: int = 0
    """A fused draft's weights (`speculation_memory`)."""
    draft_kv_cache_bytes_per_core: int = 0
    """A fused draft's KV cache."""
    medusa_heads_bytes_per_core: int = 0
    hidden_cache_bytes_per_core: int = 0
    """EAGLE's hidden-state cache layer."""
    min_tp_degree: int | None
    """Smallest valid TP degree whose plan fits; None when none does."""

    @property
    def per_core_bytes(self) -> int:
        return (
            self.weights_bytes_per_core
            + self.kv_cache_bytes_per_core
            + self.lora_bytes_per_core
            + self.activation_bytes_per_core
            + self.speculation_bytes_per_core
        )

    @property
    def speculation_bytes_per_core(self) -> int:
        """What speculation adds per core: a fused draft, Medusa heads, EAGLE's hidden states."""
        return (
            self.draft_weights_bytes_per_core
            + self.draft_kv_cache_bytes_per_core
            + self.medusa_heads_bytes_per_core
            + self.hidden_cache_bytes_per_core
        )

    @property
    def total_bytes(self) -> int:
        return self.per_core_bytes * self.tp_degree

    @property
    def weights_bytes(self) -> int:
        """Weights over all cores (replicas and padding included)."""
        return self.weights_bytes_per_core * self.tp_degree

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_bytes_per_core * self.tp_degree

    @property
    def fits(self) -> bool:
        return self.per_core_bytes <= self.hbm_per_core_bytes


def _is_linear(w: sharding.WeightShard) -> bool:
    """A linear layer's weight: what `quantized=True` stores in one byte per value."""
    return w.name.endswith(".weight") and ("_proj." in w.name or ".Wqkv." in w.name or w.name == "lm_head.weight")


def _scale_count(shape: tuple[int, ...], req: MemoryRequest) -> int:
    """Scales of one rank's quantized linear weight of `shape` ([..., out, in]): a grid of
    `scale_block` blocks over each [out, in] matrix, one per output row, or one."""
    out_features, in_features = shape[-2], shape[-1]
    if req.scale_block is None:
        return out_features if req.per_channel_scales else 1
    rows, cols = req.scale_block
    matrices = math.prod(shape[:-2])
    return matrices * -(-out_features // rows) * -(-in_features // cols)


def weight_bytes_per_core(plan: sharding.ShardPlan, req: MemoryRequest) -> int:
    """Bytes of one rank's weights (see the module rules for quantization)."""
    dt = DTYPE_BYTES[req.torch_dtype]
    total = 0
    for w in plan.weights:
        n = w.rank_numel()
        names = [w.name.replace("{i}", str(i)) for i in range(plan.num_layers)] if w.per_layer else [w.name]
        for name in names:
            if req.weight_quant_dtype is not None and _is_linear(w) and not kept_in_float(name, req.quant_skip):
                total += n + _scale_count(w.rank_shape(), req) * req.scale_bytes
            else:
                total += n * dt
    return total


def activation_bytes_per_core(model: ModelSpec, counts: gqa.HeadCounts, req: MemoryRequest) -> int:
    """Estimate of the live activations of one rank (see the module rules)."""
    b, s, tp = req.batch_size, req.max_context_length, counts.tp
    dt = DTYPE_BYTES[req.attention_dtype or req.torch_dtype]
    f_r = sharding.round_up(model.intermediate_size, tp) // tp
    v_r = sharding.round_up(model.vocab_size, tp) // tp
    qkv = (counts.q_per_rank + 2 * counts.kv_per_rank) * model.head_dim
    per_token = 4 * model.hidden_size + qkv + 2 * f_r
    scores = b * counts.q_per_rank * min(s, SCORE_TILE_ROWS) * s * 4
    return b * s * per_token * dt + scores + b * v_r * 4


def layout_for(model: ModelSpec, counts: gqa.HeadCounts, req: MemoryRequest) -> Result[kv_layout.KVLayout, ConfigError]:
    """The KV layout these settings give (flash decoding groups included)."""
    group: Result[int, ConfigError] = Success(1)
    if req.flash_decoding_enabled:
        group = gqa.flash_decoding_group(counts.tp, model.num_attention_heads, model.num_kv_heads)
    return group.bind(
        lambda g: kv_layout.kv_layout(
            tp=counts.tp,
            num_layers=model.num_layers,
            kv_heads_per_rank=counts.kv_per_rank,
            head_dim=model.head_dim,
            kv_cache_batch_size=req.kv_cache_batch_size,
            kv_cache_padding_size=req.kv_cache_padding_size,
            max_length=req.max_length,
            dtype=req.attention_dtype or req.torch_dtype,
            kv_cache_quant=req.kv_cache_quant,
            quant_dtype=req.kv_quant_dtype,
            sliding_window=model.cache_window,
            flash_decoding_group=g,
        )
    )


def _per_core(model: ModelSpec, req: MemoryRequest) -> Result[MemoryPlan, ConfigError]:
    """Memory at `req.tp_degree`, without the search for the smallest fitting degree."""
    plan = sharding.shard_plan(
        model,
        tp=req.tp_degree,
        strategy=req.strategy,
        fused_qkv=req.fused_qkv,
        vocab_parallel=req.vocab_parallel,
        moe_ep=req.moe_ep_degree if model.is_moe else 1,
        tkg_ep=req.moe_tkg_ep_degree if model.is_moe else None,
    )
    composed = plan.bind(lambda p: layout_for(model, p.counts, req).map(lambda kv: _compose(model, p, kv, req)))
    return composed.bind(lambda p: _with_speculation(p, req))


def _with_speculation(plan: MemoryPlan, req: MemoryRequest) -> Result[MemoryPlan, ConfigError]:
    """`plan` with what `req.speculation` adds at its tp degree (a fused draft: its own weights and
    its KV cache over the target's cache rows and slots, in its own dtypes)."""
    load = req.speculation
    if load is None:
        return Success(plan)
    plan = attrs.evolve(
        plan, medusa_heads_bytes_per_core=load.medusa_heads_bytes, hidden_cache_bytes_per_core=load.hidden_cache_bytes
    )
    if load.draft is None:
        return Success(plan)
    draft = load.draft
    own = memory_request_for(draft.model, attrs.evolve(draft.spec, lora_config=None), platform=req.platform)

    def at_target(r: MemoryRequest) -> MemoryRequest:  # the target's tp, cache rows and slots
        return attrs.evolve(
            r,
            tp_degree=req.tp_degree,
            max_length=req.max_length,
            kv_cache_batch_size=req.kv_cache_batch_size,
            kv_cache_padding_size=req.kv_cache_padding_size,
            speculation=None,
        )

    return own.bind(lambda r: _per_core(draft.model, at_target(r))).map(
        lambda d: attrs.evolve(
            plan,
            draft_weights_bytes_per_core=d.weights_bytes_per_core + speculation_memory.eagle_weights_delta(draft),
            draft_kv_cache_bytes_per_core=d.kv_cache_bytes_per_core,
        )
    )


def _compose(model: ModelSpec, plan: sharding.ShardPlan, kv: kv_layout.KVLayout, req: MemoryRequest) -> MemoryPlan:
    lora_bytes = 0
    if req.lora is not None:
        lora_bytes = req.lora.max_loras * lora_slot_bytes(req.lora, plan, req.torch_dtype)
    return MemoryPlan(
        tp_degree=plan.tp,
        weights_bytes_per_core=weight_bytes_per_core(plan, req),
        kv_cache_bytes_per_core=kv.bytes_per_rank,
        lora_bytes_per_core=lora_bytes,
        activation_bytes_per_core=activation_bytes_per_core(model, plan.counts, req),
        hbm_per_core_bytes=PLATFORMS[req.platform].hbm_per_core_bytes(req.lnc),
        min_tp_degree=None,
    )


def lora_slot_bytes(load: LoraLoad, plan: sharding.ShardPlan, dtype: str) -> int:
    """Bytes one adapter slot takes on a core under `plan`."""
    if load.layout is None:
        return lora.bytes_per_core(load.adapter, tp=plan.tp, shard_linear_layer=load.shard_linear_layer)
    each = DTYPE_BYTES[dtype]
    return lora_ranks.bytes_per_slot(load.layout, plan, shard_linear=load.shard_linear_layer, dtype_bytes=each)


def min_tp_degree(model: ModelSpec, req: MemoryRequest) -> int | None:
    """The smallest TP degree valid on the request's platform/LNC/instance whose plan fits, or None."""
    for tp in sharding.valid_tp_degrees(req.platform, req.lnc, instance=req.instance):
        match _per_core(model, attrs.evolve(req, tp_degree=tp)):
            case Success(p) if p.fits:
                return tp
    return None


def memory_plan(model: ModelSpec, req: MemoryRequest) -> Result[MemoryPlan, ConfigError]:
    """Memory per core at `req.tp_degree`, the verdict and the smallest valid TP degree that fits.

    Returns:
        `Failure` when the sharding or the KV layout cannot be planned (see `sharding.shard_plan`,
        `kv_layout.kv_layout`, `gqa.flash_decoding_group`). Not fitting is a verdict, not a failure.
    """
    return _per_core(model, req).map(lambda p: attrs.evolve(p, min_tp_degree=min_tp_degree(model, req)))


def memory_request_for(
    model: ModelSpec,
    spec: NeuronSpec,
    *,
    platform: Platform = Platform.TRN1,
    instance: str | None = None,
    draft: speculation_memory.Draft | None = None,
) -> Result[MemoryRequest, ConfigError]:
    """The memory request `spec` implies, LoRA adapters (`lora_config`) and speculation (a fused
    `draft` when given) included.

    Returns:
        `Failure` when the LoRA adapter size cannot be computed (unknown target modules, ...).
    """
    load: Result[LoraLoad | None, ConfigError] = Success(None)
    cfg = spec.lora_config
    if cfg is not None:
        load = lora.adapter_size_for(model, cfg, dtype=spec.torch_dtype).bind(
            lambda size: lora.layout_for(model, cfg).map(
                lambda layout: LoraLoad(
                    adapter=size,
                    max_loras=cfg.effective_max_loras,
                    shard_linear_layer=cfg.lora_shard_linear_layer,
                    layout=layout,
                )
            )
        )
    quant = weight_quant(spec)
    return load.map(
        lambda lora_load: MemoryRequest(
            tp_degree=spec.tp_degree,
            batch_size=spec.ctx_batch_size,
            max_context_length=spec.max_context_length,
            max_length=speculation_memory.cache_slots(spec),
            kv_cache_batch_size=spec.kv_cache_batch_size,
            kv_cache_padding_size=spec.kv_cache_padding_size,
            torch_dtype=spec.torch_dtype,
            attention_dtype=spec.attention_dtype,
            kv_cache_quant=spec.kv_cache_quant or spec.kv_quant_config is not None,
            kv_quant_dtype=spec.kv_dtype if spec.kv_quant_config is not None else kv_layout.KV_QUANT_DTYPE,
            weight_quant_dtype=quant.dtype if quant is not None else None,
            per_channel_scales=quant is not None and quant.type != "per_tensor_symmetric",
            scale_block=quant.scale_block() if quant is not None else None,
            scale_bytes=DTYPE_BYTES[quant.scale_dtype] if quant is not None else SCALE_BYTES,
            quant_skip=quant.skip if quant is not None else (),
            fused_qkv=spec.fused_qkv,
            vocab_parallel=spec.vocab_parallel,
            flash_decoding_enabled=spec.flash_decoding_enabled,
            moe_ep_degree=spec.moe.ep_degree(token_generation=False) if spec.moe is not None else 1,
            moe_tkg_ep_degree=spec.moe.ep_degree(token_generation=True)
            if spec.moe is not None and spec.moe.hybrid
            else None,
            lora=lora_load,
            speculation=speculation_memory.load_for(model, spec, draft),
            platform=platform,
            logical_nc_config=spec.logical_nc_config,
            instance=instance,
        )
    )


def memory_plan_for(
    model: ModelSpec,
    spec: NeuronSpec,
    *,
    platform: Platform = Platform.TRN1,
    instance: str | None = None,
    draft: speculation_memory.Draft | None = None,
) -> Result[MemoryPlan, ConfigError]:
    """`memory_plan` for the settings of `spec` on `platform` (or `instance`), a fused `draft` counted when given."""
    return memory_request_for(model, spec, platform=platform, instance=instance, draft=draft).bind(
        lambda req: memory_plan(model, req)
    )

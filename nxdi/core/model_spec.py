"""ModelSpec: a decoder-only transformer architecture, independent of how it is run. Pure.

A ModelSpec is read from a Hugging Face `config.json` dict by the family records
(`nxdi.core.families.parse_model_spec`, the one door for raw HF JSON); everything downstream
(planners, weight plans, programs) reads only this value.
"""

from __future__ import annotations

import enum

import attrs

from nxdi.core.config.fields import INFO, FieldInfo, setting


class MlpKind(enum.Enum):
    """The feed-forward block of every layer."""

    GATED = "gated"
    """`down(act(gate x) * up x)` (SwiGLU and relatives)."""
    PLAIN = "plain"
    """`down(act(up x))` (OPT, GPT-2)."""
    MOE = "moe"
    """A router choosing `num_experts_per_tok` of `num_experts` gated experts per token."""


class NormKind(enum.Enum):
    RMS = "rms"
    LAYER = "layer"


class PositionKind(enum.Enum):
    ROPE = "rope"
    LEARNED = "learned"
    """A learned position table added to the token embeddings (GPT-2, OPT)."""
    ALIBI = "alibi"
    """Attention scores biased by a per-head slope times the key's position (BLOOM)."""


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


ACTIVATIONS = frozenset({"silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "swish"})


@attrs.frozen(kw_only=True)
class RopeSpec:
    """Rotary position embedding parameters."""

    theta: float = attrs.field(default=10000.0, validator=attrs.validators.gt(0))
    """Base of the inverse frequencies."""
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    """Context extension factor (linear, dynamic, llama3, yarn)."""
    low_freq_factor: float = 1.0
    """Llama-3 scaling: wavelengths longer than original_max/low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """Llama-3 scaling: wavelengths shorter than original_max/high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    """YaRN attention temperature; None means the standard 0.1*ln(factor)+1."""


@attrs.frozen(kw_only=True)
class ModelSpec:
    """A decoder-only transformer architecture, independent of how it is run."""

    model_type: str
    hidden_size: int = attrs.field(validator=attrs.validators.gt(0))
    num_attention_heads: int = attrs.field(validator=attrs.validators.gt(0))
    num_kv_heads: int = attrs.field(validator=attrs.validators.gt(0))
    head_dim: int = attrs.field(validator=attrs.validators.gt(0))
    num_layers: int = attrs.field(validator=attrs.validators.gt(0))
    vocab_size: int = attrs.field(validator=attrs.validators.gt(0))
    intermediate_size: int = attrs.field(validator=attrs.validators.gt(0))
    """FFN width; for MoE models the width of one expert."""
    max_position_embeddings: int = attrs.field(validator=attrs.validators.gt(0))
    norm: NormKind = NormKind.RMS
    norm_bias: bool = True
    """Whether LayerNorms carry a bias (OPT, GPT-2: yes; DBRX: no). RMS norms never do."""
    norm_eps: float = 1e-6
    activation: str = attrs.field(default="silu", validator=attrs.validators.in_(ACTIVATIONS))
    gated_mlp: bool = True
    """True for SwiGLU-style MLPs (gate, up, down); False for two-matrix MLPs (OPT, GPT-2)."""
    position: PositionKind = PositionKind.ROPE
    position_offset: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Learned positions: rows of the position table before position 0 (OPT reserves 2)."""
    rope: RopeSpec | None = RopeSpec()
    rotary_dim: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    """RoPE rotates the first `rotary_dim` dims of each head, even and passes the rest (GPT-J's
    `rotary_dim`, GPT-NeoX's `rotary_pct`); None: all `head_dim` of them."""
    parallel_residual: bool = False
    """Attention and MLP both read the layer's input and both outputs join the residual at once
    (GPT-J; GPT-NeoX's `use_parallel_residual`); False: the MLP reads the attention's output."""
    shared_layer_norm: bool = False
    """With `parallel_residual`: one norm feeds both attention and MLP (GPT-J's `ln_1`); False: each has its own."""
    post_layer_norm: bool = False
    """Norms after each residual add (OPT with `do_layer_norm_before=False`); False: before each block."""
    final_norm: bool = True
    """A norm before the lm_head (OPT's post-norm variant has none)."""
    embed_norm: bool = False
    """A LayerNorm right after the token embeddings (BLOOM's `word_embeddings_layernorm`)."""
    lm_head_bias: bool = False
    """The lm_head has a bias (GPT-J)."""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """An RMSNorm over each head of q and k, before RoPE."""
    norm_offset: bool = False
    """Every RMSNorm (q/k norms included) scales by `1 + weight` in fp32 and rounds to the activation
    dtype after the scaling (Gemma: checkpoints store the offset from 1); False: `weight * rounded`."""
    sandwich_norms: bool = False
    """Each layer also norms its attention and MLP outputs before adding them to the residual, and
    norms the MLP input with a weight of its own (Gemma: `post_attention_layernorm` norms the
    attention output, `pre_feedforward_layernorm` / `post_feedforward_layernorm` the MLP's)."""
    embed_scale: float | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    """Token embeddings are multiplied by this, rounded to the embedding dtype first (Gemma:
    sqrt(hidden_size)); None: not scaled."""
    attention_scale: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    """Softmax scale of the attention scores q.k (Gemma: query_pre_attn_scalar**-0.5); None: head_dim**-0.5."""
    attention_upcast: bool = False
    """Attention scores, softmax and the mix of values in fp32 whatever the activation dtype (GPT-J
    computes its scores in fp32); False: in the activation dtype."""
    final_logit_softcap: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    """Logits become `cap * tanh(logits / cap)` (Gemma's `final_logit_softcapping`); None: not capped."""
    local_rope: RopeSpec | None = None
    """RoPE of the sliding-window layers where it differs from `rope` (Gemma 3: `rope_local_base_freq`,
    unscaled); None: every layer uses `rope`."""
    clip_qkv: float | None = None
    """DBRX: q, k and v are clamped to [-clip_qkv, clip_qkv] after projection; None for no clamp."""
    sliding_window: int | None = None
    """Each query attends to the last `sliding_window` positions only (None: all of them)."""
    full_attention_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Layers that attend to every position despite `sliding_window` (Qwen2/3 below max_window_layers)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 for dense models."""
    num_experts_per_tok: int = 0
    moe_normalize: bool = True
    """MoE: the chosen experts' router weights are renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    `norm_topk_prob`), or to p-norm 1 with `moe_normalize_p`."""
    moe_normalize_p: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    """MoE: the norm of that renormalisation: 1 (a sum) but for DBRX, whose `moe_normalize_expert_weights` is p."""
    pad_token_id: int | None = setting(None, "Padding token id (runtime only).", graph=False)
    bos_token_id: int | None = setting(None, "Beginning-of-sequence token id (runtime only).", graph=False)
    eos_token_ids: tuple[int, ...] = attrs.field(
        default=(),
        converter=tuple,
        metadata={INFO: FieldInfo(doc="End-of-sequence token ids (runtime only).", graph=False)},
    )

    @property
    def q_size(self) -> int:
        """Width of the query projection output (H * D)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one of the key/value projection outputs (K * D)."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_kind(self) -> MlpKind:
        """Which feed-forward block every layer has."""
        if self.is_moe:
            return MlpKind.MOE
        return MlpKind.GATED if self.gated_mlp else MlpKind.PLAIN

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to every position."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_rope(self, layer: int) -> RopeSpec | None:
        """The RoPE of `layer`: `local_rope` for a sliding-window layer when set, else `rope`."""
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def cache_window(self) -> int | None:
        """The window every layer shares, which bounds the positions a KV cache must keep (None: all)."""
        return None if self.full_attention_layers else self.sliding_window

    def _mlp_params(self) -> int:
        """Parameters of one MLP (one expert's, in a mixture of experts)."""
        e, f = self.hidden_size, self.intermediate_size
        bias = (2 * f if self.gated_mlp else f) + e if self.mlp_bias else 0
        return (3 if self.gated_mlp else 2) * e * f + bias

    def active_params(self) -> int:
        """Parameters one token reads: all of them, less the experts it does not choose."""
        unchosen = self.num_experts - self.num_experts_per_tok if self.is_moe else 0
        return self.num_params() - self.num_layers * unchosen * self._mlp_params()

    def num_params(self) -> int:
        """Parameter count of the checkpoint (tied embeddings counted once)."""
        e, v = self.hidden_size, self.vocab_size
        attn = e * self.q_size + 2 * e * self.kv_size + self.q_size * e
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = self._mlp_params()
        if self.is_moe:
            mlp = mlp * self.num_experts + e * self.num_experts
        norm = 2 * e if self.norm is NormKind.LAYER and self.norm_bias else e
        layers = self.num_layers * (attn + mlp + self.layer_norms * norm)
        embed = v * e + (0 if self.tie_word_embeddings else v * e)
        rows = self.max_position_embeddings + self.position_offset
        learned = rows * e if self.position is PositionKind.LEARNED else 0
        extra = (norm if self.final_norm else 0) + (norm if self.embed_norm else 0) + (v if self.lm_head_bias else 0)
        return layers + embed + learned + extra

    @property
    def layer_norms(self) -> int:
        """Norms per layer: 4 with sandwich norms, 1 when attention and MLP share one, else 2."""
        return 4 if self.sandwich_norms else 1 if self.shared_layer_norm else 2

    @property
    def rotary_dims(self) -> int:
        """The dims of each head RoPE rotates (`rotary_dim`, or all of `head_dim`)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

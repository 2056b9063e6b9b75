"""The mixture-of-experts block as a function of tensors: router, top-k, expert MLPs, combine. Pure.

For tokens x [T, E], X experts in the model of which this rank holds Xl (experts
`first_expert .. first_expert + Xl - 1`), each with a gated MLP of width F:

    logits = x @ router.T (+ bias)                        [T, X] in `router_dtype`
    scores = softmax(logits) or sigmoid(logits)           [T, X] fp32
    a, idx = top_k(scores), renormalised if asked         [T, k], [T, k]
    hidden = sum_k a[t, k] * expert_{idx[t, k]}(x[t])     [T, E], local experts only

`hidden` is this rank's partial sum; the caller all-reduces across ranks (expert parallelism splits
the experts, tensor parallelism splits F). Three paths, picked from static shapes only, agree
whenever no token is dropped:
- selective: each of the T*k (token, choice) pairs gathers its expert's weights, so a decode step
  reads only the active experts. A choice of a non-local expert reads a clamped index and is masked.
- all experts: every local expert runs on every token; a [T, Xl] affinity matrix, zero for
  unchosen experts, combines them. No dropping.
- capacity: tokens are dispatched into [Xl, C, E] slots, C tokens per expert; later tokens beyond
  an expert's capacity are dropped for that expert.

Reference semantics (NxD `modules/moe`: routing.py, expert_mlps_v2.py, experts.py; and transformers'
Mixtral, Qwen3-MoE and DBRX blocks, which are the accuracy reference):
- Router: as transformers, the scores are computed in fp32 (NxD uses fp64) and top-k picks from
  the softmax scores (Mixtral, Qwen3-MoE, DBRX); with sigmoid it picks from the logits (as Llama 4
  and NxD do: sigmoid saturates in fp32 and would tie). Normalising divides the k chosen scores by
  their sum (p = 1, `normalize_top_k_affinities`, Qwen3 `norm_topk_prob`) or their p-norm (DBRX
  `moe_normalize_expert_weights`). NxD refuses normalising with top_k == 1; here it gives 1.0.
- Capacity (NxD `forward_capacity_factor`): C = min(T, ceil(T * k * capacity_factor / X)), X the
  experts of the whole model. A token's position in an expert is the running count, in token
  order, of tokens choosing it (earlier tokens win); positions past C are dropped. Affinities are
  renormalised after dropping, so a token that loses one of its k experts gives the survivors its
  weight (when normalising), and a token that loses all of them outputs zero. NxD treats
  capacity_factor >= X / k as full capacity (no capacity path); `choose_path` does too.
- Path choice (NxD `ExpertMLPsV2.forward`, inference): token generation uses selective loading
  when T * k < X, else all experts, and ignores capacity_factor; context encoding uses the
  capacity path when capacity_factor is set, else selective when T * k < X, else all experts
  (NxD's blockwise kernel computes the same as all experts). `selective_max_tokens` overrides
  the T * k < X threshold.
- Expert activation (NxD `Experts._activation`): gate and up are clamped to their limits first;
  "glu" is `act(s * gate) * (up + b)`, "swiglu" is `gate * act(s * gate) * (up + b)`, with s =
  hidden_act_scaling_factor and b = hidden_act_bias (GPT-OSS: sigmoid, s = 1.702, b = 1). NxD
  clamps only when a limit is truthy (a limit of 0.0 is ignored there); here any limit set applies.
- Early affinity modulation (NxD `early_expert_affinity_modulation`, Llama 4): each expert's input
  is scaled by its affinity and outputs are summed unweighted. NxD supports it for top_k == 1 and
  not in the capacity path; here every path applies it per (token, expert) pair, which is NxD's
  result for top_k == 1.
- Padded tokens (`token_mask`, NxD `moe_mask_padded_tokens`): zero output, no capacity taken.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from nxdi.core.programs import layers


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Experts:
    """One MoE layer's weights on this rank. Linear weights are [out, in] per expert; the expert
    weights are in the activations' dtype (the router is cast to `MoEOptions.router_dtype`)."""

    router: Tensor
    """[X, E]: all experts of the model (every rank routes over all of them)."""
    gate: Tensor
    """[Xl, F, E]: this rank's local experts, stacked."""
    up: Tensor
    """[Xl, F, E]"""
    down: Tensor
    """[Xl, E, F]"""
    router_bias: Tensor | None = None
    """[X]"""


class MoEPath(enum.Enum):
    """How the experts are computed (see the module docstring)."""

    SELECTIVE = "selective"
    ALL_EXPERTS = "all_experts"
    CAPACITY = "capacity"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoEOptions:
    """Static settings of an MoE block (NxDI `MoENeuronConfig` and the family's config).

    Raises (on construction):
        ValueError: top_k < 1, capacity_factor <= 0, an unknown router_act, glu_type or activation.
    """

    top_k: int
    activation: str = "silu"
    """The experts' Hugging Face `hidden_act`."""
    router_act: str = "softmax"
    """"softmax" or "sigmoid"."""
    router_dtype: torch.dtype = torch.float32
    normalize_top_k: bool = True
    """Renormalise the k chosen affinities (to p-norm 1)."""
    normalize_p: float = 1.0
    """The norm of that renormalisation: 1 (a sum) for most families, DBRX's `moe_normalize_expert_weights`."""
    capacity_factor: float | None = None
    glu_type: str = "glu"
    """"glu": `act(s * gate) * (up + b)`; "swiglu": `gate * act(s * gate) * (up + b)`."""
    hidden_act_scaling_factor: float = 1.0
    hidden_act_bias: float = 0.0
    gate_clamp_upper: float | None = None
    gate_clamp_lower: float | None = None
    up_clamp_upper: float | None = None
    up_clamp_lower: float | None = None
    early_affinity_modulation: bool = False
    selective_max_tokens: int | None = None
    """Use selective loading when T * top_k <= this; None: when T * top_k < X (NxD's threshold)."""

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.router_act not in ("softmax", "sigmoid"):
            raise ValueError(f'router_act must be "softmax" or "sigmoid", got {self.router_act!r}')
        if self.glu_type not in ("glu", "swiglu"):
            raise ValueError(f'glu_type must be "glu" or "swiglu", got {self.glu_type!r}')
        layers.activation(self.activation)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class MoEOutput:
    """What `forward` returns."""

    hidden: Tensor
    """[T, E] in x's dtype: this rank's partial sum over its local experts."""
    router_logits: Tensor
    """[T, X] in the router dtype."""
    expert_index: Tensor
    """[T, k] int64, global expert ids."""


def expert_capacity(tokens: int, num_experts: int, options: MoEOptions) -> int | None:
    """C, the tokens each expert takes, or None for full capacity (no capacity factor, or one >= X / k).

    NxD: `min(T, ceil(T * k * capacity_factor / X))`."""
    cf = options.capacity_factor
    if cf is None or cf >= num_experts / options.top_k:
        return None
    return min(tokens, math.ceil(tokens * options.top_k * cf / num_experts))


def choose_path(tokens: int, num_experts: int, options: MoEOptions, *, token_generation: bool = False) -> MoEPath:
    """The path NxD takes for T = `tokens` (static): see the module docstring."""
    limit = options.selective_max_tokens
    selective = tokens * options.top_k < num_experts if limit is None else tokens * options.top_k <= limit
    if not token_generation and expert_capacity(tokens, num_experts, options) is not None:
        return MoEPath.CAPACITY
    return MoEPath.SELECTIVE if selective else MoEPath.ALL_EXPERTS


def _normalize(a: Tensor, p: float) -> Tensor:
    """a [..., k] divided by its p-norm over the last dim; an all-zero row stays zero (no NaN)."""
    norm = a.sum(-1, keepdim=True) if p == 1 else torch.linalg.vector_norm(a, ord=p, dim=-1, keepdim=True)
    return a / norm.clamp_min(1e-12)


def route(x: Tensor, experts: Experts, options: MoEOptions) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits [T, X] (router dtype), affinities [T, k] fp32 (renormalised per `options`) and
    expert_index [T, k] int64 for tokens x [T, E]. Indices in a row are distinct, best first.

    Raises:
        ValueError: top_k larger than X.
    """
    num_experts = experts.router.shape[0]
    if options.top_k > num_experts:
        raise ValueError(f"top_k {options.top_k} exceeds the {num_experts} experts")
    dt = options.router_dtype
    bias = None if experts.router_bias is None else experts.router_bias.to(dt)
    logits = F.linear(x.to(dt), experts.router.to(dt), bias)
    if options.router_act == "softmax":
        affinities, index = torch.topk(F.softmax(logits.float(), dim=-1), options.top_k, dim=-1)
    else:  # rank by logits: sigmoid rounds large logits to the same 1.0
        top, index = torch.topk(logits.float(), options.top_k, dim=-1)
        affinities = torch.sigmoid(top)
    if options.normalize_top_k:
        affinities = _normalize(affinities, options.normalize_p)
    return logits, affinities, index.to(torch.int64)


def _activate(gate: Tensor, up: Tensor, options: MoEOptions) -> Tensor:
    """The gated activation of NxD `Experts._activation` (clamps, glu or swiglu, scale and bias)."""
    if options.gate_clamp_lower is not None or options.gate_clamp_upper is not None:
        gate = gate.clamp(min=options.gate_clamp_lower, max=options.gate_clamp_upper)
    if options.up_clamp_lower is not None or options.up_clamp_upper is not None:
        up = up.clamp(min=options.up_clamp_lower, max=options.up_clamp_upper)
    act = layers.activation(options.activation)
    s, b = options.hidden_act_scaling_factor, options.hidden_act_bias
    scaled = act(gate * s) if s != 1.0 else act(gate)
    if options.glu_type == "swiglu":
        scaled = gate * scaled
    return scaled * (up + b) if b != 0.0 else scaled * up


def _mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, options: MoEOptions) -> Tensor:
    """Batched expert MLPs: x [B or 1, N, E], gate/up [B, F, E], down [B, E, F] -> [B, N, E]."""
    h = _activate(torch.matmul(x, gate.transpose(1, 2)), torch.matmul(x, up.transpose(1, 2)), options)
    return torch.matmul(h, down.transpose(1, 2))


def _local(expert_index: Tensor, first: Tensor | int, num_local: int) -> tuple[Tensor, Tensor]:
    """Local expert ids [T, k] clamped into range (so they can index), and whether each is local."""
    local = expert_index - first
    return local.clamp(0, num_local - 1), (local >= 0) & (local < num_local)


def _selective(
    x: Tensor, e: Experts, index: Tensor, weight: Tensor, mask: Tensor, first: Tensor | int, options: MoEOptions
) -> Tensor:
    """Each (token, choice) pair runs its own expert, weights gathered: [T, E]."""
    t, k = index.shape
    local, is_local = _local(index, first, e.gate.shape[0])
    w = weight * is_local  # a non-local choice ran a clamped stand-in expert: masked out
    flat = local.reshape(t * k)
    xin = x[:, None, None, :].expand(t, k, 1, x.shape[-1]).reshape(t * k, 1, x.shape[-1])
    if options.early_affinity_modulation:
        xin = xin * weight.reshape(t * k, 1, 1).to(x.dtype)
        w = (is_local & mask[:, None]).to(weight.dtype)  # mlp(0) need not be 0: mask, not weight
    # index_select copies the chosen experts' rows ~4x faster than advanced indexing on the CPU
    gate, up, down = (w.index_select(0, flat) for w in (e.gate, e.up, e.down))
    y = _mlp(xin, gate, up, down, options).view(t, k, -1)
    return torch.einsum("tke,tk->te", y, w.to(x.dtype))


def _dense_affinities(index: Tensor, weight: Tensor, first: Tensor | int, num_local: int) -> Tensor:
    """[T, Xl]: each token's weight for each local expert, zero where not chosen."""
    hit = index[:, :, None] == torch.arange(num_local, device=index.device) + first  # [T, k, Xl]
    return (hit.to(weight.dtype) * weight[:, :, None]).sum(1)


def _all_experts(
    x: Tensor, e: Experts, index: Tensor, weight: Tensor, mask: Tensor, first: Tensor | int, options: MoEOptions
) -> Tensor:
    """Every local expert on every token, combined by a dense affinity matrix: [T, E]."""
    num_local = e.gate.shape[0]
    w = _dense_affinities(index, weight, first, num_local)  # [T, Xl]
    if options.early_affinity_modulation:
        y = _mlp(x[None] * w.T[:, :, None].to(x.dtype), e.gate, e.up, e.down, options)  # [Xl, T, E]
        chosen = mask[:, None].expand(index.shape).to(weight.dtype)  # unchosen experts also ran: mask them
        w = _dense_affinities(index, chosen, first, num_local)
    else:
        y = _mlp(x[None], e.gate, e.up, e.down, options)
    return torch.einsum("xte,tx->te", y, w.to(x.dtype))


def _capacity(
    x: Tensor,
    e: Experts,
    index: Tensor,
    weight: Tensor,
    mask: Tensor,
    capacity: int,
    first: Tensor | int,
    options: MoEOptions,
) -> Tensor:
    """Tokens dispatched into [Xl, C, E] expert slots in token order, overflow dropped: [T, E].

    `weight` [T, k] is the routed affinities (renormalised again here after dropping), `mask` [T]
    the tokens that may take a slot. Which pairs are dropped is worked out over all X experts (a
    [T, X] count, cheap), since renormalising needs the survivors held by other ranks too."""
    t, k = index.shape
    num_experts, num_local = e.router.shape[0], e.gate.shape[0]
    chosen = (index[:, :, None] == torch.arange(num_experts, device=x.device)) & mask[:, None, None]  # [T, k, X]
    position = torch.cumsum(chosen.sum(1), dim=0) - 1  # [T, X]: 0-based slot in each expert, in token order
    slot = position.gather(1, index)  # [T, k]; a token picks an expert at most once
    kept = mask[:, None] & (slot < capacity)
    if options.normalize_top_k:
        weight = _normalize(weight * kept, options.normalize_p)
    local, is_local = _local(index, first, num_local)
    kept = kept & is_local
    weight = weight * kept
    dump = num_local * capacity  # one spare slot that every dropped pair writes to, never read back
    flat = torch.where(kept, local * capacity + slot, dump)  # [T, k]
    tokens = torch.arange(t, device=x.device)[:, None].expand(t, k)
    owner = torch.zeros(dump + 1, dtype=torch.int64, device=x.device).scatter(0, flat.reshape(-1), tokens.reshape(-1))
    xin = x.index_select(0, owner[:dump]).view(
        num_local, capacity, x.shape[-1]
    )  # an empty slot computes token 0, unused
    if options.early_affinity_modulation:
        scale = torch.zeros(dump + 1, dtype=weight.dtype, device=x.device).scatter(
            0, flat.reshape(-1), weight.reshape(-1)
        )
        xin = xin * scale[:dump].view(num_local, capacity, 1).to(x.dtype)
        weight = kept.to(weight.dtype)
    y = _mlp(xin, e.gate, e.up, e.down, options).reshape(dump, -1)
    y = torch.cat((y, y.new_zeros(1, y.shape[-1])))[flat]  # [T, k, E]; dropped pairs read zeros
    return torch.einsum("tke,tk->te", y, weight.to(x.dtype))


def forward(
    x: Tensor,
    experts: Experts,
    options: MoEOptions,
    *,
    token_mask: Tensor | None = None,
    path: MoEPath | None = None,
    first_expert: Tensor | int = 0,
) -> MoEOutput:
    """The MoE block on tokens x [T, E]: this rank's partial output [T, E] in x's dtype, the router
    logits [T, X] and the chosen experts [T, k].

    `token_mask` [T] bool marks real tokens; padded ones output zero and take no capacity. `path`
    forces a path; by default it is `choose_path(T, X, options)` (NxD's context-encoding rule; a
    token-generation caller passes `choose_path(..., token_generation=True)`). The capacity path
    without a capacity factor (or with one >= X / k) gives every expert T slots. `first_expert`:
    the global index of this rank's first local expert (expert parallelism), an int, or a 0-d
    tensor computed from the rank (one traced program serves every rank; a tensor is not checked).

    Raises:
        ValueError: x not 2-D; expert weight shapes that disagree with each other, with x or with
            the router; local experts beyond the model's (first_expert + Xl > X); top_k > X.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, E], got shape {tuple(x.shape)}")
    t, hidden = x.shape
    num_experts, (num_local, f, _) = experts.router.shape[0], experts.gate.shape
    if experts.router.shape[1] != hidden or experts.gate.shape[2] != hidden:
        raise ValueError(
            f"router {tuple(experts.router.shape)} and gate {tuple(experts.gate.shape)} do not fit E={hidden}"
        )
    if experts.up.shape != experts.gate.shape or tuple(experts.down.shape) != (num_local, hidden, f):
        raise ValueError(
            f"up {tuple(experts.up.shape)} / down {tuple(experts.down.shape)} do not match gate {(num_local, f, hidden)}"
        )
    if isinstance(first_expert, int) and not 0 <= first_expert <= num_experts - num_local:
        raise ValueError(f"local experts {first_expert}..+{num_local} exceed the model's {num_experts}")
    logits, affinities, index = route(x, experts, options)
    mask = torch.ones(t, dtype=torch.bool, device=x.device) if token_mask is None else token_mask.to(torch.bool)
    weight = affinities * mask[:, None]
    match path or choose_path(t, num_experts, options):
        case MoEPath.SELECTIVE:
            out = _selective(x, experts, index, weight, mask, first_expert, options)
        case MoEPath.ALL_EXPERTS:
            out = _all_experts(x, experts, index, weight, mask, first_expert, options)
        case MoEPath.CAPACITY:
            capacity = expert_capacity(t, num_experts, options) or t
            out = _capacity(x, experts, index, weight, mask, capacity, first_expert, options)
    return MoEOutput(hidden=out, router_logits=logits, expert_index=index)

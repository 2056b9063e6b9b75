"""Decode roofline: the bytes one token-generation step must read and write, and the time that takes
at a given memory bandwidth. Pure.

Theory of operation (one decode step of `batch` sequences, every rank's share summed: tp=1):
- A decode step is memory bound: each weight is read once per step whatever the batch, and each
  sequence reads its own KV cache. The roofline is `bytes / bandwidth`, a lower bound on the step
  time that no implementation beats on the same memory.
- Weights: every weight of the sharding plan (`sharding.shard_plan` at tp=1, so every linear, norm
  and bias, and lm_head) with the byte counting of the memory planner (`memory.weight_bytes_per_core`):
  `dtype` bytes per value, or with weight quantization 1 byte per value of a linear (lm_head
  included, as `quantized=True` stores it unless `modules_to_not_convert` keeps it) plus a float32
  scale per output row (`per_channel_scales`) or per tensor.
- The token embedding (and a learned position table) contributes only the `batch` rows gathered,
  which are left out (they are under a millionth of the model). A tied lm_head is the embedding
  matrix read once, as lm_head; tied and untied models therefore read the same bytes.
- MoE: a step reads only the experts its tokens are routed to, at most
  `min(num_experts, batch * num_experts_per_tok)` of them per layer; that upper bound is counted.
- KV cache: each of the `batch` sequences reads K and V of every layer for `context` positions
  (`kv_layout.kv_layout` with `max_length=context`; the sliding window, when every layer has one,
  bounds it) and writes one position: K and V, `num_kv_heads * head_dim` values each, in `kv_dtype`
  (default `dtype`). The positions a padded cache holds beyond `context` are not counted: reading
  them is the implementation's cost, not the model's.
- Activations, logits and the sampled tokens are left out (kilobytes against hundreds of megabytes).
"""

from __future__ import annotations

import attrs
from returns.result import Failure, Result, Success

from nxdi.core.config.neuron_spec import DTYPE_BYTES
from nxdi.core.errors import ConfigError, Problem, problems_of, problems_result
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import kv_layout, memory, sharding

WEIGHT_QUANT_DTYPES = ("int8", "f8e4m3", "f8e5m2")
"""Storage dtypes of quantized decoder linear weights (1 byte per value; NeuronConfig `quantization_dtype`)."""
_GATHERED = frozenset({"embed_tokens.weight", "embed_positions.weight"})
"""Tables a step gathers `batch` rows of: left out of the weight bytes."""


@attrs.frozen(kw_only=True)
class DecodeBytes:
    """Bytes one decode step moves between memory and the cores."""

    weight_bytes: int
    """Weights read (each once, whatever the batch)."""
    kv_read_bytes: int
    """KV cache read: every sequence's K and V of every layer at the step's context length."""
    kv_write_bytes: int
    """KV cache written: the new position's K and V of every layer and sequence."""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


@attrs.frozen(kw_only=True)
class Roofline:
    """The fastest a decode step can run at a memory bandwidth."""

    step_bytes: DecodeBytes
    bandwidth_bytes_per_s: float = attrs.field(validator=attrs.validators.gt(0))
    """Measured memory bandwidth, bytes per second."""
    batch: int = attrs.field(validator=attrs.validators.gt(0))
    """Sequences decoded per step."""

    @property
    def step_s(self) -> float:
        """Seconds per decode step: bytes / bandwidth."""
        return self.step_bytes.total_bytes / self.bandwidth_bytes_per_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the whole batch (each sequence gets `1 / step_s`)."""
        return self.batch / self.step_s


def _check(
    *, dtype: str, batch: int, context: int, weight_quant_dtype: str | None, kv_dtype: str | None
) -> Result[None, ConfigError]:
    problems = []
    if batch < 1:
        problems.append(Problem.of("batch", batch, "must be a positive number of sequences"))
    if context < 1:
        problems.append(Problem.of("context", context, "must be a positive number of cache positions"))
    for field, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if value is not None and value not in DTYPE_BYTES:
            problems.append(Problem.of(field, value, "is not a known dtype", f"use one of {sorted(DTYPE_BYTES)}"))
    if weight_quant_dtype is not None and weight_quant_dtype not in WEIGHT_QUANT_DTYPES:
        fix = f"use one of {list(WEIGHT_QUANT_DTYPES)}, or None for unquantized weights"
        problems.append(Problem.of("weight_quant_dtype", weight_quant_dtype, "is not a quantized weight dtype", fix))
    return problems_result(None, problems)


def _weight_bytes(model: ModelSpec, plan: sharding.ShardPlan, req: memory.MemoryRequest, batch: int) -> int:
    """Weights one step reads (see the module rules): the plan without the gathered tables, routed experts only."""
    read = tuple(w for w in plan.weights if w.name not in _GATHERED)
    dense = tuple(w for w in read if ".experts" not in w.name)
    # a decode step reads token generation's copy of the experts under hybrid sharding
    group = ".experts_tkg." if plan.hybrid else ".experts."
    experts = tuple(w for w in read if group in w.name)
    total = memory.weight_bytes_per_core(attrs.evolve(plan, weights=dense), req)
    if experts:
        routed = min(model.num_experts, batch * max(model.num_experts_per_tok, 1))
        all_experts = memory.weight_bytes_per_core(attrs.evolve(plan, weights=experts), req)
        total += all_experts * routed // model.num_experts
    return total


def _kv_bytes(model: ModelSpec, *, batch: int, positions: int, dtype: str) -> Result[int, ConfigError]:
    """K plus V bytes of every layer for `positions` positions of `batch` sequences (window-bounded)."""
    layout = kv_layout.kv_layout(
        tp=1,
        num_layers=model.num_layers,
        kv_heads_per_rank=model.num_kv_heads,
        head_dim=model.head_dim,
        kv_cache_batch_size=batch,
        max_length=positions,
        dtype=dtype,
        sliding_window=model.cache_window,
    )
    return layout.map(lambda kv: kv.bytes_per_rank)


def decode_step_bytes(
    model: ModelSpec,
    *,
    dtype: str,
    batch: int,
    context: int,
    weight_quant_dtype: str | None = None,
    per_channel_scales: bool = True,
    modules_to_not_convert: tuple[str, ...] = (),
    kv_dtype: str | None = None,
) -> Result[DecodeBytes, ConfigError]:
    """Bytes one decode step of `batch` sequences reads and writes (see the module rules).

    Args:
        dtype: storage dtype of the unquantized weights (NeuronConfig `torch_dtype`).
        context: cache positions each sequence attends to in this step, its new token included.
        weight_quant_dtype: storage dtype of quantized decoder linears (`int8`, `f8e4m3`, `f8e5m2`);
            None for unquantized weights.
        per_channel_scales: with quantized weights, one float32 scale per output row (else one per tensor).
        modules_to_not_convert: with quantized weights, the linears kept in `dtype` (NeuronConfig's
            field: a linear whose module path contains an entry, `"lm_head"` say).
        kv_dtype: storage dtype of the KV cache; None means `dtype`.

    Returns:
        `Failure` listing every non-positive batch or context, unknown dtype and unknown quantized
        weight dtype, or what `sharding.shard_plan` reports for inconsistent head counts.
    """
    checked = _check(
        dtype=dtype, batch=batch, context=context, weight_quant_dtype=weight_quant_dtype, kv_dtype=kv_dtype
    )
    plan = sharding.shard_plan(model, tp=1)
    match checked, plan:
        case Success(_), Success(p):
            req = memory.MemoryRequest(
                tp_degree=1,
                torch_dtype=dtype,
                weight_quant_dtype=weight_quant_dtype,
                per_channel_scales=per_channel_scales,
                quant_skip=modules_to_not_convert,
            )
            weights = _weight_bytes(model, p, req, batch)
            cache_dtype = kv_dtype or dtype
            read = _kv_bytes(model, batch=batch, positions=context, dtype=cache_dtype)
            written = _kv_bytes(model, batch=batch, positions=1, dtype=cache_dtype)
            return read.bind(
                lambda r: written.map(lambda w: DecodeBytes(weight_bytes=weights, kv_read_bytes=r, kv_write_bytes=w))
            )
    return Failure(ConfigError(problems=problems_of(checked, plan)))


def prefill_flops(model: ModelSpec, *, batch: int, prompt_len: int) -> int:
    """Floating-point operations (a multiply-add is 2) of a prefill of `batch` prompts of `prompt_len`
    tokens: the matmul work that makes prefill compute bound, to turn a measured TTFT into TFLOP/s.

    Counted: every decoder linear for every token (q/k/v/o; the MLP's two or three projections, with
    MoE the `num_experts_per_tok` experts each token is routed to, and the router); causal attention
    (QK^T and PV over the `t + 1` positions token `t` sees); lm_head for the last token of each
    prompt (what a prefill returns). Norms, rotary, softmax and activations are left out (under 1%).

    Raises:
        ValueError: `batch` or `prompt_len` is not positive (a caller's bug: bench flags are checked).
    """
    if batch <= 0 or prompt_len <= 0:
        raise ValueError(
            f"prefill_flops needs batch > 0 and prompt_len > 0, got batch={batch}, prompt_len={prompt_len}"
        )
    h, d = model.hidden_size, model.head_dim
    attn_linears = h * d * (2 * model.num_attention_heads + 2 * model.num_kv_heads)
    mlp = (3 if model.gated_mlp else 2) * h * model.intermediate_size
    if model.num_experts:
        mlp = mlp * model.num_experts_per_tok + h * model.num_experts
    seen = prompt_len * (prompt_len + 1) // 2  # positions attended, summed over the prompt's tokens
    attention = 2 * 2 * seen * model.num_attention_heads * d
    per_sequence = model.num_layers * (2 * prompt_len * (attn_linears + mlp) + attention) + 2 * h * model.vocab_size
    return batch * per_sequence

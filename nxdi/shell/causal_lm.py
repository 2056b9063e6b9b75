"""NeuronBaseForCausalLM: NxDI's forward, routing each call to context encoding or token generation.

Routing (as NxDI): a call whose smallest position id is 0 is a prefill and runs the
context-encoding sub-model; any other call runs token generation on the populated KV cache.
Inputs are fitted to the compiled shapes on the host: prompts are compacted to right padding and
padded to the smallest bucket that fits; a batch is split into chunks of the largest compiled batch
and each chunk padded to the smallest compiled batch that holds it (`token_generation_batches`
compiles several for token generation), with pad rows that repeat the first row and write no cache
row; outputs come back in the caller's row order. seq_ids that name no sequence go to the garbage
rows (`kv_cache_padding_size`) or, -1 under `apply_seq_ids_mask`, write nothing (see
`nxdi.core.host.forward_inputs`).

(Over 400 lines: forward()'s checks, routing, batching and output assembly are one documented
contract, each step a short method; the block-KV calls and async_mode already live apart.)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import Tensor

from nxdi.core import sampling_params as sampling_params_core
from nxdi.core.config.neuron_spec import Phase
from nxdi.core.host import async_steps, batching, forward_inputs
from nxdi.core.planning import block_programs, buckets
from nxdi.core.planning import medusa as medusa_plan
from nxdi.core.planning.block_programs import BlockPlan
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs import medusa, moe_settings
from nxdi.core.programs.inputs import StepInputs
from nxdi.effects.runtime import StepRuntime
from nxdi.shell import block_forward, fused_speculation, lora_serving
from nxdi.shell.application import NeuronApplicationBase
from nxdi.shell.async_forward import AsyncForward, AsyncStats
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap


def prepare_sampling_params(
    batch_size: int,
    top_k: float | list[float] | Tensor = (1,),  # type: ignore[assignment]
    top_p: float | list[float] | Tensor = (1.0,),  # type: ignore[assignment]
    temperature: float | list[float] | Tensor = (1.0,),  # type: ignore[assignment]
) -> Tensor:
    """The [batch_size, 3] float tensor of (top_k, top_p, temperature) rows; length-1 lists broadcast.

    Raises:
        IncompatibleConfigError: lists whose lengths are neither 1 nor batch_size.
    """

    def as_list(v: Any) -> Any:
        return v.flatten().tolist() if isinstance(v, Tensor) else list(v) if isinstance(v, (list, tuple)) else v

    rows = sampling_params_core.prepare_sampling_params(
        batch_size, top_k=as_list(top_k), top_p=as_list(top_p), temperature=as_list(temperature)
    )
    return torch.tensor(unwrap(rows, "Invalid sampling parameters"), dtype=torch.float32)


class CausalLMOutput(dict):  # type: ignore[type-arg]
    """What `forward` returns: `logits`, `hidden_states` and `tokens`, as attributes and keys
    (the shape of transformers' CausalLMOutputWithPast that NxDI returns), and a mixture of
    experts' `router_logits` and `expert_index` (transformers' MoeCausalLMOutputWithPast)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class NeuronBaseForCausalLM(NeuronApplicationBase):
    """A causal language model: context encoding plus token generation over a KV cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cached = [0] * self.spec.kv_cache_batch_size
        """Tokens each KV cache row holds (what forward() checks positions against)."""
        self._blocks_used = False
        """With the block layout: whether a call ran since the last reset (the client owns the blocks)."""
        self._tables = {
            Phase.CONTEXT: unwrap(buckets.context_table_for(self.spec)),
            Phase.TOKEN: unwrap(buckets.token_table_for(self.spec)),
        }
        if self.spec.is_medusa:  # the tree steps (nxdi.shell.medusa)
            self._tables[Phase.SPECULATION] = unwrap(medusa_plan.tree_table_for(self.spec))
        elif self.spec.speculation_length > 0:
            self._tables[Phase.SPECULATION] = unwrap(buckets.speculation_table_for(self.spec))
        self._async: AsyncForward | None = None
        """With async_mode (when the runtime was opened): the worker thread that runs every step, and
        the decode step launched ahead; closed with the runtime."""

    @property
    def context_capacity(self) -> int:
        """The most prompt tokens a context-encoding call keeps: the largest context bucket. Longer
        prompts are refused, or cut to their first `context_capacity` tokens with allow_input_truncation."""
        return self._tables[Phase.CONTEXT].largest

    @property
    def kv_cache_populated(self) -> bool:
        """Whether some KV cache row holds a sequence (a prompt was encoded since the last reset)."""
        return self._blocks_used or any(self._cached)

    def reset(self) -> None:
        """Start a new batch: the next call must encode prompts (no row holds anything to decode from)."""
        self._settle()
        self._cached = [0] * len(self._cached)
        self._blocks_used = False

    def add_adapter(self, adapter_id: str, path: str) -> None:
        """Dynamic multi-LoRA: read the adapter at `path` (a PEFT folder or NxD checkpoint file), check
        it and keep it in host memory as `adapter_id` (NxDI's `add_adapter`); it goes to a device slot
        when a forward first names it. The next free adapter index is its index.

        Raises:
            IncompatibleConfigError: the model is not built with dynamic_multi_lora, the id is taken,
                or max_cpu_loras adapters are loaded.
            CheckpointValidationError: every problem of the adapter; nothing changes.
        """
        self._require_dynamic("add_adapter").add_adapter(adapter_id, path)

    def remove_adapter(self, adapter_id: str) -> None:
        """Dynamic multi-LoRA: drop `adapter_id` from host memory and its device slot (NxDI's `remove_adapter`).

        Raises:
            IncompatibleConfigError: the model is not built with dynamic_multi_lora, or no adapter has that id.
        """
        self._require_dynamic("remove_adapter").remove_adapter(adapter_id)

    @property
    def lora_device_adapters(self) -> tuple[str | None, ...]:
        """Dynamic multi-LoRA: the adapter id in each device slot the eviction policy manages
        (None: free), slot order, the base model's slot apart.

        Raises:
            IncompatibleConfigError: the model is not built with dynamic_multi_lora, or not loaded.
        """
        return self._require_dynamic("lora_device_adapters").state.slots

    def adapter_indices(self, adapter_ids: Any, batch: int) -> Tensor | None:
        """Each row's adapter index [batch] int64 for adapter names or indices (NxDI's
        `convert_adapter_ids_to_indices`); None on a model without lora_config given None.

        Raises:
            IncompatibleConfigError: as `forward` for adapter_ids.
        """
        if self._lora_dynamic is not None:
            return self._lora_dynamic.indices(adapter_ids, batch)
        return lora_serving.adapter_slots(self.spec, adapter_ids, batch)

    def _require_dynamic(self, what: str) -> Any:
        if self._lora_dynamic is None:
            raise IncompatibleConfigError(
                f"{what}: this model does not swap adapters at run time. Fix: build it with "
                "lora_config=LoraServingConfig(dynamic_multi_lora=True, ...)"
            )
        if self._runtime is None:
            raise IncompatibleConfigError(f"{what}: the model is not loaded. Fix: call load() or to_cpu() first")
        return self._lora_dynamic

    def _adapter_slots(self, runtime: StepRuntime, adapter_ids: Any, batch: int) -> Tensor | None:
        """Each row's device slot: the adapter index itself (static), or where the eviction policy
        placed it after swapping in what was missing (dynamic_multi_lora)."""
        if self._lora_dynamic is None:
            return lora_serving.adapter_slots(self.spec, adapter_ids, batch)
        return self._lora_dynamic.slots_for(runtime, adapter_ids, batch)

    def reset_kv_cache(self) -> None:
        """Zero the KV cache."""
        runtime = self._require_runtime()
        if self._async is not None:
            self._async.execute(runtime.reset_cache)
        else:
            runtime.reset_cache()
        self.reset()

    def set_seed(self, seed: int) -> None:
        self._settle()  # a step launched ahead drew from the old stream
        super().set_seed(seed)

    def close(self) -> None:
        pipelined, self._async = getattr(self, "_async", None), None  # close() may run from a failed __init__
        if pipelined is not None:
            pipelined.close()
        super().close()

    @property
    def async_stats(self) -> AsyncStats | None:
        """With async_mode: how many decode steps were launched ahead, used and discarded, and how
        long calls waited for them, since load (None without async_mode, or before load)."""
        return None if self._async is None else self._async.stats

    def _settle(self) -> None:
        if self._async is not None:
            self._async.settle()

    def _open(self, *args: Any, **kwargs: Any) -> None:
        super()._open(*args, **kwargs)
        self.reset()  # a new runtime starts with an empty cache

    def _start_runtime(self, *args: Any, **kwargs: Any) -> StepRuntime:
        if not self.spec.async_mode:
            return super()._start_runtime(*args, **kwargs)
        # The model's worker thread loads and warms up what it will run (nxdi.shell.async_forward).
        self._async = AsyncForward(
            self._forward_now, snapshot=self._snapshot, restore=self._restore, predict=self._next_call
        )
        try:
            return self._async.execute(super()._start_runtime, *args, **kwargs)
        except BaseException:
            self._async.close()
            self._async = None
            raise

    def check_token_generation(self, caller: str) -> None:
        """Refuse `caller`, which needs a token-generation program, on a model compiled without
        them (trace_tokengen_model=False: a speculation target decodes only in k-token steps).

        Raises:
            IncompatibleConfigError: naming trace_tokengen_model and the fixes.
        """
        if self.spec.trace_tokengen_model:
            return
        k = self.spec.speculation_length
        raise IncompatibleConfigError(
            f"{caller} needs a token-generation program, and this model has none: it was built with "
            f"trace_tokengen_model=False (a speculation target, which decodes only in speculation steps of "
            f"speculation_length={k} tokens per row). Fix: decode with a draft model "
            "(generate(..., assistant_model=draft)), pass exactly speculation_length tokens per row, or build "
            "the model with trace_tokengen_model=True"
        )

    def _limits(self) -> forward_inputs.Limits:
        return forward_inputs.Limits(
            vocab_size=self.model_spec.vocab_size,
            cache_rows=self.spec.kv_cache_batch_size,
            max_length=self.spec.max_length,
            garbage_rows=self.spec.kv_cache_padding_size,
            mask_seq_ids=self.spec.apply_seq_ids_mask,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> CausalLMOutput:
        return self.forward(*args, **kwargs)

    def forward(
        self,
        input_ids: Tensor | None = None,
        seq_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        sampling_params: Tensor | None = None,
        prev_hidden: Tensor | None = None,
        adapter_ids: Tensor | None = None,
        slot_mapping: Tensor | None = None,
        block_table: Tensor | None = None,
        full_context_lens: Tensor | None = None,
        computed_context_lens: Tensor | None = None,
        **unsupported: Any,
    ) -> CausalLMOutput:
        """Run one step for every row.

        Args:
            input_ids: [B, W] token ids (prompt, or one new token per row).
            seq_ids: [B] the KV-cache row of each batch row (default 0..B-1).
            attention_mask: [B, W] 1 for real tokens (any padding side); inferred from position_ids.
            position_ids: [B, W] positions; inferred from attention_mask (cumsum - 1).
            sampling_params: [B, 3] (top_k, top_p, temperature), used with on-device sampling.
            prev_hidden: accepted as None (what a client passes without speculation); a value is
                refused, since this engine does not run it.
            adapter_ids: [B] each row's LoRA adapter with `lora_config`: NxDI's adapter indices (or
                adapter names), 0 the base model with enable_base_model_only (see
                `nxdi.shell.lora_serving.adapter_slots`); None there means base-model rows. With
                dynamic_multi_lora the rows' adapters are swapped into device slots first
                (`nxdi.shell.lora_dynamic`).
            slot_mapping, block_table, full_context_lens, computed_context_lens: with
                `is_block_kv_layout`, where each sequence lives in the block cache (see
                `nxdi.shell.block_forward`); refused without it.

        Returns:
            `logits` [B, 1, V] fp32 (None under on-device sampling unless output_logits),
            `tokens` [B] sampled ids under on-device sampling (else the logits, as NxDI does),
            and `hidden_states` (the same tensor as `tokens`). A mixture of experts whose
            MoENeuronConfig sets return_router_logits / return_expert_index also gives
            `router_logits` (one [B*W, X] fp32 tensor per layer, transformers'
            `output_router_logits=True`) / `expert_index` (one [B*W, k] int64 per layer, the
            chosen experts, best first), a row per token of `input_ids` [B, W] in its order; a
            prompt's padding columns (and tokens cut by allow_input_truncation) hold 0.0 / -1.
            With `is_block_kv_layout` the same per token of `input_ids` (logits and tokens come
            per request): a token the call does not compute holds 0.0 / -1 (padding, and a
            prefill row's cached prefix before its `computed_context_lens`, even where the
            program computes some of it again); in chunked prefill `input_ids` is [1, T], so
            each layer's tensor is [T, X], every row a request's token. Both are None otherwise.
            With enable_fused_speculation: NxDI's `fused_outputs` (`nxdi.shell.fused_speculation`).
            A Medusa model (is_medusa=True) also gives `medusa_tokens` [B, H, K]: each head's K
            best tokens (best first) at each row's last token, the next tree's candidates
            (NxD's `medusa_tokens`; its tree steps run through `nxdi.shell.medusa`).

        Raises:
            IncompatibleConfigError: before anything runs, listing every problem: inputs that are not
                integer tensors of consistent shapes, ids outside the vocabulary, a mask other than 0/1,
                positions that disagree with the KV cache (see `nxdi.core.host.forward_inputs`), a
                prompt longer than max_context_length without allow_input_truncation, a position past
                max_length, bad sampling params, or seq_ids out of range or duplicate (without
                kv_cache_padding_size) or negative (without it or, for -1, apply_seq_ids_mask); adapter_ids
                naming no loaded adapter, more distinct adapters than max_loras (dynamic_multi_lora),
                or given without lora_config; or a
                decode call other than a speculation step on a model built with trace_tokengen_model=False.

        Warns:
            UserWarning: a prompt is cut to max_context_length (allow_input_truncation=True).
        """
        given = sorted(k for k, v in unsupported.items() if v is not None and k not in _IGNORED)
        if given:
            images = " (nxdi runs a multimodal model's language model only: text in, text out)"
            note = images if "pixel_values" in given else ""
            raise TypeError(f"forward() does not support {', '.join(given)} on the CPU backend{note}")
        call = {
            "input_ids": input_ids,
            "seq_ids": seq_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "sampling_params": sampling_params,
            "prev_hidden": prev_hidden,
            "adapter_ids": adapter_ids,
            "slot_mapping": slot_mapping,
            "block_table": block_table,
            "full_context_lens": full_context_lens,
            "computed_context_lens": computed_context_lens,
        }
        if self._async is None:
            return self._forward_now(call)
        return self._async(call)

    def _forward_now(self, call: dict[str, Any]) -> CausalLMOutput:
        """One synchronous forward() call (`call`: the arguments as `forward` names them)."""
        if call["input_ids"] is None:
            raise TypeError("forward() needs input_ids")
        if call["prev_hidden"] is not None:
            what = "prev_hidden (speculation)"
            raise IncompatibleConfigError(f"forward() got {what}, which this engine does not run yet; pass None")
        if self.spec.lora_config is None:  # refuses adapter_ids on every path, the block one included
            lora_serving.adapter_slots(self.spec, call["adapter_ids"], 0)
        block_args = {name: call[name] for name in _BLOCK_ARGS}
        runtime = self._require_runtime()
        if self.spec.is_block_kv_layout:
            plan = self._block_plan()
            logits, tokens, extras = block_forward.run(
                self,
                runtime,
                plan,
                input_ids=call["input_ids"],
                position_ids=call["position_ids"],
                attention_mask=call["attention_mask"],
                sampling_params=call["sampling_params"],
                **block_args,
            )
            self._blocks_used = True
            return self._output(logits, tokens, extras)
        passed = sorted(k for k, v in block_args.items() if v is not None)
        if passed:
            raise IncompatibleConfigError(
                f"forward() got {', '.join(passed)}, which only a block KV cache uses: set is_block_kv_layout=True"
            )
        checked = unwrap(
            forward_inputs.check_forward_inputs(
                call["input_ids"],
                call["attention_mask"],
                call["position_ids"],
                call["seq_ids"],
                limits=self._limits(),
                cached=self._cached,
            ),
            "Invalid forward() inputs",
        )
        ids, rows = checked.input_ids, checked.cache_rows
        params = self._sampling_rows(call["sampling_params"], ids.shape[0])
        slots = self._adapter_slots(runtime, call["adapter_ids"], ids.shape[0])
        if self._fused is not None:  # the draft and this model in one program (nxdi.shell.fused_speculation)
            fields, holds = self._fused.forward(runtime, checked, params)
            self._cached = [holds.get(row, n) for row, n in enumerate(self._cached)]
            return CausalLMOutput(
                attentions=None, past_key_values=None, router_logits=None, expert_index=None, **fields
            )
        if checked.phase is Phase.CONTEXT:
            logits, tokens, extras = self._context(runtime, ids, checked.attention_mask, rows, params, slots)
        elif ids.shape[1] == self.spec.speculation_length > 1:  # NxD's rule: the speculation model
            logits, tokens, extras = self._speculate(runtime, ids, checked.position_ids, rows, params)
        else:
            self.check_token_generation(f"forward() with {ids.shape[1]} token(s) per row at positions >= 1")
            logits, tokens, extras = self._token(runtime, ids, checked.position_ids, rows, params, slots)
        for row, held in checked.cached_after(self.context_capacity).items():
            self._cached[row] = held
        return self._output(logits, tokens, extras)

    # --- async_mode (nxdi.shell.async_forward) ---------------------------------------------------
    def _snapshot(self) -> Any:
        """What a step changes besides the cache: the rows' token counts and the random stream."""
        return tuple(self._cached), self._blocks_used, self._require_runtime().random.generator.get_state()

    def _restore(self, state: Any) -> None:
        cached, blocks_used, random_state = state
        self._cached = list(cached)
        self._blocks_used = blocks_used
        self._require_runtime().random.generator.set_state(random_state)

    def _next_call(self, call: dict[str, Any], out: CausalLMOutput) -> dict[str, Any] | None:
        if self._fused is not None:
            return fused_speculation.next_call(call, out, max_length=self.spec.max_length)
        tokens = out.tokens if self.spec.on_device_sampling_config is not None else None
        block = self.spec.is_block_kv_layout
        return async_steps.next_decode(
            call,
            tokens,
            max_length=self.spec.max_length,
            block_size=self.spec.pa_block_size if block else None,
            chunked=block and self.spec.chunked_prefill_config is not None,
        )

    def _output(self, logits: Tensor | None, tokens: Tensor | None, extras: dict[str, Tensor]) -> CausalLMOutput:
        """The output value; `extras` [L, B, W, ...] become one [B*W, ...] tensor per layer."""
        ods = self.spec.on_device_sampling_config is not None
        shown = tokens if ods else logits
        routing = {
            name: None if name not in extras else tuple(t.reshape(-1, *t.shape[2:]) for t in extras[name])
            for name in (moe_settings.ROUTER_LOGITS, moe_settings.EXPERT_INDEX)
        }
        more = {medusa.MEDUSA_TOKENS: extras.get(medusa.MEDUSA_TOKENS)} if self.spec.is_medusa else {}
        return CausalLMOutput(
            logits=logits, hidden_states=shown, tokens=shown, attentions=None, past_key_values=None, **routing, **more
        )

    def _block_plan(self) -> BlockPlan:
        return unwrap(block_programs.block_plan(self.spec), "Invalid block KV buckets")

    # --- host-side preparation ----------------------------------------------------------------
    def _sampling_rows(self, given: Tensor | None, batch: int) -> Tensor:
        ods = self.spec.on_device_sampling_config
        if given is None or ods is None:
            # Without on-device sampling the programs ignore sampling_params (the host samples from
            # the logits, with any top_k), so they are not checked either, as in NxDI.
            row = (ods.top_k, ods.top_p, ods.temperature) if ods is not None else (1, 1.0, 1.0)
            return torch.tensor([row] * batch, dtype=torch.float32)
        rows = torch.as_tensor(given, dtype=torch.float32)
        topk = ods.global_topk if ods is not None else 256
        checked = unwrap(sampling_params_core.validate_sampling_params(rows.tolist(), topk), "Invalid sampling_params")
        if len(checked) != batch:
            raise IncompatibleConfigError(f"sampling_params: has {len(checked)} rows for a batch of {batch}")
        return torch.tensor(sampling_params_core.infer_sampling_params(checked), dtype=torch.float32)

    def _context(
        self, runtime: StepRuntime, ids: Tensor, mask: Tensor, rows: Tensor, params: Tensor, slots: Tensor | None
    ) -> _Outputs:
        """Encode the prompts `ids` [B, W] (`mask`: their real tokens; `slots` [B]: their LoRA
        adapters, with lora_config); the extras come back in the caller's columns, [L, B, W, ...],
        padding columns (and tokens cut by truncation) filled."""
        compacted, lengths = batching.compact(ids, mask)
        bucket = unwrap(
            buckets.select_bucket(
                self._tables[Phase.CONTEXT],
                int(lengths.max()),
                allow_input_truncation=self.spec.allow_input_truncation,
            ),
            f"Prompt longer than max_context_length={self.spec.max_context_length}",
        )
        longest = int(lengths.max())
        if longest > bucket:
            # As the reference: truncation is allowed, but never silent.
            warnings.warn(
                f"input length {longest} exceeds max_context_length={self.spec.max_context_length} (the largest "
                f"context_encoding bucket holds {bucket}); allow_input_truncation=True keeps each prompt's first "
                f"{bucket} tokens",
                UserWarning,
                stacklevel=3,
            )
        pad = self.model_spec.pad_token_id or 0
        x = dataclasses.replace(
            batching.context_inputs(compacted, lengths, bucket=bucket, pad_token_id=pad), adapter_ids=slots
        )
        logits, tokens, extras = self._run_batched(runtime, Phase.CONTEXT, bucket, x, rows, params)
        fills = moe_settings.FILL
        return (
            logits,
            tokens,
            {
                n: t if n in medusa.ROW_OUTPUTS else batching.uncompact(t, mask, fill=fills.get(n, 0))
                for n, t in extras.items()
            },
        )

    def _token(
        self, runtime: StepRuntime, ids: Tensor, positions: Tensor, rows: Tensor, params: Tensor, slots: Tensor | None
    ) -> _Outputs:
        """Decode `ids` [B, W] at `positions` [B, W] (`slots` [B]: the rows' LoRA adapters, with
        lora_config): W token-generation steps, one column each (a row continuing from a cached
        prefix); the logits and tokens are the last step's, the extras every step's, [L, B, W, ...]."""
        logits, tokens, steps = None, None, []
        for col in range(ids.shape[1]):
            at = positions[:, col : col + 1]
            bucket = unwrap(buckets.select_bucket(self._tables[Phase.TOKEN], int(at.max()) + 1))
            last = torch.zeros(ids.shape[0], dtype=torch.int64)
            x = StepInputs(input_ids=ids[:, col : col + 1], position_ids=at, last_index=last, adapter_ids=slots)
            logits, tokens, extras = self._run_batched(runtime, Phase.TOKEN, bucket, x, rows, params)
            steps.append(extras)
        last = steps[-1]  # a per-row output (Medusa's) is the last step's
        return (
            logits,
            tokens,
            {n: last[n] if n in medusa.ROW_OUTPUTS else torch.cat([e[n] for e in steps], dim=2) for n in steps[0]},
        )

    def _speculate(
        self, runtime: StepRuntime, ids: Tensor, positions: Tensor, rows: Tensor, params: Tensor
    ) -> _Outputs:
        """Score `ids` [B, k] at `positions` [B, k] (a row's last accepted token and the k-1 draft
        tokens after it) in one speculation step: logits [B, k, V] (tokens [B, k] with on-device
        sampling, one per position), the extras [L, B, k, ...]."""
        bucket = unwrap(buckets.select_bucket(self._tables[Phase.SPECULATION], int(positions[:, 0].max())))
        last = torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.int64)
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=last)
        return self._run_batched(runtime, Phase.SPECULATION, bucket, x, rows, params)

    def _run_batched(
        self,
        runtime: StepRuntime,
        phase: Phase,
        bucket: int,
        x: StepInputs,
        rows: Tensor,
        params: Tensor,
    ) -> _Outputs:
        """Run `x` on the `phase` programs of `bucket`, the batch fitted to their batch sizes
        (`batching.plan_runs`; `rows` [B]: each row's cache row), and restore the caller's order
        (the extras [L, B*S, ...] become [L, B, S, ...])."""
        logits_out: list[tuple[tuple[int, ...], Tensor]] = []
        tokens_out: list[tuple[tuple[int, ...], Tensor]] = []
        extras_out: dict[str, list[tuple[tuple[int, ...], Tensor]]] = {}
        n = len(rows)
        for chunk in batching.plan_runs(rows.tolist(), self._tables[phase].batch_sizes):
            # A chunk of the whole batch as it is (a decode step's usual case) is run and read as it is.
            whole = chunk.carries_all(n)
            source = None if whole else torch.tensor(chunk.source_rows)
            out = runtime.run(
                ProgramKey(phase=phase, length=bucket, batch=chunk.batch, tokens=x.input_ids.shape[1]),
                x if source is None else batching.select_rows(x, source),
                # Padding rows (-1) write nowhere: there may be no unused cache row to give them.
                rows=None if chunk.in_order else torch.tensor(chunk.cache_rows),
                params=params if source is None else params.index_select(0, source),
            )
            take = None if whole else torch.tensor(chunk.output_rows)
            if out.logits is not None:
                logits_out.append((chunk.user_rows, _rows(out.logits, take)))
            if out.tokens is not None:  # [B], or [B*k] from a speculation step: [B, k]
                per_row = out.tokens if phase is not Phase.SPECULATION else out.tokens.reshape(chunk.batch, -1)
                tokens_out.append((chunk.user_rows, _rows(per_row, take)))
            for name, t in out.extras.items():
                if name in medusa.ROW_OUTPUTS:  # [B, ...]
                    extras_out.setdefault(name, []).append((chunk.user_rows, _rows(t, take)))
                    continue
                per_row = t.reshape(t.shape[0], chunk.batch, -1, *t.shape[2:])  # [L, B, S, ...]
                extras_out.setdefault(name, []).append((chunk.user_rows, _rows(per_row, take, dim=1)))
        extras = {
            name: t
            for name, parts in extras_out.items()
            if (t := batching.gather_rows(parts, n, dim=0 if name in medusa.ROW_OUTPUTS else 1)) is not None
        }
        return batching.gather_rows(logits_out, n), batching.gather_rows(tokens_out, n), extras


def _rows(t: Tensor, take: Tensor | None, *, dim: int = 0) -> Tensor:
    """Rows `take` of `t` along `dim` (None: all of them, in order)."""
    return t if take is None else t.index_select(dim, take)


_BLOCK_ARGS = ("slot_mapping", "block_table", "full_context_lens", "computed_context_lens")
"""forward()'s block-KV arguments (used only with is_block_kv_layout)."""

_IGNORED = frozenset({"use_cache", "output_attentions", "output_hidden_states", "return_dict", "past_key_values"})

_Outputs = tuple[Tensor | None, Tensor | None, dict[str, Tensor]]
"""logits, tokens, and the extra outputs by name."""

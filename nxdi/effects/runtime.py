"""The loaded model: the KV cache, and one step program per `ProgramKey` (sub-model, bucket, batch).
Effects: owns and mutates the KV cache tensors, draws random numbers from a seeded generator.

A `Runtime` is what `load()` / `to_cpu()` produce (`nxdi.effects.engine`). It runs a step on a
*view* of the cache (the first `key.length` slots, and the rows the caller names) and writes the
program's updated view back in place, so the cache lives in one set of tensors for the life of the
model. Programs are interchangeable, the eager pure step or whatever a backend compiled from it, as
long as they keep one calling convention, with their weights already bound (see `Program`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs import kv_cache
from nxdi.core.programs.block_kv import BlockInputs
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs

Program = Callable[..., tuple[StepOutputs, KVCache]]
"""(cache view, inputs, params [B, 3], uniforms [B]) -> (outputs, cache view), its weights bound
already; a block-KV program also takes `blocks=` and the whole block cache."""


class RandomStream:
    """The random draws of on-device sampling: one per row and step, from a seeded generator."""

    def __init__(self, *, seed: int = 0, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self.generator = torch.Generator().manual_seed(seed)

    def set_seed(self, seed: int) -> None:
        """Restart the stream (same seed, same draws)."""
        self.generator.manual_seed(seed)

    def draw(self, rows: int) -> Tensor:
        """One draw in [0, 1) per row (0.5 each when deterministic)."""
        if self.deterministic:
            return torch.full((rows,), 0.5)
        return torch.rand(rows, generator=self.generator)


class StepRuntime(Protocol):
    """What the shell drives: a `Runtime` here, or a runtime whose ranks run in other processes."""

    random: RandomStream
    """The draws of on-device sampling (async_mode saves and restores its generator's state)."""

    @property
    def programs(self) -> Mapping[ProgramKey, Any]: ...

    def set_seed(self, seed: int) -> None: ...

    def reset_cache(self) -> None: ...

    def run(
        self,
        key: ProgramKey,
        x: StepInputs,
        *,
        rows: Tensor | None,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs: ...

    def run_blocks(
        self,
        key: ProgramKey,
        x: StepInputs,
        blocks: BlockInputs,
        *,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs: ...

    def write_lora_slots(self, writes: LoraWrites) -> None: ...

    def close(self) -> None: ...


LoraWrites = Sequence[tuple[int, Mapping[str, Tensor]]]
"""Dynamic multi-LoRA swaps: (device slot, one adapter's matrices as one slot of every stacked
tensor, by name: `nxdi.core.programs.lora.slot_tensors`), in order."""


class Runtime:
    """The KV cache and the step programs of a loaded model."""

    def __init__(
        self,
        *,
        cache: KVCache,
        programs: Mapping[ProgramKey, Program],
        weights: Any = None,
        seed: int = 0,
        deterministic: bool = False,
        kv_group: int = 1,
        finish: Callable[[Sequence[Tensor | None]], tuple[Tensor | None, ...]] | None = None,
        lead: int = 0,
        lora_writer: Callable[[Any, LoraWrites], None] | None = None,
    ) -> None:
        self.weights = weights
        self.lora_writer = lora_writer
        """Writes adapters into the stacked adapter weights in place (a multi-LoRA model's)."""
        """The program's weights value the programs were built from (for inspection; a compiled
        program runs on the backend's bound copies)."""
        self.cache = cache
        self._views: tuple[KVCache | None, dict[tuple[int, int], KVCache]] = (None, {})
        """The cache the views were made of, and its slices per (bucket, batch) (`_view`)."""
        self.programs = dict(programs)
        self.random = RandomStream(seed=seed, deterministic=deterministic)
        self.kv_group = kv_group
        """With flash decoding, the ranks sharing a KV head: a bucket of T positions is the first
        ceil(T / kv_group) cache slots of this rank."""
        self.lead = lead
        """Leading dims of every cache tensor before its rows (1 when one process holds every
        rank's cache, `[ranks, R, K, T, D]`: tensor parallelism on XLA)."""
        self.finish = finish or tuple
        """Ends a step (the backend's `finish`): runs deferred work, returns the outputs on the host."""
        self.device = cache.k[0].device
        """Where the cache lives: the host, or a backend's device (XLA), where every step must
        keep static shapes, so cache rows are chosen without reading `rows` on the host."""
        if self.device.type != "cpu":
            # A deferring backend materializes the fresh cache now, not inside the first step, and
            # as what every later reset makes of it: SPMD XLA compiles a step again for a cache
            # that comes from another graph, so warm-up would otherwise not cover generation.
            self.reset_cache()

    def write_lora_slots(self, writes: LoraWrites) -> None:
        """Copy each adapter into its device slot of the weights the programs run on (this rank's
        slices of them under tensor parallelism)."""
        assert self.lora_writer is not None, "only a multi-LoRA model's runtime takes adapter writes"
        self.lora_writer(self.weights, writes)

    def set_seed(self, seed: int) -> None:
        """Restart the sampling random stream (same seed, same draws)."""
        self.random.set_seed(seed)

    def _mode(self) -> Any:
        """The autograd mode of cache work: none on the host; on a device, plain no-grad even under
        the caller's `torch.inference_mode()`, since the device cache was made outside it (XLA
        cannot take views of a normal tensor in inference mode)."""
        if self.device.type == "cpu":
            return contextlib.nullcontext()
        return _NoGradOutsideInference()

    def reset_cache(self) -> None:
        """Zero every key and value (NxDI's reset_kv_cache)."""
        with self._mode():
            for t in (*self.cache.k, *self.cache.v):
                t.zero_()
            self.finish(())

    def close(self) -> None:
        """Nothing to stop: the programs run in this process."""

    def run(
        self,
        key: ProgramKey,
        x: StepInputs,
        *,
        rows: Tensor | None,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs:
        """Run the program `key` on cache rows `rows` (None: rows 0..B-1 in order).

        Args:
            x: inputs [B, S], B = `key.batch` and S = `key.tokens` (the bucket in context
                encoding, 1 in token generation).
            rows: [B] cache rows (seq_ids) the batch rows read and write. -1 marks a padding row:
                it reads some row and writes nothing, so padding never clobbers another
                sequence's cache (there may be no unused row to give it). A row may be named
                twice (garbage rows): one of its writers' values is kept.
            params: [B, 3] sampling parameters.
            uniforms: [B] random draws for sampling (default: drawn from this runtime's stream;
                ranks of one model are all given the driver's, so they sample alike).

        Returns:
            The outputs on the host: logits [B, 1, V] fp32 or None, tokens [B] or None, and the
            program's extras (a mixture of experts' routing, [L, B*S, ...]).
        """
        draws = self.random.draw(x.input_ids.shape[0]) if uniforms is None else uniforms
        with self._mode():
            outs = self._step(self.programs[key], key.length, x, rows, params, draws)
            # Nothing else of the step is referenced any more, so finishing it (an XLA execution)
            # computes only the outputs and the cache, whose buffers it then updates in place.
            return self._finish(outs)

    def run_blocks(
        self,
        key: ProgramKey,
        x: StepInputs,
        blocks: BlockInputs,
        *,
        params: Tensor,
        uniforms: Tensor | None = None,
    ) -> StepOutputs:
        """Run the block-KV program `key` on the whole block cache (`nxdi.core.programs.block_kv`):
        the program reads and writes where `blocks` says, and its cache replaces this one (the
        same tensors when a compiled program writes in place).

        Args:
            x: inputs [B, S] (B = `key.batch`, S = `key.tokens`).
            blocks: slots, block tables, prefixes, segments and output tokens of the rows.
            params: [B*R, 3] sampling parameters, one row per segment; `uniforms` [B*R] likewise.

        Returns:
            The outputs on the host: logits [B, R, V] fp32 or None, tokens [B*R] or None, and the
            program's extras.
        """
        draws = self.random.draw(params.shape[0]) if uniforms is None else uniforms
        with self._mode():
            outs, updated = self.programs[key](self.cache, x, params, draws, blocks=blocks)
            self.cache = KVCache(k=tuple(updated.k), v=tuple(updated.v))
            return self._finish(outs)

    def _finish(self, outs: StepOutputs) -> StepOutputs:
        """End the step (`finish`): every output on the host."""
        named = outs.named()
        return StepOutputs.from_named(dict(zip(named, self.finish(tuple(named.values())), strict=True)))

    def _step(
        self, program: Program, bucket: int, x: StepInputs, rows: Tensor | None, params: Tensor, draws: Tensor
    ) -> StepOutputs:
        """Run `program` on the cache view and write its cache back (still lazy on a deferring backend)."""
        rows = None if rows is None else rows.to(self.device)
        given = self._view(bucket, rows, x.input_ids.shape[0])
        outs, updated = program(given, x, params, draws)
        self._write_back(updated, given, bucket, rows)
        return outs

    def _view(self, bucket: int, rows: Tensor | None, batch: int) -> KVCache:
        bucket = -(-bucket // self.kv_group)
        ranks = (slice(None),) * self.lead
        if rows is not None:
            read = rows.clamp(min=0)  # padding rows (-1) read row 0; their results are discarded
            at = (*ranks, slice(None), slice(None), slice(None, bucket))
            return KVCache(
                k=tuple(t.index_select(self.lead, read)[at] for t in self.cache.k),
                v=tuple(t.index_select(self.lead, read)[at] for t in self.cache.v),
            )
        at = (*ranks, slice(None, batch), slice(None), slice(None, bucket))
        if self.device.type != "cpu":
            return _sliced(self.cache, at)
        # A host cache is written in place, so a bucket's slices stay valid: made once, not
        # 2 x layers slicing dispatches every step.
        held, views = self._views
        if held is not self.cache:
            held, views = self._views = (self.cache, {})
        if (bucket, batch) not in views:
            views[bucket, batch] = _sliced(self.cache, at)
        return views[bucket, batch]

    def _write_back(self, updated: KVCache, given: KVCache, bucket: int, rows: Tensor | None) -> None:
        bucket = -(-bucket // self.kv_group)
        cpu = self.device.type == "cpu"
        tensors = zip((*self.cache.k, *self.cache.v), (*updated.k, *updated.v), (*given.k, *given.v), strict=True)
        for full, part, view in tensors:
            # Given slices of the runtime's tensors (rows None), a program that wrote in place returns
            # them; gathered rows (`rows`) are copies, written back below.
            if cpu and ((rows is None and part is view) or part.data_ptr() == full.data_ptr()):
                continue  # the program wrote the runtime's tensor in place
            if self.device.type != "cpu":
                full.copy_(_updated(full, part, bucket, rows, self.lead))
            elif rows is None:
                full[: part.shape[0], :, :bucket].copy_(part)
            else:
                real = (rows >= 0).nonzero().flatten()  # padding rows (-1) write nothing
                # On the bytes of a float8 cache: CPU torch has no float8 index_copy kernel.
                dst, src = kv_cache.bits(full[:, :, :bucket]), kv_cache.bits(part[real].to(full.dtype))
                dst.index_copy_(0, rows[real], src)


def _sliced(cache: KVCache, at: tuple[slice, ...]) -> KVCache:
    """Every layer's k and v indexed by `at` (views of the runtime's tensors)."""
    return KVCache(k=tuple(t[at] for t in cache.k), v=tuple(t[at] for t in cache.v))


def _updated(full: Tensor, part: Tensor, bucket: int, rows: Tensor | None, lead: int) -> Tensor:
    """`full` [*ranks, R, K, T, D] (`lead` rank dims) with the view `part` written back, as a whole
    new tensor: a deferring backend (XLA) donates the cache buffer to a step only when the whole
    tensor is overwritten, not a slice of it, and must not read `rows` on the host."""
    part = part.to(full.dtype)
    row, slot = lead, lead + 2
    if rows is None:
        b = part.shape[row]
        inner = full.narrow(row, 0, b).slice_scatter(part, dim=slot, start=0, end=bucket)
        return full.slice_scatter(inner, dim=row, start=0, end=b)
    blended = _blend_rows(full.narrow(slot, 0, bucket), part, rows, row)
    return full.slice_scatter(blended, dim=slot, start=0, end=bucket)


def _blend_rows(full: Tensor, part: Tensor, rows: Tensor, dim: int) -> Tensor:
    """`full` with row `rows[j]` (along `dim`) replaced by `part`'s row j for every real row (-1:
    padding), in static shapes: which part row lands where is a one-hot match, not a host index.
    A row named twice (a garbage row) takes the last of its part rows."""
    match = rows[None, :] == torch.arange(full.shape[dim], device=rows.device)[:, None]  # [R, B]
    source = (match.long() * torch.arange(rows.shape[0], device=rows.device)[None, :]).amax(1)  # [R]
    shape = [1] * full.dim()
    shape[dim] = full.shape[dim]
    return torch.where(match.any(1).view(shape), part.index_select(dim, source), full)


class _NoGradOutsideInference(contextlib.ExitStack):
    """`torch.inference_mode(False)` and `torch.no_grad()` together."""

    def __enter__(self) -> _NoGradOutsideInference:
        super().__enter__()
        self.enter_context(torch.inference_mode(False))
        self.enter_context(torch.no_grad())
        return self

"""Fused speculation in the documented API: `enable_fused_speculation=True` with
`config.fused_spec_config = FusedSpecNeuronConfig(Cls._model_cls, draft_config=..., draft_model_path=...)`.

The draft model and the target run in one compiled program per bucket
(`nxdi.core.programs.fused_speculation`, `nxdi.effects.fused_engine`); `NeuronBaseForCausalLM`
hands its compile, load and forward to a `FusedModel` when the config asks for it.

forward() contract (NxDI's `fused_outputs`, what serving clients and the generate adapter read):
- A call whose smallest position is 0 encodes prompts into both caches; the target picks each
  row's first token. Any other call is a fused step: `input_ids` [B, 1] (each row's last accepted
  token) at `position_ids` [B, 1]; the draft proposes k-1 tokens (k = speculation_length), the
  target verifies them, and each row emits 1..k tokens.
- `output.fused_outputs` is a list (with `token_tree_config`, k below is the tree's depth + 1,
  the most tokens a tree step emits: its longest accepted path below the root, then the target's
  next token; the step itself drafts and scores speculation_length tree nodes):
    [0] accepted tokens [B, k] int64, each row's emitted tokens, then -1 (after context
        encoding: the first token, then -1; so `fused_outputs[0][:, 0]` is the first token);
    [1] next input ids [B, 1]: each row's last emitted token (what the next call feeds);
    [2] next attention mask [B, max_length]: 1 at the positions below the next position;
    [3] next position ids [B, 1]: where the next call feeds [1] (a row's count of emitted
        tokens is [3] minus this call's position; its cache holds every position below [3]);
    [4] with output_logits: the draft's logits, [B, 1, V] (context) or its k steps' [B, k, V];
    [5] with output_logits: the target's logits, [B, 1, V] (context) or [B, k, V], position i
        scoring the token after input i.
  `output.tokens` is [0]; `output.logits` is [5] with output_logits, else None.
- A row never advances past max_length: near the end a step emits at most max_length - p tokens
  (the last one at position max_length, which cannot be fed back); a call at a position >=
  max_length is refused, as for any model.

async_mode: each call launches the call a decode loop makes next (`next_call`): [1] at [3],
without an attention mask, the same seq_ids and sampling_params.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from returns.result import Failure, Result
from torch import Tensor

from nxdi.core import eagle_layout
from nxdi.core import graph_key as graph_keys
from nxdi.core import weight_plan as weight_plans
from nxdi.core.config import cpu_support, fused_checks
from nxdi.core.config.fields import to_json
from nxdi.core.config.fused_checks import DraftSide
from nxdi.core.config.neuron_spec import NeuronSpec, Phase
from nxdi.core.errors import Problem, problems_of
from nxdi.core.families import parse_model_spec, record_for
from nxdi.core.host import batching
from nxdi.core.host.forward_inputs import ForwardInputs
from nxdi.core.planning import buckets, eagle_tree, fused_programs, partition
from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs import catalog, speculation
from nxdi.core.programs import fused_speculation as program
from nxdi.core.programs.inputs import StepInputs
from nxdi.effects import engine, fused_engine
from nxdi.effects import env as env_mod
from nxdi.effects.artifacts import CompileResult
from nxdi.effects.backends.base import Backend
from nxdi.effects.runtime import StepRuntime
from nxdi.shell import inner_model
from nxdi.shell.exceptions import IncompatibleConfigError, unwrap

if TYPE_CHECKING:
    from nxdi.shell.application import NeuronApplicationBase
    from nxdi.shell.inference_config import InferenceConfig

DRAFT_NEURON = f"{fused_checks.DRAFT}.neuron_config"


def check_config(config: InferenceConfig) -> tuple[Problem, ...]:
    """Every problem of a config's fused speculation (`fused_checks.check_fused_pair`), plus what its
    draft config cannot run on the CPU engine (its own settings and architecture, under
    `fused_spec_config.draft_config`). Nothing when the config neither fuses nor names a draft."""
    fused = getattr(config, "fused_spec_config", None)
    spec = config.neuron_config.spec
    if fused is None:
        return fused_checks.check_fused_pair(spec, config.model_spec(), None)
    draft = getattr(fused, "draft_config", None)
    path = getattr(fused, "draft_model_path", None)
    if draft is None or getattr(draft, "neuron_config", None) is None:
        side = DraftSide(path=None if path is None else str(path))
        return fused_checks.check_fused_pair(spec, config.model_spec(), side)
    dspec = draft.neuron_config.spec
    problems: list[Problem] = []
    parsed = parse_model_spec(to_json(draft.hf_dict())).bind(
        lambda m: record_for(m.model_type).bind(lambda r: catalog.program_for(r, m)).map(lambda _: m)
    )
    model = None
    match parsed:
        case Failure(error):
            problems.extend(p.prefixed(fused_checks.DRAFT) for p in error.problems)
        case _:
            model = parsed.unwrap()
            checked = problems_of(partition.check_partition(model, dspec))
            problems.extend(p.prefixed(DRAFT_NEURON) for p in checked)
    side = DraftSide(spec=dspec, model=model, path=None if path is None else str(path))
    pair = fused_checks.check_fused_pair(spec, config.model_spec(), side)
    if not spec.enable_fused_speculation:
        return pair
    # A draft setting copied from the target (the documented way to make the draft's config) is
    # the target's problem, listed once; and the target's runtime settings govern the pair.
    cpu = problems_of(cpu_support.check_cpu_support(dspec))
    own = [p for p in cpu if getattr(dspec, _top(p.field), None) != getattr(spec, _top(p.field), None)]
    if spec.enable_eagle_speculation:  # an EAGLE draft runs here, inside its target's programs
        own = [p for p in own if p.field != "is_eagle_draft"]
    return (*pair, *problems, *(p.prefixed(DRAFT_NEURON) for p in own))


def _top(field: str) -> str:
    """The NeuronSpec field a problem names (`kv_quant_config.x` -> `kv_quant_config`)."""
    return field.split(".")[0]


class FusedModel:
    """The draft side of a fused-speculation model and how the pair runs (one per model object).

    Args:
        model: the target application model, whose config passed `check_config`.
    """

    def __init__(self, model: NeuronApplicationBase) -> None:
        self.target = model
        fused = model.config.fused_spec_config
        assert fused is not None and fused.draft_config is not None, "check_config requires both"
        self.draft_config: InferenceConfig = fused.draft_config
        self.draft_path = str(fused.draft_model_path)
        self.draft_model = self.draft_config.model_spec()
        self.draft_program = inner_model.program_of(self.draft_config)
        self.draft_spec = fused_checks.draft_spec(model.spec, self.draft_config.neuron_config.spec)
        self.draft_plan: weight_plans.WeightPlan = _draft_class(fused, self.draft_model.model_type)._weight_plan(
            self.draft_config, self.draft_spec
        )
        self.k = model.spec.speculation_length
        self.width = eagle_tree.fused_width(model.spec)  # tokens a step emits at most: fused_outputs[0] is [B, width]

    @property
    def spec(self) -> NeuronSpec:
        return self.target.spec

    # --- the engine ------------------------------------------------------------------------------
    def engine_model(self) -> fused_engine.FusedEngineModel:
        draft = engine.EngineModel(program=self.draft_program, model=self.draft_model, spec=self.draft_spec)
        layout = None
        if self.spec.enable_eagle_speculation:  # check_config made sure the draft is an EAGLE draft
            layout = eagle_layout.EagleDraft(
                input_norm=self.draft_spec.enable_eagle_draft_input_norm,
                fc_bias=bool(getattr(self.draft_config, "fc_bias", False)),
            )
        return fused_engine.FusedEngineModel(target=self.target._engine_model(), draft=draft, eagle=layout)

    def source(self, checkpoint: str) -> fused_engine.FusedSource:
        """The target's checkpoint at `checkpoint` (its quantized one with quantized=True) and the
        draft's at draft_model_path, as NxDI reads it: there the draft's quantized modules are
        stored quantized (unless the draft's config names a quantized checkpoint of its own, one
        that is not the target's: a draft config copied from the target's carries the target's)."""
        target = self.target._source(checkpoint)
        path, own = self.draft_path, self.draft_spec.quantized_checkpoints_path
        quantized = any(step.quantized for step in self.draft_plan.steps)
        if quantized and own is not None and own != self.spec.quantized_checkpoints_path:
            path = str(own)
        draft = engine.CheckpointSource(path=path, plan=self.draft_plan, allow_nonfinite=target.allow_nonfinite)
        return fused_engine.FusedSource(target=target, draft=draft)

    def graph_key(self, target_key: str) -> str:
        """The target's graph key with the draft's architecture and settings folded in (an EAGLE
        draft's fc bias too: it is a weight the programs bind)."""
        name = self.draft_program.record.name
        if self.spec.enable_eagle_speculation:
            name += f"/eagle-fc-bias:{bool(getattr(self.draft_config, 'fc_bias', False))}"
        draft = graph_keys.graph_key(self.draft_spec, self.draft_model, extra=name)
        return graph_keys.graph_key(self.spec, self.target.model_spec, extra=f"{target_key}/fused-draft:{draft}")

    def start_runtime(
        self, root: Any, checkpoint: str, *, backend: Backend | None, graph_key: str, warmup: bool
    ) -> Any:
        """Both models' weights and the fused programs: eager when `root` is None, else loaded."""
        model, source = self.engine_model(), self.source(checkpoint)
        if root is None:
            return unwrap(engine.eager_runtime(model, source))
        assert backend is not None
        loaded = engine.load_model(root, model, source, backend=backend, graph_key=graph_key, warmup=warmup)
        return unwrap(loaded)

    def compile_into(
        self, folder: Any, *, backend: Backend, graph_key: str, **kwargs: Any
    ) -> Result[CompileResult, Any]:
        """Compile the fused programs into `folder` (compile()'s build folder; `kwargs`: record, previous)."""
        return engine.compile_model(
            folder,
            self.engine_model(),
            self.source(self.target.model_path),
            backend=backend,
            graph_key=graph_key,
            save_weights=self.spec.save_sharded_checkpoint,
            cache_dir=env_mod.read_env().compile_cache_dir,
            **kwargs,
        )

    def write_shards(self, folder: Any) -> None:
        """Both models' weights into the folder (`shard_weights()`), read from their checkpoints."""
        unwrap(engine.write_shards(folder, self.engine_model(), self.source(self.target.checkpoint_path)))

    def repin(self, folder: Any, checkpoint: str) -> None:
        unwrap(engine.repin_source(folder, self.engine_model(), self.source(checkpoint)))

    # --- forward -----------------------------------------------------------------------------------
    def forward(
        self, runtime: StepRuntime, checked: ForwardInputs, params: Tensor
    ) -> tuple[dict[str, Any], dict[int, int]]:
        """One forward() call (see the module docstring): the output's fields and the tokens each
        cache row holds afterwards (rows sent to a garbage row or masked left out).

        Raises:
            IncompatibleConfigError: a decode call of more than one token per row.
        """
        ids, rows = checked.input_ids, checked.cache_rows
        if checked.phase is Phase.CONTEXT:
            outs, lengths = self._context(runtime, ids, checked.attention_mask, rows, params)
            accepted = torch.full((ids.shape[0], self.width), speculation.PAD, dtype=torch.int64)
            accepted[:, 0] = outs[program.TOKENS]
            counts, next_pos = torch.ones(ids.shape[0], dtype=torch.int64), lengths[:, None]
        else:
            if ids.shape[1] != 1:
                why = (
                    f"a fused-speculation step takes each row's last accepted token ([B, 1]), not {ids.shape[1]} "
                    "tokens: the draft proposes the rest"
                )
                raise IncompatibleConfigError(
                    f"input_ids: {why}. Fix: pass fused_outputs[1] at fused_outputs[3] of the previous call"
                )
            outs = self._step(runtime, ids, checked.position_ids, rows, params)
            accepted, counts = outs[program.TOKENS], outs[program.COUNTS]
            next_pos = checked.position_ids + counts[:, None]
        next_ids = accepted.gather(1, (counts - 1)[:, None])
        mask = (torch.arange(self.spec.max_length)[None, :] < next_pos).to(torch.int64)
        fused: list[Tensor] = [accepted, next_ids, mask, next_pos]
        logits = outs.get(program.LOGITS)
        if self.spec.output_logits:
            fused += [outs[program.DRAFT_LOGITS], outs[program.LOGITS]]
        held = {
            int(s): int(n)
            for s, n, routed in zip(
                checked.seq_ids.tolist(), next_pos[:, 0].tolist(), checked.routed.tolist(), strict=True
            )
            if not routed
        }
        fields = {"logits": logits, "hidden_states": accepted, "tokens": accepted, "fused_outputs": fused}
        return fields, held

    def _context(
        self, runtime: StepRuntime, ids: Tensor, mask: Tensor, rows: Tensor, params: Tensor
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Encode the prompts `ids` [B, W] (`mask`: their real tokens) into both caches: the
        outputs and each row's next position [B] (its prompt's tokens, after truncation)."""
        compacted, lengths = batching.compact(ids, mask)
        table = unwrap(buckets.context_table_for(self.spec))
        longest = int(lengths.max())
        picked = buckets.select_bucket(table, longest, allow_input_truncation=self.spec.allow_input_truncation)
        bucket = unwrap(picked, f"Prompt longer than max_context_length={self.spec.max_context_length}")
        if longest > bucket:
            warnings.warn(
                f"input length {longest} exceeds max_context_length={self.spec.max_context_length}; "
                f"allow_input_truncation=True keeps each prompt's first {bucket} tokens",
                UserWarning,
                stacklevel=4,
            )
        x = batching.context_inputs(
            compacted, lengths, bucket=bucket, pad_token_id=self.target.model_spec.pad_token_id or 0
        )
        uniforms = runtime.random.draw(ids.shape[0])
        outs = _run(runtime, lambda b: ProgramKey.context(bucket, b), x, rows, params, uniforms, table.batch_sizes)
        return outs, lengths.clamp(max=bucket).to(torch.int64)

    def _step(
        self, runtime: StepRuntime, ids: Tensor, positions: Tensor, rows: Tensor, params: Tensor
    ) -> dict[str, Tensor]:
        """One fused step of the rows `ids` [B, 1] at `positions` [B, 1]."""
        length = unwrap(fused_programs.fused_length(self.spec, int(positions.max())))
        b = ids.shape[0]
        x = StepInputs(input_ids=ids, position_ids=positions, last_index=torch.zeros(b, dtype=torch.int64))
        uniforms = runtime.random.draw(b * self.k).reshape(b, self.k)

        def key(batch: int) -> ProgramKey:
            return ProgramKey(phase=Phase.FUSED_SPECULATION, length=length, batch=batch, tokens=1)

        return _run(runtime, key, x, rows, params, uniforms, (self.spec.tkg_batch_size,))


def _run(
    runtime: StepRuntime,
    key: Any,
    x: StepInputs,
    rows: Tensor,
    params: Tensor,
    uniforms: Tensor,
    batch_sizes: tuple[int, ...],
) -> dict[str, Tensor]:
    """Run `x` on the programs `key(batch)`, the batch fitted to `batch_sizes` (`batching.plan_runs`,
    padding rows repeat a real one and write nothing), every output back in the caller's row order
    (each output's dim 0 is the batch)."""
    parts: dict[str, list[tuple[tuple[int, ...], Tensor]]] = {}
    for chunk in batching.plan_runs(rows.tolist(), batch_sizes):
        source = torch.tensor(chunk.source_rows)
        out = runtime.run(
            key(chunk.batch),
            batching.select_rows(x, source),
            rows=None if chunk.in_order else torch.tensor(chunk.cache_rows),
            params=params.index_select(0, source),
            uniforms=uniforms.index_select(0, source),
        )
        take = torch.tensor(chunk.output_rows)
        for name, t in out.named().items():
            parts.setdefault(name, []).append((tuple(chunk.user_rows), t.index_select(0, take)))
    gathered = {name: batching.gather_rows(p, len(rows)) for name, p in parts.items()}
    return {name: t for name, t in gathered.items() if t is not None}


def next_call(call: dict[str, Any], out: Any, *, max_length: int) -> dict[str, Any] | None:
    """async_mode: the call a decode loop makes after `call` returned `out` (its fused_outputs' next
    ids at their next positions, no attention mask, the rest as is), or None when a row cannot go
    on (its next position is max_length)."""
    fused = out.get("fused_outputs") if isinstance(out, dict) else None
    given = call.get("input_ids")
    if fused is None or not isinstance(given, Tensor):
        return None
    next_ids, next_pos = fused[1], fused[3]
    if int(next_pos.max()) >= max_length:
        return None
    predicted = {name: value.clone() if isinstance(value, Tensor) else value for name, value in call.items()}
    predicted["input_ids"] = next_ids.to(given.dtype, copy=True)
    positions = call.get("position_ids")
    predicted["position_ids"] = next_pos.to(
        positions.dtype if isinstance(positions, Tensor) else torch.int64, copy=True
    )
    predicted["attention_mask"] = None
    return predicted


def _draft_class(fused: Any, model_type: str) -> Any:
    """The application class whose weight plan converts the draft's checkpoint: `draft_model_cls`
    when the fused config names one, else the draft family's causal LM."""
    named = getattr(fused, "draft_model_cls", None)
    if hasattr(named, "_weight_plan"):
        return named
    from nxdi.shell import models  # the family classes import this module's importers

    return models.model_types()[model_type]["causal-lm"]

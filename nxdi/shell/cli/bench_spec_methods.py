"""The methods `nxdi bench generate --speculation METHOD` measures, and the sides they run.

A method is a builder `(Workspace) -> Sides`: from the trained target and draft it builds nxdi's
speculative decoder (b) and, when transformers has one, transformers' own counterpart (c); the
command adds the plain decoders (a) nxdi greedy and (d) transformers greedy (`nxdi_plain`,
`hf_plain`) and measures them all alike (`nxdi.shell.cli.bench_speculation`). The draft is the
trained pair's draft model, or, for a method with a `trainer`, what that trains from the target
once per run (`nxdi.shell.cli.bench_spec_trainers`: Medusa heads, an EAGLE draft). Adding a
method is one builder and one entry in `METHODS`; its name becomes a `--speculation` choice.
The methods: `draft` (a separate draft model), `fused` (the same draft inside the target's fused
programs), `medusa` (heads on the target, a token tree per step) and `eagle` (an EAGLE draft,
fused). Heavy libraries are imported inside the functions: this module is imported whenever the
`nxdi` parser is built.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from nxdi.shell.cli import bench_spec_trainers


@attrs.frozen(kw_only=True, eq=False)
class Run:
    """One generation: the new tokens [B, N] and the counts behind its rates."""

    tokens: Any
    target_calls: int
    proposed: int = 0
    accepted: int = 0


@attrs.frozen(kw_only=True, eq=False)
class Side:
    """One decoder the bench measures: `generate(ids [B, P], new_tokens) -> Run`."""

    label: str
    generate: Callable[[Any, int], Run]


@attrs.frozen(kw_only=True, eq=False)
class Workspace:
    """What a method's builder gets: the options, the batch, the trained pair and a folder."""

    args: argparse.Namespace
    batch: int
    target: Any
    """`nxdi.testing.training.TrainedModel` of the target (path, transformers model)."""
    draft: Any
    """The trained draft (`TrainedModel`): the pair's draft model, or what the method's `trainer`
    trained (for `medusa` its path is the target's checkpoint with the heads)."""
    folder: Path
    """Where to compile (a temporary folder)."""


@attrs.frozen(kw_only=True, eq=False)
class Sides:
    """A method's sides: nxdi's, and transformers' counterpart (None when it has none); the nxdi
    models' compile reports; `close` releases them."""

    nxdi: Side
    transformers: Side | None
    compiled: Mapping[str, Mapping[str, float]]
    close: Callable[[], None]
    no_counterpart: str = "transformers' assisted generation runs batch 1 only"
    """Why `transformers` is None (reported as "not measured")."""


@attrs.frozen(kw_only=True, eq=False)
class Method:
    """A `--speculation` choice."""

    summary: str
    build: Callable[[Workspace], Sides]
    trainer: Callable[[Any, Path, argparse.Namespace], Any] | None = None
    """`(trained target, folder, options) -> TrainedModel`: the draft the method trains from the
    target; None: the trained pair's draft model."""
    draft_name: str = "draft"
    """What the report calls the draft."""
    uses_k: bool = True
    """Whether `--speculation-length` (k) applies (Medusa's tree sets its own step)."""


# --- nxdi models ------------------------------------------------------------------------------


def load_nxdi(
    path: Path,
    folder: Path,
    args: argparse.Namespace,
    *,
    fused_draft: Path | None = None,
    eagle: bool = False,
    **neuron: Any,
) -> tuple[Any, dict[str, float]]:
    """The checkpoint at `path` compiled into `folder` (CPU backend) with `neuron` settings (over
    the bench's context length, seq_len and dtype) and loaded, and its compile report (programs,
    compile seconds). With `fused_draft`, the documented fused speculation: the draft at that path
    (an EAGLE draft folder with `eagle`) under a copy of the target's NeuronConfig with
    enable_fused_speculation=False (and is_eagle_draft=True), given as `fused_spec_config`."""
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import FusedSpecNeuronConfig, load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES

    cls = MODEL_TYPES["llama"]["causal-lm"]
    settings = {"max_context_length": args.prompt_len, "seq_len": args.prompt_len + args.new_tokens}
    neuron_config = NeuronConfig(**{**settings, "torch_dtype": args.dtype, **neuron})
    config = cls.get_config_cls()(neuron_config, load_config=load_pretrained_config(path))
    if fused_draft is not None:
        draft_neuron_config = copy.deepcopy(neuron_config)
        draft_neuron_config.enable_fused_speculation = False
        draft_neuron_config.is_eagle_draft = eagle
        draft_config = cls.get_config_cls()(draft_neuron_config, load_config=load_pretrained_config(fused_draft))
        config.fused_spec_config = FusedSpecNeuronConfig(
            cls._model_cls, draft_config=draft_config, draft_model_path=str(fused_draft)
        )
    model = cls(path, config, backend="cpu")
    start = time.perf_counter()
    model.compile(folder)
    seconds = time.perf_counter() - start
    model.load(folder)
    programs = len(json.loads((folder / "manifest.json").read_text())["programs"])
    return model, {"programs": programs, "compile_s": seconds}


def _adapter_run(model: Any, ids: Any, new_tokens: int, **extra: Any) -> tuple[Any, Any]:
    import torch

    from nxdi.shell.generation import HuggingFaceGenerationAdapter

    adapter = HuggingFaceGenerationAdapter(model)
    settings = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **extra}
    out = adapter.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **settings)
    return out[:, ids.shape[1] :], adapter


def nxdi_plain(model: Any) -> Side:
    """(a): the target's greedy decoding, one token-generation step per token."""

    def generate(ids: Any, new_tokens: int) -> Run:
        tokens, _ = _adapter_run(model, ids, new_tokens)
        return Run(tokens=tokens, target_calls=new_tokens)

    return Side(label="nxdi greedy", generate=generate)


def hf_plain(model: Any) -> Side:
    """(d): transformers' greedy generate() of the target."""

    def generate(ids: Any, new_tokens: int) -> Run:
        import torch

        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        return Run(tokens=out[:, ids.shape[1] :], target_calls=new_tokens)

    return Side(label="transformers greedy", generate=generate)


# --- the methods ------------------------------------------------------------------------------


def _draft_method(ws: Workspace) -> Sides:
    """`draft`: a separate draft model (nxdi's `generate(assistant_model=draft)`; transformers'
    assisted generation)."""
    k = ws.args.speculation_length
    target, target_report = load_nxdi(
        ws.target.path,
        ws.folder / "target-speculation",
        ws.args,
        batch_size=ws.batch,
        speculation_length=k,
        trace_tokengen_model=False,
    )
    draft, draft_report = load_nxdi(
        ws.draft.path, ws.folder / "draft", ws.args, batch_size=ws.batch, speculation_length=2
    )

    def generate(ids: Any, new_tokens: int) -> Run:
        tokens, adapter = _adapter_run(target, ids, new_tokens, assistant_model=draft)
        s = adapter.speculation_stats
        return Run(tokens=tokens, target_calls=1 + s["target_steps"], proposed=s["proposed"], accepted=s["accepted"])

    def close() -> None:
        target.close()
        draft.close()

    theirs = _hf_assisted(ws, k) if ws.batch == 1 else None
    return Sides(
        nxdi=Side(label=f"nxdi speculation (draft, k={k})", generate=generate),
        transformers=theirs,
        compiled={"target (speculation)": target_report, "draft": draft_report},
        close=close,
    )


def _hf_assisted(ws: Workspace, k: int) -> Side:
    """(c) for `draft`: transformers' assisted generation with the same pair, k-1 proposals per
    round; target and draft forward calls are counted with hooks."""
    hf_target, hf_draft = (hf_model(m.path, ws.args.dtype) for m in (ws.target, ws.draft))
    hf_draft.generation_config.num_assistant_tokens = k - 1
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    hf_draft.generation_config.assistant_confidence_threshold = 0.0
    calls = {"target": 0, "draft": 0}
    hf_target.register_forward_pre_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1))
    hf_draft.register_forward_pre_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))

    def generate(ids: Any, new_tokens: int) -> Run:
        import torch

        calls.update(target=0, draft=0)
        out = hf_target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=hf_draft,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        # Each target call emits its accepted proposals plus one token of its own; each draft
        # call proposes one token.
        n = out.shape[1] - ids.shape[1]
        return Run(
            tokens=out[:, ids.shape[1] :],
            target_calls=calls["target"],
            proposed=calls["draft"],
            accepted=n - calls["target"],
        )

    return Side(label=f"transformers assisted (k={k})", generate=generate)


def _fused_side(
    ws: Workspace, name: str, *, eagle: bool, tree: Mapping[str, list[int]] | None = None
) -> tuple[Side, Any, dict[str, float]]:
    """nxdi's fused speculation (b) with `ws.draft` inside the target's programs: the side, the
    model and its compile report. Counts from `adapter.speculation_stats` (the fused loop's). With
    `tree` (EAGLE only) the draft proposes that token tree and k is its node count."""
    k = ws.args.speculation_length if tree is None else 1 + sum(len(c) for c in tree.values())
    extra = {} if tree is None else {"token_tree_config": dict(tree)}
    model, report = load_nxdi(
        ws.target.path,
        ws.folder / f"target-{name}",
        ws.args,
        fused_draft=ws.draft.path,
        eagle=eagle,
        batch_size=ws.batch,
        speculation_length=k,
        enable_fused_speculation=True,
        enable_eagle_speculation=eagle,
        on_device_sampling_config={"top_k": 1},  # fused programs pick their tokens on device
        **extra,
    )

    def generate(ids: Any, new_tokens: int) -> Run:
        tokens, adapter = _adapter_run(model, ids, new_tokens)
        s = adapter.speculation_stats  # target_steps: fused steps after the context-encoding call
        return Run(tokens=tokens, target_calls=1 + s["target_steps"], proposed=s["proposed"], accepted=s["accepted"])

    label = f"nxdi speculation ({name}, k={k})" if tree is None else f"nxdi speculation ({name}, {k} nodes)"
    return Side(label=label, generate=generate), model, report


def _fused_method(ws: Workspace) -> Sides:
    """`fused`: the pair's draft model inside the target's fused programs (`generate()` without an
    assistant); transformers' counterpart is assisted generation with the same pair."""
    side, model, report = _fused_side(ws, "fused", eagle=False)
    theirs = _hf_assisted(ws, ws.args.speculation_length) if ws.batch == 1 else None
    return Sides(nxdi=side, transformers=theirs, compiled={"target + draft (fused)": report}, close=model.close)


EAGLE_TREE: Mapping[str, list[int]] = {"0": [1, 2], "1": [3, 4], "3": [5, 6], "5": [7, 8]}
"""`eagle-tree`'s token tree: 9 nodes, 4 deep (up to 5 tokens a step, as the flat draft at k = 5),
the draft's top 2 at each node of its best path."""


def _eagle_method(ws: Workspace, tree: Mapping[str, list[int]] | None = None) -> Sides:
    """`eagle`: the EAGLE draft trained on the target, fused (flat draft); `eagle-tree`: the same
    draft proposing `EAGLE_TREE` (token_tree_config)."""
    side, model, report = _fused_side(ws, "eagle" if tree is None else "eagle-tree", eagle=True, tree=tree)
    why = (
        "transformers has no EAGLE decoding: its assisted generation takes a separate draft model, "
        "not a draft fed the target's hidden states"
    )
    return Sides(
        nxdi=side,
        transformers=None,
        compiled={"target + EAGLE draft (fused)": report},
        close=model.close,
        no_counterpart=why,
    )


def _medusa_method(ws: Workspace) -> Sides:
    """`medusa`: the target with the trained heads (`ws.draft.path`: the target's checkpoint with
    medusa_heads.pt) and `nxdi.testing.medusa.DEFAULT_TREE`, `generate(assistant_model=model)`.
    Compiled with seq_len longer by the tree's nodes: a tree step needs that many free slots, and
    without them the last rows' tokens would come one per step."""
    from nxdi.testing.medusa import DEFAULT_TREE

    nodes = len(DEFAULT_TREE) + 1  # the paths and the root
    model, report = load_nxdi(
        ws.draft.path,
        ws.folder / "target-medusa",
        ws.args,
        batch_size=ws.batch,
        seq_len=ws.args.prompt_len + ws.args.new_tokens + nodes,
        is_medusa=True,
        medusa_speculation_length=nodes,
        num_medusa_heads=bench_spec_trainers.MEDUSA_HEADS,
        medusa_tree=[list(p) for p in DEFAULT_TREE],
    )

    def generate(ids: Any, new_tokens: int) -> Run:
        tokens, adapter = _adapter_run(model, ids, new_tokens, assistant_model=model)
        s = adapter.speculation_stats
        calls = 1 + s["tree_steps"] + s["decode_steps"]
        return Run(tokens=tokens, target_calls=calls, proposed=s["proposed"], accepted=s["accepted"])

    label = f"nxdi speculation (medusa, {bench_spec_trainers.MEDUSA_HEADS} heads, {nodes} nodes)"
    why = "transformers has no Medusa decoding: its generate() runs no Medusa heads or token tree"
    return Sides(
        nxdi=Side(label=label, generate=generate),
        transformers=None,
        compiled={"target + heads (medusa)": report},
        close=model.close,
        no_counterpart=why,
    )


METHODS: Mapping[str, Method] = {
    "draft": Method(summary="a separate draft model (speculation_length k on the target)", build=_draft_method),
    "fused": Method(summary="the same draft model fused into the target's programs", build=_fused_method),
    "medusa": Method(
        summary="Medusa heads trained on the target, a 10-path tree",
        build=_medusa_method,
        trainer=bench_spec_trainers.medusa_heads,
        draft_name="Medusa heads",
        uses_k=False,
    ),
    "eagle": Method(
        summary="an EAGLE draft trained on the target, fused (flat draft)",
        build=_eagle_method,
        trainer=bench_spec_trainers.eagle_draft,
        draft_name="EAGLE draft",
    ),
    "eagle-tree": Method(
        summary="the same EAGLE draft proposing a 9-node token tree (token_tree_config)",
        build=functools.partial(_eagle_method, tree=EAGLE_TREE),
        trainer=bench_spec_trainers.eagle_draft,
        draft_name="EAGLE draft",
        uses_k=False,
    ),
}
"""`--speculation` name -> method."""


def hf_model(path: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

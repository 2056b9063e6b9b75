"""The methods `nxdi bench generate --speculation METHOD` measures, and the sides they run.

A method is a builder `(Workspace) -> Sides`: from the trained pair it builds nxdi's speculative
decoder (b) and, when transformers has one, transformers' own counterpart (c); the command adds
the plain decoders (a) nxdi greedy and (d) transformers greedy (`nxdi_plain`, `hf_plain`) and
measures them all alike (`nxdi.shell.cli.bench_speculation`). Adding a method (fused, Medusa,
EAGLE) is one builder and one entry in `METHODS`; its name becomes a `--speculation` choice.
Heavy libraries are imported inside the functions: this module is imported whenever the `nxdi`
parser is built.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs


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
    """The trained draft (`TrainedModel`)."""
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


@attrs.frozen(kw_only=True, eq=False)
class Method:
    """A `--speculation` choice."""

    summary: str
    build: Callable[[Workspace], Sides]


# --- nxdi models ------------------------------------------------------------------------------


def load_nxdi(path: Path, folder: Path, args: argparse.Namespace, **neuron: Any) -> tuple[Any, dict[str, float]]:
    """The checkpoint at `path` compiled into `folder` (CPU backend) with `neuron` settings and
    loaded, and its compile report (programs, compile seconds)."""
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import MODEL_TYPES

    cls = MODEL_TYPES["llama"]["causal-lm"]
    config = cls.get_config_cls()(
        NeuronConfig(
            max_context_length=args.prompt_len,
            seq_len=args.prompt_len + args.new_tokens,
            torch_dtype=args.dtype,
            **neuron,
        ),
        load_config=load_pretrained_config(path),
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


METHODS: Mapping[str, Method] = {
    "draft": Method(summary="a separate draft model (speculation_length k on the target)", build=_draft_method),
}
"""`--speculation` name -> method. Others (fused, medusa, eagle) are one entry each."""


def hf_model(path: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

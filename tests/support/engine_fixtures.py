"""Loaded nxdi models and transformers references for the end-to-end engine tests.

Imported by `tests/e2e/conftest.py`. Every engine test gets its model from ONE place,
`load_model` (through the session fixture `loaded_model(variant, **neuron_config_kwargs)`), which
builds the documented way: NeuronConfig -> <Family>InferenceConfig(load_pretrained_config(path))
-> MODEL_TYPES[model_type]["causal-lm"](path, config), then brings it up with `_bring_up`: the
eager `to_cpu()` by default, or compile() + load() with NXDI_E2E_ENGINE=compiled.

Models are shared per session and are stateful (KV cache, random stream): tests must start each
sequence with a prefill (generate() resets) and seed explicitly when they sample; `fresh=True`
gives a private model.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import Tensor

from nxdi.core import families
from nxdi.testing.checkpoints import VARIANTS, SaveFormat

FAMILIES = tuple(r.name for r in families.runnable())
"""Every family the engine runs; `VARIANTS` adds llama3-tied (RoPE scaling, tied embeddings)."""

PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 5, 7, 9, 11, 3, 4, 5, 6, 7),
    (3,),
    (4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17),
    (9, 8),
)
"""Four prompts of different lengths (one is a single token); ids avoid 0 (pad) and 2 (eos)."""

NEW_TOKENS = 32
SEQ_LEN = 64
PAD = 0


def settings_kwargs(settings: Sequence[str | tuple[str, Any]]) -> dict[str, Any]:
    """A test case's NeuronConfig settings as kwargs: a name turns a flag on, a pair sets a value."""
    return dict(s if isinstance(s, tuple) else (s, True) for s in settings)


def model_type_of(variant: str) -> str:
    return VARIANTS[variant][0]


ENGINE = os.environ.get("NXDI_E2E_ENGINE", "eager")
"""How `_bring_up` loads models: "eager" (`to_cpu()`, the default) or "compiled" (`compile()` into a
temporary folder, then `load()`), so the whole suite can run through the compiled programs:
`NXDI_E2E_ENGINE=compiled pytest tests/e2e/test_engine_*.py` (slower: every configuration compiles)."""


def _bring_up(model: Any, workdir: Path | None, *, compiled: bool = False) -> Any:
    """Make a constructed model runnable: the one place the suite chooses eager or compiled
    (`compiled` forces compile() + load(), which a backend other than the CPU's needs)."""
    if ENGINE == "compiled" or compiled:
        folder = Path(tempfile.mkdtemp(prefix="compiled-", dir=workdir))
        model.compile(folder)
        model.load(folder)
    else:
        assert ENGINE == "eager", f"NXDI_E2E_ENGINE={ENGINE!r}: expected 'eager' or 'compiled'"
        model.to_cpu()
    return model


def load_model(
    path: Path,
    variant: str,
    *,
    workdir: Path | None = None,
    backend: str | None = None,
    **neuron_config_kwargs: Any,
) -> Any:
    """The documented construction of a loaded model of `variant` from the checkpoint at `path`.

    `torch_dtype` defaults to float32 (the checkpoint's own dtype would win otherwise); `workdir`
    holds compiled folders when ENGINE is "compiled" or `backend` names one (which always compiles).
    """
    from nxdi.shell.config import MoENeuronConfig, NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES

    kwargs = {"torch_dtype": "float32", "seq_len": SEQ_LEN, **neuron_config_kwargs}
    model_type = model_type_of(variant)
    neuron_config = (MoENeuronConfig if families.by_model_type()[model_type].moe else NeuronConfig)(**kwargs)
    config = CONFIG_TYPES[model_type](neuron_config, load_config=load_pretrained_config(path))
    model = MODEL_TYPES[model_type]["causal-lm"](path, config, backend=backend)
    return _bring_up(model, workdir, compiled=backend is not None)


def make_loaded_model(checkpoint: Callable[..., Path], workdir: Path | None = None) -> Callable[..., Any]:
    """`loaded_model(variant, *, fmt=SAFETENSORS, fresh=False, **neuron_config_kwargs)`, cached per arguments."""
    built: dict[str, Any] = {}

    def get(variant: str, *, fmt: SaveFormat = SaveFormat.SAFETENSORS, fresh: bool = False, **kwargs: Any) -> Any:
        key = repr((variant, fmt, sorted(kwargs.items())))
        if fresh or key not in built:
            model = load_model(checkpoint(variant, fmt), variant, workdir=workdir, **kwargs)
            if fresh:
                return model
            built[key] = model
        return built[key]

    return get


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tiny models on one intra-op thread (restored afterwards). On this 2-core,
    shared machine two threads make a tiny decode step up to 100x slower whenever another process is
    busy (OpenMP threads wait on each other); one thread loses nothing at these sizes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def loaded_model(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    return make_loaded_model(tiny_checkpoint, tmp_path_factory.mktemp("compiled") if ENGINE == "compiled" else None)


@pytest.fixture
def tp_model(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`tp_model(variant, path=None, **neuron_config)`: a private loaded model (its rank processes
    are not shared with other tests), closed after the test."""
    made: list[Any] = []

    def make(variant: str, path: Path | None = None, **kwargs: Any) -> Any:
        model = load_model(path or tiny_checkpoint(variant), variant, workdir=tmp_path, **kwargs)
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()


@pytest.fixture(scope="session")
def hf_greedy(tiny_model: Callable[[str], Any]) -> Callable[..., Tensor]:
    """`hf_greedy(variant, prompts, new_tokens=NEW_TOKENS)`: transformers' greedy new tokens [B, N]
    on a left-padded batch, EOS off; cached, so each reference generation runs once a session."""
    done: dict[tuple[Any, ...], Tensor] = {}

    def get(variant: str, prompts: Sequence[Sequence[int]], new_tokens: int = NEW_TOKENS) -> Tensor:
        key = (variant, tuple(map(tuple, prompts)), new_tokens)
        if key not in done:
            done[key] = hf_generate(tiny_model(variant), prompts, max_new_tokens=new_tokens)
        return done[key]

    return get


# --- inputs and runs ---------------------------------------------------------------------------


def padded(prompts: Sequence[Sequence[int]], side: str = "right", width: int | None = None) -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, W] with each prompt padded on `side` with PAD."""
    w = width or max(len(p) for p in prompts)
    ids = torch.full((len(prompts), w), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(0, len(p)) if side == "right" else slice(w - len(p), w)
        ids[i, cols], mask[i, cols] = torch.tensor(list(p)), 1
    return ids, mask


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], **kwargs: Any) -> Tensor:
    """transformers generate() on the left-padded batch (its convention); the new tokens [B, N]."""
    ids, mask = padded(prompts, "left")
    settings = {"do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **settings)[:, ids.shape[1] :]


def nxdi_generate(model: Any, prompts: Sequence[Sequence[int]], *, side: str = "right", **kwargs: Any) -> Tensor:
    """HuggingFaceGenerationAdapter(model).generate() on the padded batch; the new tokens [B, N]."""
    from nxdi.shell.generation import HuggingFaceGenerationAdapter

    ids, mask = padded(prompts, side)
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    out = HuggingFaceGenerationAdapter(model).generate(ids, attention_mask=mask, **settings)
    return out[:, ids.shape[1] :]


T = TypeVar("T")


def with_and_without(
    monkeypatch: pytest.MonkeyPatch, module: Any, rewrite: str, run: Callable[[], T]
) -> tuple[T, T, list[int]]:
    """`run()` (which compiles and binds its model) with the CPU backend's bind-time rewrite
    `module.<rewrite>` in place, then with it off: both results, and the rewrite's count for each
    program bound in the first run."""
    real, counts = getattr(module, rewrite), []

    def counting(gm: Any, *args: Any) -> int:
        counts.append(real(gm, *args))
        return counts[-1]

    monkeypatch.setattr(module, rewrite, counting)
    fused = run()
    monkeypatch.setattr(module, rewrite, lambda gm, *args: 0)
    return fused, run(), counts


def teacher_forced(model: Any, prompts: Sequence[Sequence[int]], tokens: Tensor) -> Tensor:
    """forward() logits [B, N, V]: the prefill of the right-padded prompts, then one decode step per
    column of `tokens` [B, N-1] (the tokens fed back, at the positions after each prompt)."""
    ids, mask = padded(prompts, "right")
    model.reset()
    out = [model.forward(ids, attention_mask=mask).logits[:, -1]]
    positions = mask.sum(-1, keepdim=True)  # [B, 1]
    for k in range(tokens.shape[1]):
        out.append(model.forward(tokens[:, k : k + 1], position_ids=positions + k).logits[:, -1])
    return torch.stack(out, dim=1)


def hf_logits(model: Any, sequence: Sequence[int]) -> Tensor:
    """transformers' logits [n, V] of one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(sequence)])).logits[0].float()


def runtime_of(model: Any) -> Any:
    """The model's Runtime (KV cache, programs, random stream). The model has no public accessor
    for it, nor a public way to seed on-device sampling, so tests reach it here."""
    return model._require_runtime()


@contextmanager
def program_calls(model: Any) -> Iterator[list[Any]]:
    """Record the `ProgramKey` of every program call, in order, by wrapping Runtime.run (and
    Runtime.run_blocks, the block-KV programs' entry)."""
    runtime = runtime_of(model)
    calls: list[Any] = []
    original, original_blocks = runtime.run, runtime.run_blocks

    def spy(key: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        assert tuple(x.input_ids.shape) == (key.batch, key.tokens), (key, x.input_ids.shape)
        calls.append(key)
        return (original_blocks if args else original)(key, x, *args, **kwargs)

    runtime.run = runtime.run_blocks = spy
    try:
        yield calls
    finally:
        del runtime.run, runtime.run_blocks  # back to the class methods

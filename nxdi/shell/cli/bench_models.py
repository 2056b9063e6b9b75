"""The models `nxdi bench` measures: `--model-path DIR`, or a random `--model-type` at `--shape`.

A random checkpoint is built once into `--work-dir`, named `{model_type}-{shape}-{dtype}`, and
reused by later runs (no download). Shapes give every family the same sizes, so `--shape small`
means a comparable model whatever the type; a mixture of experts gets 8 experts, top 2, each of
half the dense MLP width, so its active parameters match the dense model's:

| shape | hidden | layers | heads / KV heads (dim 64) | dense MLP | experts (MoE) | parameters |
|---|---|---|---|---|---|---|
| small | 768 | 12 | 12 / 4 | 2048 | 8 x 1024, top 2 | dense 125M; MoE 125M active, 295M in all |
| tiny | 2048 | 22 | 32 / 4 | 5632 | 8 x 2816, top 2 | dense 1.1B; MoE 1.1B active, 3.4B in all |

Vocabulary 32000, untied embeddings, transformers' default initialisation (std 0.02), and no
sliding window shorter than the model (Mistral's and Mixtral's window off, Qwen2's unused) except
Gemma 3's, whose interleave is the family: every sixth layer global, the others within Gemma 3
1B's window of 512, and query_pre_attn_scalar = head_dim as in Gemma 3 1B and 4B. DBRX (its sizes
under `d_model`, `attn_config`, `ffn_config`) clamps q/k/v at the published DBRX's clip_qkv of 8
and normalises its top-k weights by their sum (p = 1). Other features are the family's test
configuration's (Qwen3-MoE renormalises its top-k affinities). `toy` is that test configuration
itself (`nxdi.testing.checkpoints.tiny_config`: hidden 64, 2 layers, vocab 160), for every
runnable family: seconds to build, for smoke tests.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

SIZES: Mapping[str, Mapping[str, int]] = {
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, ffn=2048),
    "tiny": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, ffn=5632),
}
"""Shape -> sizes shared by every family; `ffn` is the dense MLP width (an expert gets ffn / TOP_K)."""
SHAPES: tuple[str, ...] = (*SIZES, "toy")
EXPERTS = 8
TOP_K = 2
_COMMON: Mapping[str, Any] = dict(head_dim=64, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02)


@attrs.frozen(kw_only=True)
class FamilyKeys:
    """How a family's Hugging Face config names the sizes a shape sets. A key may be dotted
    (`ffn_config.moe_top_k`): the key of that name in the nested object."""

    ffn: str = "intermediate_size"
    """The key of the MLP width (a mixture of experts: one expert's)."""
    experts: str | None = None
    """The key of the number of experts; None for a dense family."""
    top_k: str = "num_experts_per_tok"
    """The key of the experts each token uses (mixtures of experts only)."""
    also: Mapping[str, str] = attrs.field(factory=dict)
    """Shared size key -> another key that must hold the same size: DBRX's `d_model` (transformers
    sizes the experts from it before the `hidden_size` alias is set) and `attn_config.kv_n_heads`."""
    head_dim: bool = True
    """The config has a `head_dim` key (DBRX's is d_model / n_heads, 64 in every shape)."""
    global_every: int | None = None
    """Write `layer_types` for the shape's layers: every n-th global, the others within the sliding
    window (Gemma 3's interleave: 6, so layers 5, 11, 17, ...); None: the config has no layer_types."""
    fixed: Mapping[str, Any] = attrs.field(factory=dict)
    """Settings over the family's test configuration (`FamilyRecord.tiny_config`)."""


FAMILIES: Mapping[str, FamilyKeys] = {
    "llama": FamilyKeys(),
    "mistral": FamilyKeys(fixed={"sliding_window": None}),
    "qwen2": FamilyKeys(fixed={"use_sliding_window": False}),
    "qwen3": FamilyKeys(fixed={"use_sliding_window": False}),
    "mixtral": FamilyKeys(experts="num_local_experts", fixed={"sliding_window": None}),
    "qwen3_moe": FamilyKeys(ffn="moe_intermediate_size", experts="num_experts", fixed={"use_sliding_window": False}),
    "gemma3": FamilyKeys(
        global_every=6,
        fixed={"sliding_window": 512, "query_pre_attn_scalar": _COMMON["head_dim"], "tie_word_embeddings": False},
    ),
    "dbrx": FamilyKeys(
        ffn="ffn_config.ffn_hidden_size",
        experts="ffn_config.moe_num_experts",
        top_k="ffn_config.moe_top_k",
        also={"hidden_size": "d_model", "num_key_value_heads": "attn_config.kv_n_heads"},
        head_dim=False,
        fixed={"attn_config.clip_qkv": 8.0, "ffn_config.moe_normalize_expert_weights": 1.0},
    ),
}
"""The families `small` and `tiny` know the keys of (every runnable family has `toy`)."""
TOY_ONLY = frozenset({"gpt2", "opt", "bloom", "gptj", "gpt_neox"})
"""Runnable families benchmarked at `toy` only: multi-head attention (the sized shapes have 4 kv
heads) and configs that name their sizes their own way (`n_embd`, `ffn_dim`, ...)."""


def model_types() -> tuple[str, ...]:
    """The `--model-type` choices: every family the engine runs."""
    from nxdi.core import families

    return tuple(r.name for r in families.runnable())


def add_checkpoint_args(p: argparse.ArgumentParser, *, default_shape: str = "small") -> None:
    """`--model-type`, `--shape`, `--model-path` and `--dtype`: the checkpoint `checkpoint_for` gives."""
    p.add_argument(
        "--model-type",
        choices=model_types(),
        default="llama",
        help="family of the random checkpoint (ignored with --model-path: its config.json names it)",
    )
    p.add_argument(
        "--shape",
        choices=SHAPES,
        default=default_shape,
        help="small: hidden 768, 12 layers (~125M active); tiny: the TinyLlama-1.1B shape; toy: the family's test config",
    )
    p.add_argument("--model-path", default=None, help="benchmark this checkpoint instead of a random shape")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])


def config_overrides(model_type: str, shape: str) -> dict[str, Any]:
    """The settings over the family's test configuration that make `shape` (none for `toy`).

    Raises:
        UsageError: `shape` is sized but the family's config keys are not in FAMILIES.
    """
    from nxdi.shell.cli.errors import UsageError

    if shape == "toy":
        return {}
    keys = FAMILIES.get(model_type)
    if keys is None:
        known = ", ".join(FAMILIES)
        raise UsageError(f"--shape {shape} is not defined for {model_type} (only for {known}); use --shape toy")
    sizes = dict(SIZES[shape])
    ffn = sizes.pop("ffn")
    common = {k: v for k, v in _COMMON.items() if keys.head_dim or k != "head_dim"}
    flat = {**common, **sizes, **{key: sizes[size] for size, key in keys.also.items()}, **keys.fixed}
    if (every := keys.global_every) is not None:
        flat["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(sizes["num_hidden_layers"])
        ]
    if keys.experts is None:
        flat[keys.ffn] = ffn
    else:
        flat |= {keys.ffn: ffn // TOP_K, keys.experts: EXPERTS, keys.top_k: TOP_K}
    return _nested(flat, _test_config(model_type))


def _test_config(model_type: str) -> Mapping[str, Any]:
    """The family's test configuration (`FamilyRecord.tiny_config`) of `--model-type` (a family name)."""
    from nxdi.core import families

    return next(r.tiny_config for r in families.RECORDS if r.name == model_type)


def _nested(flat: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """`flat` with each dotted key (`attn_config.kv_n_heads`) set inside its object, over that object
    in `base`: an override replaces a whole object, so the rest of it is kept from the test config."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        outer, dot, inner = key.partition(".")
        if dot:
            out[outer] = {**base.get(outer, {}), **out.get(outer, {}), inner: value}
        else:
            out[key] = value
    return out


def checkpoint_for(args: argparse.Namespace) -> Path:
    """The checkpoint to benchmark: `--model-path`, else a random `--model-type` `--shape` built
    once into `--work-dir` (in `--dtype`)."""
    if args.model_path:
        return Path(args.model_path)
    import torch

    from nxdi.testing import checkpoints

    overrides = config_overrides(args.model_type, args.shape)  # a refused shape fails before anything is built
    path = Path(args.work_dir) / f"{args.model_type}-{args.shape}-{args.dtype}"
    if not (path / "config.json").is_file():
        print(f"[bench] building a random {args.shape} {args.model_type} in {path} ...", flush=True)
        model = checkpoints.build_model(args.model_type, seed=0, **overrides)
        model.to(getattr(torch, args.dtype)).save_pretrained(path)
    return path

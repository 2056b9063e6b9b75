"""`from_pretrained`'s and `sample`'s arguments: checked, and mapped onto nxdi's NeuronConfig.

`nxdi_kwargs` turns transformers-neuronx's `from_pretrained` arguments and NeuronConfig into nxdi
NeuronConfig attributes (raising with every problem named); `report` warns once about the
settings without effect on the CPU; `sampling_problems` checks host sampling values.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nxdi.core.planning import gqa
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.tnx.config import NeuronConfig

AMP: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
"""transformers-neuronx `amp` -> the dtype of the weights and compute."""


def buckets(value: int | list[int] | tuple[int, ...] | None, name: str) -> list[int] | None:
    """The sorted distinct bucket lengths of an int or a list (None stays None).

    Raises:
        IncompatibleConfigError: an empty list, or a value that is not a positive int.
    """
    if value is None:
        return None
    values = [value] if isinstance(value, int) else list(value)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise IncompatibleConfigError(f"{name}={value!r}: must be a positive int or a list of them")
    return sorted(set(values))


def sampling_problems(*, top_k: Any, top_p: Any, temperature: Any, no_repeat_ngram_size: Any) -> list[str]:
    """Every bad host sampling value of `sample()`, each named."""
    out = []
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        out.append(f"top_k={top_k!r}: must be an int (<= 0: the whole vocabulary)")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        out.append(f"top_p={top_p!r}: must lie in (0, 1]")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        out.append(f"temperature={temperature!r}: must be a float > 0")
    if no_repeat_ngram_size is not None and (not isinstance(no_repeat_ngram_size, int) or no_repeat_ngram_size < 0):
        out.append(f"no_repeat_ngram_size={no_repeat_ngram_size!r}: must be an int >= 1 (or None)")
    return out


def nxdi_kwargs(
    tnx: NeuronConfig,
    *,
    problems: list[str],
    batch_size: int,
    n_positions: int | list[int],
    tp_degree: int,
    amp: str,
    context_length_estimate: int | list[int] | None,
    prompt_batch_size: int | None,
) -> dict[str, Any]:
    """nxdi NeuronConfig attributes of `from_pretrained`'s arguments (raising with every problem)."""
    if amp not in AMP:
        problems.append(f"amp={amp!r}: must be one of {', '.join(AMP)}")
    if tnx.quant is not None and tnx.quant.dequant_dtype != amp:
        problems.append(f"amp={amp!r}: with quant it must equal dequant_dtype={tnx.quant.dequant_dtype!r}")
    if prompt_batch_size is not None and (prompt_batch_size < 1 or batch_size % prompt_batch_size):
        problems.append(f"prompt_batch_size={prompt_batch_size}: must divide batch_size={batch_size}")
    generation = tnx.on_device_generation
    if generation is not None:
        problems += [f"on_device_generation.{p}" for p in generation.problems(batch_size)]
    try:
        tokens = buckets(n_positions, "n_positions")
        contexts = buckets(context_length_estimate, "context_length_estimate")
    except IncompatibleConfigError as e:
        problems.append(str(e))
        tokens = contexts = None
    if problems:
        raise IncompatibleConfigError("Invalid from_pretrained arguments:\n" + "\n".join(f"  {p}" for p in problems))
    assert tokens is not None
    seq_len = tokens[-1]
    out: dict[str, Any] = dict(
        batch_size=batch_size,
        tp_degree=tp_degree,
        torch_dtype=AMP[amp],
        seq_len=seq_len,
        enable_bucketing=True,
        **tnx.nxdi_kwargs(),
    )
    if isinstance(n_positions, list | tuple):
        out["token_generation_buckets"] = tokens
    if contexts is not None:
        out["context_encoding_buckets"] = contexts
        out["max_context_length"] = contexts[-1]
    if tnx.continuous_batching is not None:
        slots = tnx.continuous_batching.max_num_seqs
        out.update(batch_size=slots, ctx_batch_size=batch_size, tkg_batch_size=slots)
    return out


def report(tnx: NeuronConfig, nxdi_config: Any, family: str) -> None:
    """Warn once about the transformers-neuronx settings that cannot change what the CPU engine
    computes, and the GQA strategy transformers-neuronx would have fallen back to."""
    inert = tnx.inert()
    model = nxdi_config.model_spec()
    spec = nxdi_config.neuron_config.spec
    if tnx.group_query_attention is not None:
        strategy, notes = gqa.determine_tnx_strategy(
            tnx.group_query_attention,
            tp=spec.tp_degree,
            q=model.num_attention_heads,
            kv=model.num_kv_heads,
            head_dim=model.head_dim,
            batch_sizes=[spec.batch_size],
        )
        inert += [f"({note}: transformers-neuronx would use {strategy.name})" for note in notes]
    if inert:
        warnings.warn(
            f"These transformers-neuronx settings have no effect on the CPU backend ({family}): {', '.join(inert)} "
            "(nxdi.shell.tnx.config.SETTINGS says why for each)",
            stacklevel=3,
        )

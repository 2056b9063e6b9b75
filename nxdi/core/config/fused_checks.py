"""What a fused-speculation target needs of its draft model. Pure.

`enable_fused_speculation` puts a draft model and its target in one compiled program per bucket
(`nxdi.core.programs.fused_speculation`). The draft comes from `InferenceConfig.fused_spec_config`
(NxDI's `FusedSpecNeuronConfig`: the draft's config and checkpoint path). The fused program runs
the draft on the target's batch, buckets and cache, so its config must agree with the target's
where those meet; `check_fused_pair` lists every disagreement (field names as the user writes
them, under `fused_spec_config.`). The draft's architecture, dtype and weights are its own; its
runtime settings (buckets, on-device sampling, async_mode) are the target's: the draft proposes
greedily, as NxDI's does.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
from returns.result import Success

from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.errors import Problem
from nxdi.core.model_spec import ModelSpec
from nxdi.core.planning import eagle_tree

FIELD = "fused_spec_config"
DRAFT = f"{FIELD}.draft_config"


@attrs.frozen(kw_only=True)
class DraftSide:
    """What the fused config says about the draft (None where it says nothing)."""

    spec: NeuronSpec | None = None
    """The draft config's NeuronSpec."""
    model: ModelSpec | None = None
    """The draft's architecture (None when its config does not parse; that error is listed apart)."""
    path: str | None = None
    """`draft_model_path`: where its weights are read."""


def draft_spec(target: NeuronSpec, draft: NeuronSpec) -> NeuronSpec:
    """The draft's spec as the fused pair runs it: with the target's
    `draft_model_modules_to_not_convert` set, that list replaces the draft's own
    `modules_to_not_convert` (NxDI's rule: a draft config copied from the target carries the
    target's list, which names the target's modules)."""
    if not target.enable_fused_speculation or target.draft_model_modules_to_not_convert is None:
        return draft
    return attrs.evolve(draft, modules_to_not_convert=target.draft_model_modules_to_not_convert)


def check_fused_pair(target: NeuronSpec, target_model: ModelSpec, draft: DraftSide | None) -> tuple[Problem, ...]:
    """Every reason the target (with `enable_fused_speculation`) cannot run with its draft.

    Args:
        draft: the fused config's draft, or None when the InferenceConfig has no fused_spec_config.

    Returns:
        The problems (empty when they can run together): a fused_spec_config without
        enable_fused_speculation (its draft would be unused); a missing fused_spec_config, draft
        config or draft_model_path; a draft over another vocabulary; a draft whose batch size,
        max_length or tp_degree differ from the target's; a draft that itself asks for fused
        speculation, or for a mixture of experts' routing outputs (a fused program returns none);
        with EAGLE (`enable_eagle_speculation`) a draft that is not `is_eagle_draft` or whose hidden
        size differs from the target's, and an `is_eagle_draft` draft of a target without EAGLE;
        a token tree with a node of more children than the vocabulary has tokens;
        `draft_model_modules_to_not_convert` on a draft that is not quantized, or against a
        modules_to_not_convert the draft config sets itself.
    """
    if not target.enable_fused_speculation:
        if draft is None:
            return ()
        why = "is set but enable_fused_speculation=False, so its draft model would not be used"
        return (Problem.of(FIELD, "set", why, "set enable_fused_speculation=True, or fused_spec_config=None"),)
    return tuple(_pair(target, target_model, draft))


def _pair(target: NeuronSpec, target_model: ModelSpec, draft: DraftSide | None) -> Iterator[Problem]:
    if draft is None:
        why = "is required with enable_fused_speculation=True: it names the draft model fused with the target"
        fix = (
            "set config.fused_spec_config = FusedSpecNeuronConfig(Cls._model_cls, draft_config=..., "
            "draft_model_path=...)"
        )
        yield Problem.of(FIELD, None, why, fix)
        return
    if draft.path is None:
        yield Problem.of(
            f"{FIELD}.draft_model_path", None, "is required: the draft's weights are read from it", "set it"
        )
    if draft.spec is None:
        yield Problem.of(DRAFT, None, "is required: the draft model's InferenceConfig", "set draft_config")
        return
    if draft.model is not None and draft.model.vocab_size != target_model.vocab_size:
        why = (
            f"differs from the target's vocab_size={target_model.vocab_size}: the target verifies the draft's token ids"
        )
        yield Problem.of(f"{DRAFT}.vocab_size", draft.model.vocab_size, why, "use a draft with the target's tokenizer")
    d, t = draft.spec, target
    for name, fix in (
        ("batch_size", "give the draft the target's batch_size"),
        ("max_length", "give the draft the target's seq_len / max_length (both caches share the buckets)"),
        ("tp_degree", "give the draft the target's tp_degree"),
    ):
        if getattr(d, name) != getattr(t, name):
            why = f"differs from the target's {name}={getattr(t, name)}: the draft runs inside the target's programs"
            yield Problem.of(f"{DRAFT}.neuron_config.{name}", getattr(d, name), why, fix)
    yield from _eagle(target, target_model, draft)
    yield from _draft_quantization(target, d)
    if d.enable_fused_speculation:
        why = "must be False on the draft: the target's config fuses the pair"
        yield Problem.of(f"{DRAFT}.neuron_config.enable_fused_speculation", True, why, "set it to False on the draft")
    for name in ("return_router_logits", "return_expert_index"):
        if d.moe is not None and getattr(d.moe, name):
            why = "is not returned by a fused program (it returns tokens)"
            yield Problem.of(f"{DRAFT}.neuron_config.{name}", True, why, f"set {name}=False on the draft")


def _eagle(target: NeuronSpec, target_model: ModelSpec, draft: DraftSide) -> Iterator[Problem]:
    """An EAGLE target needs an EAGLE draft of its hidden size (its fc reads the target's hidden
    states), and an EAGLE draft needs an EAGLE target (nothing else feeds it hidden states)."""
    assert draft.spec is not None
    eagle, is_draft = target.enable_eagle_speculation, draft.spec.is_eagle_draft
    if eagle and not is_draft:
        why = "must be True with enable_eagle_speculation=True: the fused draft is an EAGLE draft"
        yield Problem.of(f"{DRAFT}.neuron_config.is_eagle_draft", False, why, "set is_eagle_draft=True on the draft")
    if is_draft and not eagle:
        why = (
            "marks an EAGLE draft, which needs its target's hidden states: the target must set enable_eagle_speculation"
        )
        fix = "set enable_eagle_speculation=True on the target, or use an ordinary draft with is_eagle_draft=False"
        yield Problem.of(f"{DRAFT}.neuron_config.is_eagle_draft", True, why, fix)
    tree = eagle_tree.parse_eagle_tree(target.token_tree_config) if target.token_tree_config is not None else None
    if isinstance(tree, Success) and tree.unwrap().top_k > target_model.vocab_size:
        why = f"gives a node {tree.unwrap().top_k} children, more than the vocabulary ({target_model.vocab_size})"
        yield Problem.of(eagle_tree.FIELD, "set", why, "give each node at most vocab_size children")
    if eagle and is_draft and draft.model is not None and draft.model.hidden_size != target_model.hidden_size:
        why = (
            f"differs from the target's hidden_size={target_model.hidden_size}: the draft's fc reads its hidden states"
        )
        yield Problem.of(
            f"{DRAFT}.hidden_size", draft.model.hidden_size, why, "use the EAGLE draft trained for this target"
        )


def _draft_quantization(target: NeuronSpec, draft: NeuronSpec) -> Iterator[Problem]:
    """`draft_model_modules_to_not_convert` chooses which of a quantized draft's modules stay in
    float; on a draft that is not quantized it would do nothing, and it would silently override a
    list the draft config sets itself (one that is not the target's copied list)."""
    given = target.draft_model_modules_to_not_convert
    if given is None:
        return
    name = "draft_model_modules_to_not_convert"
    if not draft.quantized:
        why = f"keeps draft modules in float, but the draft is not quantized ({DRAFT}.neuron_config.quantized=False)"
        yield Problem.of(name, list(given), why, "unset it, or set quantized=True on the draft config")
    own = draft.modules_to_not_convert
    if own is not None and own != target.modules_to_not_convert and own != given:
        why = f"would replace the draft config's own modules_to_not_convert={list(own)}"
        fix = f"set one of them: unset {name}, or {DRAFT}.neuron_config.modules_to_not_convert"
        yield Problem.of(name, list(given), why, fix)

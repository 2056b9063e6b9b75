"""Gemma 3 configs through `parse_model_spec`: the hub's layout and transformers 5's, transformers'
defaults, every bad value named by its field, the multimodal config's language model (read from
its text_config), and `num_params` against transformers' own count."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import transformers

from nxdi.core.model_spec import RopeKind, RopeSpec
from tests.support.planner_configs import GEMMA_3_1B, GEMMA_3_4B, GEMMA_3_27B_TEXT
from tests.support.planner_configs import spec as parsed
from tests.support.planner_configs import spec_failure as failure


def test_gemma_3_1b_reads_its_windows_ropes_norms_and_scales() -> None:
    spec = parsed(GEMMA_3_1B)
    assert spec.model_type == "gemma3_text"
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (1152, 4, 1, 256)
    assert spec.sliding_window == 512 and spec.full_attention_layers == (5, 11, 17, 23)  # every sixth is global
    assert spec.rope == RopeSpec(theta=1e6) and spec.local_rope == RopeSpec(theta=1e4)
    assert spec.layer_rope(0) == spec.local_rope and spec.layer_rope(5) == spec.rope
    assert spec.embed_scale == 1152**0.5 and spec.attention_scale == 256**-0.5
    assert spec.qk_norm and spec.norm_offset and spec.sandwich_norms and spec.tie_word_embeddings
    assert (spec.activation, spec.final_logit_softcap, spec.eos_token_ids) == ("gelu_pytorch_tanh", None, (1, 106))


def test_gemma_3_27b_scales_only_the_global_rope_and_takes_query_pre_attn_scalar() -> None:
    spec = parsed(GEMMA_3_27B_TEXT)
    assert spec.rope == RopeSpec(theta=1e6, kind=RopeKind.LINEAR, factor=8.0)
    assert spec.local_rope == RopeSpec(theta=1e4)
    assert spec.attention_scale == 168**-0.5 and spec.head_dim == 128
    assert spec.full_attention_layers == tuple(range(5, 62, 6)) and spec.sliding_window == 1024
    assert spec.max_position_embeddings == 131072  # transformers' default


@pytest.mark.parametrize("raw", [GEMMA_3_1B, GEMMA_3_27B_TEXT], ids=["1b", "27b"])
def test_transformers_rewrite_of_a_real_config_parses_the_same(raw: dict[str, Any]) -> None:
    """transformers 5 writes `layer_types` and one RoPE block per layer type instead."""
    rewritten = transformers.Gemma3TextConfig.from_dict(raw).to_dict()
    assert "rope_local_base_freq" not in rewritten and "rope_scaling" not in rewritten
    assert set(rewritten["rope_parameters"]) == {"full_attention", "sliding_attention"}
    assert parsed(rewritten) == parsed(raw)


def test_transformers_default_config_parses() -> None:
    config = transformers.Gemma3TextConfig()
    spec = parsed(config.to_dict())
    assert spec.rope is not None and spec.local_rope is not None
    assert spec.rope.theta == config.rope_parameters["full_attention"]["rope_theta"]
    assert spec.local_rope.theta == config.rope_parameters["sliding_attention"]["rope_theta"]
    assert spec.full_attention_layers == tuple(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    assert (spec.sliding_window, spec.head_dim, spec.attention_scale) == (4096, 256, 256**-0.5)


def test_defaults_of_an_abridged_config_are_transformers_defaults() -> None:
    raw = {k: GEMMA_3_27B_TEXT[k] for k in ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers")}
    spec = parsed(raw | {"intermediate_size": 96, "vocab_size": 128})
    config = transformers.Gemma3TextConfig(**raw | {"intermediate_size": 96, "vocab_size": 128})
    assert (spec.head_dim, spec.num_kv_heads, spec.sliding_window) == (256, 32, config.sliding_window)
    assert spec.full_attention_layers == tuple(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    assert spec.tie_word_embeddings and spec.rope == RopeSpec(theta=1e6) and spec.local_rope == RopeSpec(theta=1e4)
    tokens = (config.pad_token_id, config.bos_token_id, (config.eos_token_id,))
    assert (spec.pad_token_id, spec.bos_token_id, spec.eos_token_ids) == tokens


def test_a_model_without_sliding_layers_has_no_window_and_one_rope() -> None:
    spec = parsed(GEMMA_3_1B | {"sliding_window_pattern": 1})
    assert (spec.sliding_window, spec.full_attention_layers, spec.local_rope) == (None, (), None)
    assert all(spec.layer_rope(i) == spec.rope for i in range(spec.num_layers))


def test_attn_logit_softcapping_is_read_but_not_applied_as_in_transformers() -> None:
    assert parsed(GEMMA_3_1B | {"attn_logit_softcapping": 50.0}) == parsed(GEMMA_3_1B)


def test_final_logit_softcapping_is_read() -> None:
    assert parsed(GEMMA_3_1B | {"final_logit_softcapping": 30.0}).final_logit_softcap == 30.0


def test_the_hub_gemma_3_4b_multimodal_config_reads_its_language_model() -> None:
    """transformers' defaults fill the sparse text_config; the top-level eos ids win; the language
    model (tied lm_head counted once) has transformers' own parameter count."""
    spec = parsed(GEMMA_3_4B)
    assert spec.model_type == "gemma3" and spec.tie_word_embeddings
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (2560, 8, 4, 256)
    assert (spec.vocab_size, spec.num_layers, spec.sliding_window) == (262208, 34, 1024)
    assert spec.rope == RopeSpec(theta=1e6, kind=RopeKind.LINEAR, factor=8.0) and spec.local_rope == RopeSpec(theta=1e4)
    assert (spec.pad_token_id, spec.bos_token_id, spec.eos_token_ids) == (0, 2, (1, 106))
    config = transformers.Gemma3Config.from_dict(GEMMA_3_4B)
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(config)
    language = {id(p): p.numel() for n, p in model.named_parameters() if not n.startswith("model.vision_tower.")}
    projector = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert spec.num_params() == sum(language.values()) - projector == 3_880_263_168


def test_a_multimodal_config_reads_text_config_as_a_gemma3_text_config() -> None:
    text = {**GEMMA_3_27B_TEXT, "eos_token_id": 7}
    spec = parsed({"model_type": "gemma3", "text_config": text})
    assert spec == attrs.evolve(parsed(text), model_type="gemma3")
    assert not parsed({"model_type": "gemma3", "text_config": text, "tie_word_embeddings": False}).tie_word_embeddings
    outer = parsed({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106], "pad_token_id": 5})
    assert (outer.eos_token_ids, outer.pad_token_id, outer.bos_token_id) == ((1, 106), 5, spec.bos_token_id)


def test_the_outer_tie_word_embeddings_is_the_one_transformers_obeys() -> None:
    text = transformers.Gemma3TextConfig(**GEMMA_3_27B_TEXT | {"num_hidden_layers": 1, "tie_word_embeddings": True})
    config = transformers.Gemma3Config(text_config=text.to_dict(), tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Gemma3ForConditionalGeneration(config)
    assert model.lm_head.weight is not model.model.language_model.embed_tokens.weight
    assert not parsed(config.to_dict()).tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"text_config": None}, {"text_config"}),
        ({"text_config": [1]}, {"text_config"}),
        ({"text_config": GEMMA_3_27B_TEXT | {"model_type": "gemma2"}}, {"text_config.model_type"}),
        ({"text_config": GEMMA_3_27B_TEXT | {"num_key_value_heads": 3}}, {"text_config.num_key_value_heads"}),
        ({"text_config": GEMMA_3_27B_TEXT | {"rope_theta": 0}}, {"text_config.rope_theta"}),
        ({"text_config": GEMMA_3_27B_TEXT | {"eos_token_id": "1"}}, {"text_config.eos_token_id"}),
        ({"num_hidden_layers": 2, "vocab_size": 128}, {"num_hidden_layers", "vocab_size"}),
        ({"eos_token_id": -1}, {"eos_token_id"}),
    ],
)
def test_each_problem_of_a_multimodal_config_names_its_field(change: dict[str, Any], fields: set[str]) -> None:
    """Problems of the language model are named under text_config; a language-model key at the top
    level (where transformers would not read it either) is refused, not ignored."""
    error = failure({"model_type": "gemma3", "text_config": GEMMA_3_27B_TEXT} | change)
    assert error.fields() == fields
    if "vocab_size" in fields:
        assert all(p.fix == f"set text_config.{p.field} instead" for p in error.problems)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 25 + ["chunked_attention"]}, "layer_types"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"sliding_window": None}, "sliding_window"),
        ({"sliding_window": -512}, "sliding_window"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"final_logit_softcapping": -30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        ({"rope_local_base_freq": 0}, "rope_local_base_freq"),
        ({"rope_theta": "1e6"}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "mrope"}}, "rope_scaling.rope_type"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 0, "rope_theta": 1e6}}},
            "rope_parameters.full_attention.factor",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_theta": -1}}},
            "rope_parameters.sliding_attention.rope_theta",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
        ({"hidden_activation": "tanh"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"head_dim": 0}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_each_problem_names_its_field(change: dict[str, Any], field: str) -> None:
    assert [p.field for p in failure(GEMMA_3_1B | change).problems] == [field]


def test_every_problem_is_reported_at_once() -> None:
    raw = GEMMA_3_1B | {"sliding_window": 0, "query_pre_attn_scalar": -1, "rope_local_base_freq": None, "vocab_size": 0}
    raw |= {"layer_types": ["global"] * 26, "rope_scaling": {"rope_type": "linear", "factor": -8}}
    assert failure(raw).fields() == {"query_pre_attn_scalar", "vocab_size", "layer_types", "rope_scaling.factor"}
    raw["layer_types"] = None
    assert "sliding_window" in failure(raw).fields()


@pytest.mark.parametrize(
    "raw",
    [GEMMA_3_1B, GEMMA_3_27B_TEXT, GEMMA_3_1B | {"tie_word_embeddings": False, "attention_bias": True}],
    ids=["1b", "27b-text", "1b-untied-biased"],
)
def test_num_params_is_transformers_count(raw: dict[str, Any]) -> None:
    """Four norms a layer and two per head: gemma-3-1b has 999,885,952 parameters."""
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(raw))
    count = sum({id(p): p.numel() for p in model.parameters()}.values())
    assert parsed(raw).num_params() == count
    if raw is GEMMA_3_1B:
        assert count == 999_885_952

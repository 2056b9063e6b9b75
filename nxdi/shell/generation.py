"""HuggingFaceGenerationAdapter: transformers' `generate()` driving an nxdi causal LM.

transformers resolves the generation config, logits processors, stopping criteria and streamer;
the adapter replaces the decoding loop (`_sample`, used for greedy and multinomial decoding) with
one that runs the model's context-encoding step once and then one token-generation step per token,
on the model's own KV cache. Prompts may be padded on either side.

Sampling (REFERENCE §7, with nxdi's deliberate differences):
- Without on-device sampling the model returns logits; the logits processors run on the host and
  tokens are picked as transformers does (argmax, or multinomial from the processed scores).
- With on-device sampling the model returns tokens. `generation_config`'s top_k / top_p /
  temperature become the per-row `sampling_params` (a `sampling_params` kwarg, when given, is
  honoured instead). Logits processors that cannot run on the device (repetition penalty,
  min length, bad words, ...) run on the host when the model also returns logits
  (`output_logits=True`); otherwise generate() refuses them with a clear error instead of
  silently ignoring them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nxdi.shell import fused_generation, medusa, speculative
from nxdi.shell.causal_lm import NeuronBaseForCausalLM
from nxdi.shell.exceptions import IncompatibleConfigError

_DEVICE_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
"""Processors that on-device sampling applies itself, through sampling_params."""

_SPEC_STOPS = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})
"""The stopping criteria speculative decoding applies itself (max_new_tokens, eos_token_id)."""


def _hf_config(model: NeuronBaseForCausalLM) -> PretrainedConfig:
    data = {k: v for k, v in model.config.hf_dict().items() if not k.startswith("_")}
    if isinstance(data.get("text_config"), dict):
        # A multimodal model's language model, a config of its own as in transformers, so that
        # generate() takes the token ids it lacks at the top level from it, as transformers does.
        data["text_config"] = PretrainedConfig(**data["text_config"])
    config = PretrainedConfig(**data)
    config.is_encoder_decoder = False
    return config


class HuggingFaceGenerationAdapter(PreTrainedModel, GenerationMixin):
    """Wrap a loaded nxdi causal LM so `generate()` works as with a transformers model.

    Args:
        model: a compiled-and-loaded (or `to_cpu()`) NeuronBaseForCausalLM.
        input_start_offsets: accepted for NxDI compatibility; prompts are located from the
            attention mask, so offsets are not needed.
    """

    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, model: NeuronBaseForCausalLM, input_start_offsets: list[int] | None = None) -> None:
        if isinstance(model, PretrainedConfig):  # transformers-neuronx's (config, model) order
            raise TypeError(
                "HuggingFaceGenerationAdapter(config, model) is transformers-neuronx's signature; nxdi's adapter "
                "takes the model alone and reads its config from it. Fix: HuggingFaceGenerationAdapter(model), or "
                "for a transformers-neuronx model nxdi.shell.tnx.HuggingFaceGenerationModelAdapter(config, model)"
            )
        if not isinstance(model, NeuronBaseForCausalLM) and hasattr(model, "nxdi_model"):  # nxdi.shell.tnx's
            raise TypeError(
                f"HuggingFaceGenerationAdapter(model): got transformers-neuronx's {type(model).__name__}. Fix: "
                "HuggingFaceGenerationAdapter(model.nxdi_model), or HuggingFaceGenerationModelAdapter(config, model)"
            )
        super().__init__(_hf_config(model))
        self.neuron_model = model
        self.input_start_offsets = input_start_offsets
        self.generation_config = GenerationConfig.from_model_config(self.config)
        self._dummy = torch.nn.Parameter(torch.zeros(0), requires_grad=False)  # gives the adapter a device

    def forward(
        self,
        input_ids: Tensor | None = None,
        seq_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        sampling_params: Tensor | None = None,
        adapter_ids: Any = None,
        **kwargs: Any,
    ) -> Any:
        """The wrapped model's forward. The parameters are named because transformers' generate()
        accepts only the model kwargs it finds in this signature (`sampling_params=` and, for
        multi-LoRA serving, `adapter_ids=`: one adapter name or index per prompt)."""
        return self.neuron_model.forward(
            input_ids,
            seq_ids=seq_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            sampling_params=sampling_params,
            adapter_ids=adapter_ids,
            **kwargs,
        )

    def can_generate(self) -> bool:  # type: ignore[override]
        return True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """False: the wrapped model keeps its own KV cache, so generate() builds no transformers cache.
        (One built from the generic config would also fail for families whose layer count is not
        `num_hidden_layers`, such as DBRX's `n_layers`.)"""
        return False

    def _sampling_rows(self, generation_config: GenerationConfig, batch: int, given: Tensor | None) -> Tensor:
        if given is not None:
            return torch.as_tensor(given, dtype=torch.float32)
        if not generation_config.do_sample:
            return torch.tensor([[1.0, 1.0, 1.0]] * batch)
        top_k = generation_config.top_k if generation_config.top_k is not None else 0
        top_p = generation_config.top_p if generation_config.top_p is not None else 1.0
        temperature = generation_config.temperature if generation_config.temperature is not None else 1.0
        return torch.tensor([[float(top_k), float(top_p), float(temperature)]] * batch)

    def _host_processors(self, logits_processor: LogitsProcessorList, generation_config: GenerationConfig) -> bool:
        """Whether tokens must be picked on the host from logits (raising when that is impossible)."""
        spec = self.neuron_model.spec
        ods = spec.on_device_sampling_config
        if ods is None:
            return True
        extra = [type(p).__name__ for p in logits_processor if not isinstance(p, _DEVICE_WARPERS)]
        samples_on_device = ods.do_sample or ods.dynamic
        needs_host = bool(extra) or (generation_config.do_sample and not samples_on_device)
        if needs_host and not spec.output_logits:
            # Each case names only the fixes that work for it: a processor the device lacks runs
            # on the host only (do_sample / dynamic on device would refuse it again).
            if extra:
                why = f"logits processors {extra} cannot run inside the compiled model"
                fix = "compile with output_logits=True so they run on the host, or drop those options"
            else:
                why = (
                    "generation_config.do_sample=True but the model samples greedily on device "
                    "(on_device_sampling_config has do_sample=False and dynamic=False)"
                )
                fix = (
                    "compile with on_device_sampling_config(do_sample=True) or dynamic=True, or with "
                    "output_logits=True to sample on the host, or generate with do_sample=False"
                )
            raise IncompatibleConfigError(f"generate(): {why}. Fix: {fix}")
        return needs_host

    def _assisted_decoding(  # type: ignore[override]
        self,
        input_ids: Tensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer: Any = None,
        inputs_tensor: Tensor | None = None,
        assistant_model: Any = None,
        assistant_tokenizer: Any = None,
        tokenizer: Any = None,
        **model_kwargs: Any,
    ) -> Tensor | GenerateDecoderOnlyOutput:
        """`generate(..., assistant_model=draft)`: speculative decoding with a draft nxdi model (or
        its adapter) on this model's speculation programs (`nxdi.shell.speculative`); on a fused
        model (its draft inside), its own loop (`nxdi.shell.fused_generation`); for a Medusa model
        (is_medusa=True), the model itself (or its adapter) as the assistant: Medusa decoding
        (`nxdi.shell.medusa`, greedy only)."""
        if self.neuron_model._fused is not None:
            if assistant_model not in (None, self, self.neuron_model):
                raise IncompatibleConfigError(
                    "generate(assistant_model=...): this model runs its own draft (enable_fused_speculation). "
                    "Fix: call generate() without assistant_model"
                )
            args = (logits_processor, stopping_criteria, generation_config, streamer, model_kwargs)
            return fused_generation.decode(self, input_ids, *args)
        draft = getattr(assistant_model, "neuron_model", assistant_model)
        medusa_model = self.neuron_model.spec.is_medusa
        if not medusa_model and not isinstance(draft, NeuronBaseForCausalLM):
            raise IncompatibleConfigError(
                f"generate(assistant_model=...): got {type(assistant_model).__name__}; pass a loaded nxdi "
                "causal LM (or its HuggingFaceGenerationAdapter) as the draft"
            )
        unsupported = [type(p).__name__ for p in logits_processor if not isinstance(p, _DEVICE_WARPERS)]
        unsupported += [type(c).__name__ for c in stopping_criteria if type(c).__name__ not in _SPEC_STOPS]
        if streamer is not None:
            unsupported.append("streamer")
        if generation_config.return_dict_in_generate and (
            generation_config.output_scores or generation_config.output_logits
        ):
            unsupported.append("output_scores/output_logits")
        if medusa_model and generation_config.do_sample:
            unsupported.append("do_sample=True (Medusa decoding is greedy)")
        if unsupported:
            runs = "greedy decoding" if medusa_model else "temperature / top_k / top_p"
            raise IncompatibleConfigError(
                f"generate() with assistant_model: {unsupported} are not supported with speculative decoding; "
                f"it runs {runs}, max_new_tokens / max_length and eos_token_id. "
                "Fix: drop them, or generate without assistant_model"
            )
        batch, width = input_ids.shape
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        params = self._sampling_rows(generation_config, batch, None) if generation_config.do_sample else None
        eos = generation_config._eos_token_tensor
        pad = generation_config._pad_token_tensor
        if medusa_model:
            medusa.check_model(self.neuron_model, draft, batch=batch)
            new, self.speculation_stats = medusa.generate(
                self.neuron_model,
                input_ids,
                mask,
                max_new_tokens=generation_config.max_length - width,
                eos_token_id=None if eos is None else int(eos.reshape(-1)[0]),
                pad_token_id=0 if pad is None else int(pad),
            )
            sequences = torch.cat([input_ids, new], dim=-1)
            return (
                GenerateDecoderOnlyOutput(sequences=sequences)
                if generation_config.return_dict_in_generate
                else sequences
            )
        seed = int(torch.randint(0, 2**62, (1,)))  # torch.manual_seed() makes a sampled run repeatable
        new, self.speculation_stats = speculative.generate(
            self.neuron_model,
            draft,
            input_ids,
            mask,
            max_new_tokens=generation_config.max_length - width,
            params=params,
            eos_token_id=None if eos is None else int(eos.reshape(-1)[0]),
            pad_token_id=0 if pad is None else int(pad),
            generator=torch.Generator().manual_seed(seed),
        )
        sequences = torch.cat([input_ids, new], dim=-1)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _sample(  # type: ignore[override]
        self,
        input_ids: Tensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> Tensor | GenerateDecoderOnlyOutput:
        model = self.neuron_model
        if model._fused is not None:  # the draft runs inside the model: its fused loop
            args = (logits_processor, stopping_criteria, generation_config, streamer, model_kwargs)
            return fused_generation.decode(self, input_ids, *args)
        batch, prompt_width = input_ids.shape
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        # Tokens each prompt leaves in the KV cache: a prompt past the largest context bucket is cut
        # to its first tokens under allow_input_truncation (and refused by forward() otherwise).
        positions = mask.to(torch.int64).sum(-1, keepdim=True).clamp(max=model.context_capacity)  # [B, 1]
        longest = int(positions.max())
        new_tokens = generation_config.max_length - prompt_width
        if longest + new_tokens - 1 > model.spec.max_length:
            raise IncompatibleConfigError(
                f"generate(): a {longest}-token prompt plus {new_tokens} new tokens needs {longest + new_tokens - 1} "
                f"positions, more than max_length={model.spec.max_length} (seq_len). Fix: raise seq_len, "
                "or lower max_new_tokens / max_length"
            )
        if new_tokens > 1:  # every token after the first comes from a token-generation step
            model.check_token_generation(f"generate() of {new_tokens} new tokens without assistant_model")
        rows = self._sampling_rows(generation_config, batch, model_kwargs.get("sampling_params"))
        # adapter names become NxDI's indices once (convert_adapter_ids_to_indices), checked before any step
        adapters = model.adapter_indices(model_kwargs.get("adapter_ids"), batch)
        host = self._host_processors(logits_processor, generation_config)
        pad = generation_config._pad_token_tensor
        has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
        scores: list[Tensor] = []
        raw: list[Tensor] = []
        unfinished = torch.ones(batch, dtype=torch.long)
        model.reset()
        out = model.forward(input_ids, attention_mask=mask, sampling_params=rows, adapter_ids=adapters)
        while True:
            logits = out.logits[:, -1].float() if out.logits is not None else None
            processed = logits_processor(input_ids, logits) if logits is not None else None
            if host:
                assert processed is not None
                if generation_config.do_sample:
                    probs = torch.softmax(processed, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(processed, dim=-1)
            else:
                next_tokens = out.tokens.to(torch.long)
            if want_scores and processed is not None:
                scores.append(processed)
            if want_logits and logits is not None:
                raw.append(logits)
            if has_eos and pad is not None:
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            unfinished = unfinished & ~stopping_criteria(input_ids, tuple(scores) or None)
            if int(unfinished.max()) == 0:
                break
            out = model.forward(
                next_tokens[:, None], position_ids=positions, sampling_params=rows, adapter_ids=adapters
            )
            positions = positions + 1
        if streamer is not None:
            streamer.end()
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(
                sequences=input_ids, scores=tuple(scores) or None, logits=tuple(raw) or None
            )
        return input_ids

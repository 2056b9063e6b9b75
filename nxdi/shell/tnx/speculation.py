"""transformers-neuronx's `SpeculativeGenerator`: speculative sampling with a draft model, on nxdi's loop.

`target.enable_speculative_decoder(k)` (before `to_neuron()`) compiles the target's speculation
programs (nxdi's `speculation_length=k`); `SpeculativeGenerator(draft, target, k).sample(input_ids,
sequence_length)` then runs nxdi's draft-model speculation (`nxdi.shell.speculative`) with
transformers-neuronx's default acceptor, DeepMind's speculative sampling over the whole vocabulary
at temperature 1: its tokens follow the target's own distribution.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nxdi.shell import speculative
from nxdi.shell.exceptions import IncompatibleConfigError
from nxdi.shell.tnx.model import SamplingModel


class SpeculativeGenerator:
    """Draft proposes k-1 tokens, target scores k, speculative sampling accepts a prefix.

    Raises:
        IncompatibleConfigError: a draft or target that is not a transformers-neuronx model, a
            target without `enable_speculative_decoder(k)`, or a custom acceptor.
    """

    def __init__(self, draft: Any, target: Any, k: int = 4, acceptor: Any = None) -> None:
        problems = []
        for name, model in (("draft", draft), ("target", target)):
            if not isinstance(model, SamplingModel):
                problems.append(
                    f"{name}: a {type(model).__name__}, not a transformers-neuronx model (LlamaForSampling, ...)"
                )
        if isinstance(target, SamplingModel) and target.nxdi_model.spec.speculation_length != k:
            problems.append(
                f"k={k}: the target was built with speculation_length={target.nxdi_model.spec.speculation_length}; "
                f"call target.enable_speculative_decoder({k}) before to_neuron()"
            )
        if acceptor is not None:
            problems.append("acceptor: custom token acceptors are not supported; nxdi runs speculative sampling")
        if problems:
            raise IncompatibleConfigError("SpeculativeGenerator: " + "; ".join(problems))
        self.draft = draft
        self.target = target
        self.k = k
        self.stats: dict[str, int] = {}
        """The last sample()'s counts: target steps, tokens emitted, draft tokens proposed and accepted."""

    def sample(
        self,
        input_ids: Tensor,
        sequence_length: int,
        start_ids: Tensor | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = 0,
        attention_mask: Tensor | None = None,
        streamer: Any = None,
        output_logits: bool = False,
    ) -> Tensor:
        """[B, <= sequence_length] ids (prompts included); a row past EOS is padded with pad_token_id.
        Randomness comes from the global torch RNG (`torch.manual_seed` repeats a run).

        Raises:
            IncompatibleConfigError: start_ids, a streamer or output_logits (not supported with
                speculation), or a sequence past the models' n_positions.
        """
        unsupported = [
            name
            for name, given in (
                ("start_ids", start_ids),
                ("streamer", streamer),
                ("output_logits", output_logits or None),
            )
            if given is not None
        ]
        if unsupported:
            raise IncompatibleConfigError(
                f"SpeculativeGenerator.sample(): {', '.join(unsupported)} are not supported with speculation. "
                "Fix: drop them, or use the target's own sample()"
            )
        if sequence_length <= input_ids.shape[1]:  # nothing to generate, as in sample()
            return input_ids
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        batch = input_ids.shape[0]
        params = torch.tensor([[0.0, 1.0, 1.0]] * batch)  # whole vocabulary, top_p 1, temperature 1
        seed = int(torch.randint(0, 2**62, (1,)))
        new, self.stats = speculative.generate(
            self.target.nxdi_model,
            self.draft.nxdi_model,
            input_ids,
            mask,
            max_new_tokens=sequence_length - input_ids.shape[1],
            params=params,
            eos_token_id=eos_token_id,
            pad_token_id=0 if pad_token_id is None else pad_token_id,
            generator=torch.Generator().manual_seed(seed),
        )
        return torch.cat([input_ids, new], dim=-1)

"""Hypothesis strategies for nxdi's values, so users can property-test their own configurations
(and nxdi's own tests draw from the same place). Requires the `hypothesis` package (the `dev` extra).

Modules, one per kind of value:
- `neuron_configs`: NeuronConfig kwargs, valid (`neuron_kwargs`, `neuron_specs`) and with one known
  problem (`invalid_neuron_kwargs`), and on-device sampling configs.
- `hf_configs`: Hugging Face `config.json` dicts with the ModelSpec they must parse to
  (`llama_like_cases`, `llama_configs`, `model_specs`), and broken ones (`broken_configs`).
- `plans`: bucket tables, GQA head configurations, small model specs of any kind for the planners.
- `decoders`: tiny decoder specs the CPU programs run, and random weights for them.

The most used ones are importable from here.
"""

from nxdi.testing.strategies.hf_configs import broken_configs, llama_configs, llama_like_cases, model_specs
from nxdi.testing.strategies.neuron_configs import invalid_neuron_kwargs, neuron_kwargs, neuron_specs

__all__ = [
    "broken_configs",
    "invalid_neuron_kwargs",
    "llama_configs",
    "llama_like_cases",
    "model_specs",
    "neuron_kwargs",
    "neuron_specs",
]

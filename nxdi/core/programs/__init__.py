"""Pure tensor programs: decoder forward passes and the on-device sampler. Pure.

Every program is a function of tensors and frozen specs, `forward(weights, cache, inputs, *, spec)
-> (outputs, cache)`: equal inputs give equal outputs, nothing is mutated, randomness is an input
tensor, and shapes (batch, bucket length) come from the tensors, never from module state. The same
functions run eagerly on CPU, trace with `torch.export`, and compile with `torch.compile(fullgraph=True)`.

Dimension letters, used in shape comments and docstrings:

    B  batch rows (sequences)
    S  active tokens in this step (the context bucket in context encoding, 1 in token generation)
    T  cache positions visible to this step (the bucket length of the cache view)
    H  query heads
    K  key/value heads (H = K * G, G query heads share one kv head)
    G  query heads per kv head
    D  head dim
    E  hidden size
    F  MLP intermediate size
    V  vocabulary
    L  layers
    C  sampling candidates (global top-k)
    X  experts of a mixture of experts (k of them chosen per token)

Values that hold tensors (`KVCache`, `StepInputs`, `decoder.DecoderWeights`) are frozen dataclasses with
`eq=False` and slots, not `attrs.frozen` classes: TorchDynamo cannot trace the `__init__` attrs
generates for frozen classes (it assigns through `object.__setattr__`), and a program builds a new
cache value inside the graph, so `torch.compile(fullgraph=True)` would break. They stay immutable
and keyword-only, and compare with `torch.testing.assert_close` on their tensors.

Modules: `layers` (norms, RoPE, attention, MLP), `kv_cache` (the KVCache value and its writes),
`inputs` (StepInputs), `decoder` (the decoder: Llama and every family that is Llama plus ModelSpec
fields), `moe` (the mixture-of-experts block) and `moe_settings` (its MoENeuronConfig settings and
routing outputs), `step` (a decoder step plus the sampler), `sampling`, `speculation` (draft
verification), `token_tree` (tree attention, candidates, tree acceptance and KV compaction),
`medusa` (Medusa heads and tree steps), `eagle` (the EAGLE draft: the decoder fed its target's
hidden states), `fused_speculation` (draft and target in one step), `eagle_fused` and `eagle_tree`
(EAGLE's fused steps: a flat draft, a token tree), `lora` (multi-LoRA serving: stacked adapters,
each batch row's selected by its slot), and `catalog` (which program runs a family). Host-side tensor helpers that are never traced live in `nxdi.core.host`.
"""

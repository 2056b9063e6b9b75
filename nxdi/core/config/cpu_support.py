"""What the CPU engine, and each backend, cannot run yet. Pure.

`check_cpu_support` lists every setting a spec moves off its default that the CPU engine does not
implement (declared `OnCpu.REFUSED` in `nxdi.core.config.neuron_spec`, sub-configs included), and
the combinations it cannot run (block KV with ranks, quantized weights, the speculation methods,
multi-LoRA serving), so nothing a user asks for is silently dropped; `check_backend_support` what
the HLO backends cannot lower. The rules of a spec alone are `nxdi.core.config.neuron_checks`.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
from returns.result import Result, Success

from nxdi.core.config.fields import OnCpu, infos, sub_spec_fields
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.config.sub_specs import LoraSpec
from nxdi.core.errors import ConfigError, Problem, problems_result
from nxdi.core.planning import block_programs, buckets, medusa


def check_cpu_support(spec: NeuronSpec) -> Result[NeuronSpec, ConfigError]:
    """Fail listing every setting the CPU engine does not implement yet (declared `OnCpu.REFUSED`)
    that `spec` moves off its default, so nothing a user asks for is silently dropped, what the
    block KV layout cannot run with at tp_degree > 1 (`_block_kv_with_ranks`), and what quantized
    weights cannot (`_quantized_weights`)."""
    fields = attrs.fields_dict(NeuronSpec)
    problems = [
        Problem.of(
            name,
            getattr(spec, name),
            "is not supported by the CPU engine yet",
            f"set {name}={fields[name].default!r}",
        )
        for name, info in infos(NeuronSpec).items()
        if info.cpu is OnCpu.REFUSED and getattr(spec, name) != fields[name].default
    ]
    problems.extend(_refused_sub_fields(spec))
    problems.extend(_block_kv_with_ranks(spec))
    problems.extend(_quantized_weights(spec))
    problems.extend(_speculation_programs(spec))
    problems.extend(_fused_programs(spec))
    problems.extend(medusa.cpu_problems(spec))
    problems.extend(_eagle_draft_alone(spec))
    problems.extend(_token_generation_off(spec))
    problems.extend(_lora_programs(spec))
    return problems_result(spec, problems)


def _lora_programs(spec: NeuronSpec) -> Iterator[Problem]:
    """What multi-LoRA serving (`lora_config`) does not run with on the CPU engine yet: the block KV
    layout, speculation (the draft and the speculation programs take no adapters) and Medusa, and
    async_mode with dynamic_multi_lora; each named with its fix."""
    if spec.lora_config is None:
        return
    others = (
        ("is_block_kv_layout", True, spec.is_block_kv_layout, False),
        ("speculation_length", spec.speculation_length, spec.speculation_length > 0, 0),
        ("enable_fused_speculation", True, spec.enable_fused_speculation, False),
        ("is_medusa", True, spec.is_medusa, False),
    )
    for name, value, on, default in others:
        if on:
            why = "does not run with multi-LoRA serving (lora_config) on the CPU engine yet"
            yield Problem.of(name, value, why, f"set {name}={default!r}, or lora_config=None")
    yield from _dynamic_only(spec.lora_config)
    if spec.lora_config.dynamic_multi_lora and spec.async_mode:
        # A step launched ahead would read slots a later placement is rewriting.
        why = "swaps adapters into the weights between steps, which async_mode runs ahead of"
        yield Problem.of("async_mode", True, why, "set async_mode=False, or lora_config.dynamic_multi_lora=False")


def _dynamic_only(cfg: LoraSpec) -> Iterator[Problem]:
    """The host-adapter settings, which take effect with dynamic_multi_lora only (and the LFU decay
    with the lfu policy only): set otherwise they would be ignored, so they are refused."""
    defaults = attrs.fields_dict(LoraSpec)
    if not cfg.dynamic_multi_lora:
        for name in ("lora_ckpt_paths_cpu", "eviction_policy", "lfu_decay_period"):
            value = getattr(cfg, name)
            if value != defaults[name].default:
                why = "serves dynamic multi-LoRA only, and dynamic_multi_lora is False"
                shown = len(value.items) if name == "lora_ckpt_paths_cpu" else value
                fix = f"set lora_config.dynamic_multi_lora=True, or unset {name}"
                yield Problem.of(f"lora_config.{name}", shown, why, fix)
    elif cfg.eviction_policy != "lfu" and cfg.lfu_decay_period != defaults["lfu_decay_period"].default:
        why = f"decays LFU counts, but eviction_policy={cfg.eviction_policy!r}"
        fix = "set lora_config.eviction_policy='lfu', or unset lfu_decay_period"
        yield Problem.of("lora_config.lfu_decay_period", cfg.lfu_decay_period, why, fix)


def _fused_programs(spec: NeuronSpec) -> Iterator[Problem]:
    """What fused speculation does not run with on the CPU engine: the block KV layout (its
    programs are the block buckets'), tensor parallelism (the fused programs run on one rank), a
    mixture of experts' routing outputs (a fused step returns none), and no on-device sampling
    (acceptance runs inside the program, so the program picks the tokens, as NxDI requires)."""
    if not spec.enable_fused_speculation:
        return
    # EAGLE runs as fused speculation: name the setting the user gave
    setting = "enable_eagle_speculation=True" if spec.enable_eagle_speculation else "enable_fused_speculation=True"
    why = f"does not run with {setting} on the CPU engine yet"
    if spec.is_block_kv_layout:
        yield Problem.of("is_block_kv_layout", True, why, "set is_block_kv_layout=False (the contiguous KV cache)")
    if spec.tp_degree > 1:
        why_tp = f"{why}: its programs run the target and the draft on one rank"
        fix = "set tp_degree=1" + ("" if spec.enable_eagle_speculation else ", or use a separate draft model")
        yield Problem.of("tp_degree", spec.tp_degree, why_tp, fix)
    for name in ("return_router_logits", "return_expert_index"):
        if spec.moe is not None and getattr(spec.moe, name):
            yield Problem.of(name, True, f"{why}: a fused step returns tokens, not routing", f"set {name}=False")
    if spec.on_device_sampling_config is None:
        why = "is required with enable_fused_speculation=True: the fused program accepts and picks the tokens itself"
        fix = "set on_device_sampling_config (e.g. {'top_k': 1} for greedy, do_sample=True or dynamic=True to sample)"
        yield Problem.of("on_device_sampling_config", None, why, fix)


def _eagle_draft_alone(spec: NeuronSpec) -> Iterator[Problem]:
    """An EAGLE draft cannot run as a model of its own: every step needs its target's hidden states
    (its weights still load: `get_state_dict` reads the draft's layout)."""
    if spec.is_eagle_draft:
        why = "marks an EAGLE draft, which runs only inside EAGLE speculation, fed its target's hidden states"
        fix = "give its config to the target's fused_spec_config as draft_config (enable_eagle_speculation=True)"
        yield Problem.of("is_eagle_draft", True, why, fix)


def _token_generation_off(spec: NeuronSpec) -> Iterator[Problem]:
    """trace_tokengen_model=False drops the token-generation programs of the padded cache layout;
    the block KV layout's programs and async_mode's decode steps launched ahead have no such form."""
    if spec.trace_tokengen_model or spec.enable_fused_speculation:
        return
    for name, on in (("is_block_kv_layout", spec.is_block_kv_layout), ("async_mode", spec.async_mode)):
        if on:
            why = f"does not run with {name}=True on the CPU engine (it needs token-generation programs)"
            yield Problem.of("trace_tokengen_model", False, why, f"set trace_tokengen_model=True, or {name}=False")


def _speculation_programs(spec: NeuronSpec) -> Iterator[Problem]:
    """What the speculation programs (`speculation_length` > 0) do not run with yet: the block KV
    layout (whose programs are the block buckets') and async_mode (whose next step assumes one
    token per row)."""
    if spec.speculation_length <= 0 or spec.enable_fused_speculation:
        return
    for name, on in (("is_block_kv_layout", spec.is_block_kv_layout), ("async_mode", spec.async_mode)):
        if on:
            why = f"does not run with speculation_length={spec.speculation_length} on the CPU engine yet"
            yield Problem.of(name, True, why, f"set {name}=False, or speculation_length=0")


def _quantized_weights(spec: NeuronSpec) -> Iterator[Problem]:
    """What quantized weights cannot run with on the CPU engine: MXFP4 (a Neuron compute format),
    and blockwise scales whose blocks are not one [rows, columns] grid over each linear weight. (A
    rank whose share of a weight cuts its blocks is refused by `rank_weights.block_problems`.)"""
    if not spec.quantized:
        return
    if spec.quantization_dtype == "mxfp4":
        fix = "use quantization_dtype int8, f8e4m3 or f8e5m2"
        yield Problem.of("quantization_dtype", "mxfp4", "is a Neuron MXFP4 compute format the CPU engine lacks", fix)
    if spec.quantization_type != "blockwise_symmetric":
        return
    axes, sizes = spec.quantization_block_axis or (), spec.quantization_block_size or ()
    fix = "set quantization_block_axis and quantization_block_size, one size per axis, e.g. [1] and [128]"
    if not axes or len(axes) != len(sizes):
        yield Problem.of("quantization_block_size", sizes, f"needs one size per block axis {list(axes)}", fix)
    elif any(a not in (-2, -1, 0, 1) for a in axes) or len({a % 2 for a in axes}) != len(axes):
        why = "must name distinct axes of a [out, in] linear weight (0 or -2, 1 or -1)"
        yield Problem.of("quantization_block_axis", axes, why, fix)


HLO_BACKENDS = ("xla", "neuron")
"""The backends that lower programs to HLO with torch-xla (the neuron backend compiles that HLO)."""


def check_backend_support(spec: NeuronSpec, backend: str) -> Result[NeuronSpec, ConfigError]:
    """What the backend named `backend` cannot run, beyond what `check_cpu_support` refuses:
    dynamic multi-LoRA runs on the cpu backend only (its adapters are copied into the host tensors
    the cpu backend binds).

    Returns:
        `Failure` naming dynamic multi-LoRA and the fix, on the xla and neuron backends.
    """
    if backend not in HLO_BACKENDS or spec.lora_config is None or not spec.lora_config.dynamic_multi_lora:
        return Success(spec)
    # The adapters are copied into the bound host tensors; these backends bind device copies.
    why = f"runs on the cpu backend only yet, not {backend}: adapters are swapped into host-bound weights"
    fix = "use the cpu backend, or load every adapter at load() (dynamic_multi_lora=False)"
    return problems_result(spec, [Problem.of("lora_config.dynamic_multi_lora", True, why, fix)])


def _refused_sub_fields(spec: NeuronSpec) -> Iterator[Problem]:
    """The `OnCpu.REFUSED` fields of the sub-configs `spec` sets (a sub-config the CPU engine
    supports, such as kv_quant_config, may still hold a setting it refuses), named `config.field`."""
    for name, cls in sub_spec_fields(NeuronSpec).items():
        sub = getattr(spec, name)
        if sub is None:
            continue
        defaults = attrs.fields_dict(cls)
        for field, info in infos(cls).items():
            value = getattr(sub, field)
            if info.cpu is OnCpu.REFUSED and value != defaults[field].default:
                why = "is not supported by the CPU engine yet" + (f": {info.cpu_note}" if info.cpu_note else "")
                yield Problem.of(f"{name}.{field}", value, why, f"set {name}.{field}={defaults[field].default!r}")


def _block_kv_with_ranks(spec: NeuronSpec) -> Iterator[Problem]:
    """What the block KV layout cannot run with at tp_degree > 1 (every rank holds its KV heads of
    every block; ranks run in rank processes on the cpu backend, or under torchrun):

    - flash decoding, which splits a sequence's cache over ranks, where a block cache keeps every
      position of a KV head on one rank;
    - sequence parallelism over a block program whose token count tp_degree does not divide: the
      automatic chunked-prefill chunks are multiples of kernel_q_tile_size, not context buckets,
      which `nxdi.core.planning.partition.check_partition` checks (not repeated here).
    """
    tp = spec.tp_degree
    if not spec.is_block_kv_layout or tp == 1:
        return
    if spec.flash_decoding_enabled:
        why = f"splits each sequence's KV cache over ranks, which the block KV layout does not (tp_degree={tp})"
        yield Problem.of("flash_decoding_enabled", True, why, "disable flash decoding, or use the contiguous KV cache")
    plan, context = block_programs.block_plan(spec), buckets.context_table_for(spec)
    if spec.sequence_parallel_enabled and isinstance(plan, Success):
        checked = set(context.unwrap().lengths) if isinstance(context, Success) else set()
        programs = plan.unwrap().keys()  # ProgramKeys, not a mapping
        odd = sorted({k.tokens for k in programs if k.tokens > 1 and k.tokens % tp} - checked)
        if odd:
            why = f"cannot split the block programs of {odd} tokens over tp_degree={tp}"
            fix = f"make the chunk lengths multiples of {tp} (kernel_q_tile_size or context_encoding_buckets), or disable sequence parallelism"
            yield Problem.of("sequence_parallel_enabled", True, why, fix)

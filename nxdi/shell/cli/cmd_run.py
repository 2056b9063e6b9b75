"""`nxdi run`: compile (or reuse), load and generate with a model, like NxDI's inference demo.

    nxdi run --model-type llama --model-path MODEL --compiled-model-path OUT --prompt "Hello"
             [--input-ids "1 2 3"] [NeuronConfig flags: --batch-size 2 --seq-len 256 ...]
             [--on-device-sampling --do-sample --top-k 50 --top-p 0.9 --temperature 0.7]
             [--max-new-tokens N] [--check-accuracy-mode {skip-accuracy-check,token-matching,logit-matching}]
             [--backend cpu|xla|neuron]
             [--benchmark]

Prompts are text (encoded with the tokenizer found in --model-path or --tokenizer-path) or
token ids (`--input-ids`, one flag per row), for checkpoints that ship no tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from nxdi.core import families
from nxdi.effects.backends import NAMES as BACKENDS
from nxdi.shell.cli import checks
from nxdi.shell.cli.errors import UsageError
from nxdi.shell.cli.flags import add_neuron_config_flags, neuron_config_kwargs

ACCURACY_MODES = ("skip-accuracy-check", "token-matching", "logit-matching")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="compile, load and generate with a model", allow_abbrev=False)
    runs = ", ".join(t for r in families.runnable() for t in r.model_types)
    p.add_argument("--model-type", default=None, help=f"{runs} (default: config.json's)")
    p.add_argument("--task-type", default="causal-lm", choices=["causal-lm"])
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--compiled-model-path", required=True, help="where compiled artifacts are written and read")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    p.add_argument("--input-ids", action="append", default=[], help='token ids of one prompt, e.g. "1 5 7"')
    p.add_argument("--skip-compile", action="store_true", help="load an existing compiled model")
    p.add_argument(
        "--repin-checkpoint",
        action="store_true",
        help="accept the original checkpoint as it is now, though it changed since compile (checked as compile does)",
    )
    p.add_argument("--backend", choices=BACKENDS, default=None, help="default: NXDI_BACKEND, else cpu")
    p.add_argument("--on-device-sampling", action="store_true", help="sample inside the compiled model")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--dynamic", action="store_true", help="per-row sampling params at run time")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--global-topk", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling random stream")
    p.add_argument("--check-accuracy-mode", choices=ACCURACY_MODES, default="skip-accuracy-check")
    p.add_argument("--num-tokens-to-check", type=int, default=None)
    p.add_argument("--divergence-difference-tol", type=float, default=0.001)
    p.add_argument("--benchmark", action="store_true", help="also report TTFT / TPOT / throughput")
    add_neuron_config_flags(p)
    p.set_defaults(run=run)


def _neuron_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = neuron_config_kwargs(args)
    if args.on_device_sampling:
        kwargs["on_device_sampling_config"] = {
            "do_sample": args.do_sample,
            "dynamic": args.dynamic,
            "deterministic": args.deterministic,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "temperature": args.temperature,
            "global_topk": args.global_topk,
        }
    return kwargs


def _tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer of --tokenizer-path (default --model-path), padding on the left.

    Raises:
        UsageError: there is none there.
    """
    from transformers import AutoTokenizer

    where = args.tokenizer_path or args.model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, padding_side="left")
    except (OSError, ValueError):  # transformers' ways of saying there is none
        flag = "--tokenizer-path" if args.tokenizer_path else "--model-path"
        fix = "give --tokenizer-path, or token ids with --input-ids '1 5 7'"
        raise UsageError(f"--prompt needs a tokenizer; {flag} {where!r} has none it can load. Fix: {fix}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _prompt_rows(args: argparse.Namespace) -> tuple[list[list[int]] | None, Any]:
    """(--input-ids as token rows, None) or (None, the tokenizer of --prompt), checked before any compile.

    Raises:
        UsageError: neither is given, an --input-ids value is empty or not integers, or --prompt
            has no tokenizer.
    """
    if args.prompt:
        return None, _tokenizer(args)
    if not args.input_ids:
        raise UsageError("give --prompt TEXT (with a tokenizer) or --input-ids 'ID ID ...'")
    return checks.token_rows(args.input_ids), None


def _inputs(args: argparse.Namespace, batch: int, rows: list[list[int]] | None, tokenizer: Any) -> tuple[Any, Any]:
    """(input_ids [B, W], attention_mask [B, W]), left padded like a tokenizer."""
    import torch

    if rows is None:
        prompts = (args.prompt * batch)[: max(batch, len(args.prompt))]
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        return enc["input_ids"], enc["attention_mask"]
    rows = (rows * batch)[: max(batch, len(rows))]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _build(args: argparse.Namespace, rows: list[list[int]] | None) -> Any:
    """Compile (unless --skip-compile) and load the model; every argument is checked before compiling
    (the output folder, the token ids against the vocabulary and max_context_length) or, with
    --skip-compile, before loading."""
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config

    cls = checks.model_class(args.model_type, args.model_path, args.task_type)
    compiled = Path(args.compiled_model_path)
    if not args.skip_compile:
        checks.output_folder(args.compiled_model_path)
        config = cls.get_config_cls()(
            NeuronConfig(**_neuron_kwargs(args)), load_config=load_pretrained_config(args.model_path)
        )
        if rows is not None:
            checks.check_vocab(rows, config.model_spec().vocab_size)
            checks.check_length(rows, config.neuron_config.spec)
        t = time.perf_counter()
        print(f"[nxdi run] compiling into {compiled} ...", flush=True)
        cls(args.model_path, config, backend=args.backend).compile(compiled)
        print(f"[nxdi run] compiled in {time.perf_counter() - t:.1f}s", flush=True)
    model = cls(compiled, backend=args.backend)
    if rows is not None:
        checks.check_vocab(rows, model.model_spec.vocab_size)
        checks.check_length(rows, model.spec)
    t = time.perf_counter()
    model.load(compiled, repin_checkpoint=args.repin_checkpoint)
    print(f"[nxdi run] loaded in {time.perf_counter() - t:.1f}s", flush=True)
    return model


def run(args: argparse.Namespace) -> int:
    """Raises the documented exceptions and UsageError (`nxdi` reports them, exit 2) and RankError (exit 1)."""
    rows, tokenizer = _prompt_rows(args)
    model = _build(args, rows)
    with model:  # stops the rank processes (tp_degree > 1) however the run ends
        return _generate(args, model, rows, tokenizer)


def _generate(args: argparse.Namespace, model: Any, rows: list[list[int]] | None, tokenizer: Any) -> int:
    from transformers import GenerationConfig

    from nxdi.shell.generation import HuggingFaceGenerationAdapter

    ids, mask = _inputs(args, model.spec.batch_size, rows, tokenizer)
    model.set_seed(args.seed)
    # --max-new-tokens is the NeuronConfig attribute (runtime-only, so it never forces a recompile).
    new = args.nc_max_new_tokens or model.spec.max_new_tokens or model.spec.max_length - int(mask.sum(-1).max())
    sampling = {"top_k": args.top_k, "top_p": args.top_p, "temperature": args.temperature} if args.do_sample else {}
    pad = model.model_spec.pad_token_id or 0
    gen = GenerationConfig(max_new_tokens=new, do_sample=args.do_sample, pad_token_id=pad, **sampling)
    t = time.perf_counter()
    out = HuggingFaceGenerationAdapter(model).generate(ids, attention_mask=mask, generation_config=gen)
    print(f"[nxdi run] generated {new} tokens per row in {time.perf_counter() - t:.2f}s")
    for row in out:
        text = tokenizer.decode(row, skip_special_tokens=True) if tokenizer else row.tolist()
        print(f"  {text}")
    status = _check(args, model, ids, mask, tokenizer)
    if args.benchmark:
        from nxdi.shell.cli.bench_generate import benchmark_model, render

        print(render(benchmark_model(model, prompt_len=ids.shape[1], new_tokens=new, repeat=3)))
    return status


def _check(args: argparse.Namespace, model: Any, ids: Any, mask: Any, tokenizer: Any) -> int:
    from nxdi.shell.accuracy import check_accuracy, check_accuracy_logits

    inputs = {"input_ids": ids, "attention_mask": mask}
    try:
        if args.check_accuracy_mode == "token-matching":
            check_accuracy(model, tokenizer, inputs=inputs, num_tokens_to_check=args.num_tokens_to_check)
            print("[nxdi run] token matching against transformers: passed")
        elif args.check_accuracy_mode == "logit-matching":
            report = check_accuracy_logits(
                model,
                tokenizer,
                inputs=inputs,
                num_tokens_to_check=args.num_tokens_to_check,
                divergence_difference_tol=args.divergence_difference_tol,
            )
            worst = ", ".join(f"top-{k}: {v:.4f}" for k, v in report.worst().items())
            print(
                f"[nxdi run] logit matching against transformers: passed ({len(report.positions)} positions; {worst})"
            )
    except AssertionError as exc:
        print(f"[nxdi run] accuracy check failed: {exc}", file=sys.stderr)
        return 1
    return 0

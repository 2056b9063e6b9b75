"""`nxdi config`: resolve a configuration from flags (and a model's config.json) and print it."""

from __future__ import annotations

import argparse
from pathlib import Path

from nxdi.core import graph_key
from nxdi.core.config import codec
from nxdi.core.families import parse_model_spec
from nxdi.shell.cli import reference
from nxdi.shell.cli.flags import add_neuron_config_flags, neuron_config_kwargs
from nxdi.shell.exceptions import unwrap


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "config",
        help="print the resolved neuron_config.json for a model and flags, or list every attribute",
        description="Print the neuron_config.json that a model and NeuronConfig flags resolve to, or, with "
        "--list, every NeuronConfig attribute with its default, what it does on the CPU backend and a description.",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", help="model folder or config.json (optional)")
    p.add_argument("--list", action="store_true", help="list every NeuronConfig attribute, grouped, and exit")
    p.add_argument("--markdown", action="store_true", help="with --list: as the Markdown of docs/neuron-config.md")
    add_neuron_config_flags(p)
    p.set_defaults(run=run)


def _hf_config(model_path: str | None) -> dict[str, object]:
    """The model's config.json as a dict (empty without --model-path)."""
    if model_path is None:
        return {}
    path = Path(model_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--model-path: no config.json at {str(file)!r}")
    return unwrap(codec.loads(file.read_text(), source=str(file)))


def run(args: argparse.Namespace) -> int:
    from nxdi.shell.config import NeuronConfig

    if args.list:
        rows = reference.reference_rows()
        print(reference.render_markdown(rows) if args.markdown else reference.render_text(rows), end="")
        return 0
    # IncompatibleConfigError, FileNotFoundError, PermissionError: `nxdi` reports them (exit 2).
    neuron = NeuronConfig(**neuron_config_kwargs(args))
    hf = _hf_config(args.model_path)
    doc: dict[str, object] = {**{k: v for k, v in hf.items() if k not in ("torch_dtype", "dtype")}}
    doc["neuron_config"] = codec.neuron_spec_to_dict(neuron.spec)
    model = parse_model_spec(hf).value_or(None) if hf else None
    doc["graph_key"] = graph_key.graph_key(neuron.spec, model)
    print(codec.dumps(doc))
    return 0

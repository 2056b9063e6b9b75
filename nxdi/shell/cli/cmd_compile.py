"""`nxdi compile`: compile a model into a folder, on a chosen backend, optionally writing its HLO.

    nxdi compile --model-path MODEL --compiled-model-path OUT [--backend cpu|xla|neuron]
                 [--dump-hlo DIR] [NeuronConfig flags: --tp-degree 2 --seq-len 256 ...]

`--dump-hlo DIR` writes each program's HLO text to `DIR/<program>.hlo.txt` (the xla backend lowers
programs to HLO; the folder itself keeps the HloModuleProto of each in `programs/*.xla`).
"""

from __future__ import annotations

import argparse
import time

from nxdi.core import families
from nxdi.effects.backends import NAMES as BACKENDS
from nxdi.shell.cli import checks
from nxdi.shell.cli.errors import UsageError
from nxdi.shell.cli.flags import add_neuron_config_flags, neuron_config_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("compile", help="compile a model into a folder (optionally dumping its HLO)", allow_abbrev=False)
    runs = ", ".join(t for r in families.runnable() for t in r.model_types)
    p.add_argument("--model-type", default=None, help=f"{runs} (default: config.json's)")
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--compiled-model-path", required=True, help="where the compiled model is written")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="default: NXDI_BACKEND, else cpu")
    p.add_argument("--dump-hlo", default=None, metavar="DIR", help="write each program's HLO text here (xla)")
    add_neuron_config_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Raises the documented exceptions and UsageError (`nxdi` reports them, exit 2); the output
    folder and --dump-hlo are checked before compiling."""
    from nxdi.effects import engine
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.exceptions import unwrap
    from nxdi.shell.inference_config import load_pretrained_config

    cls = checks.model_class(args.model_type, args.model_path)
    out = checks.output_folder(args.compiled_model_path)
    if args.dump_hlo is not None:
        checks.output_folder(args.dump_hlo, "--dump-hlo")
    config = cls.get_config_cls()(
        NeuronConfig(**neuron_config_kwargs(args)), load_config=load_pretrained_config(args.model_path)
    )
    model = cls(args.model_path, config, backend=args.backend)
    backend = model._backend()
    if args.dump_hlo is not None and not hasattr(backend, "hlo_text"):
        raise UsageError(f"--dump-hlo: the {backend.name} backend keeps no HLO. Fix: use --backend xla")
    start = time.perf_counter()
    model.compile(out)
    print(f"[nxdi compile] {backend.name}: compiled into {out} in {time.perf_counter() - start:.1f}s")
    if args.dump_hlo is not None:
        written = unwrap(engine.write_hlo(out, backend, args.dump_hlo))
        print(f"[nxdi compile] wrote the HLO text of {len(written)} programs to {args.dump_hlo}")
    return 0

"""The backends a model compiles and runs on, by name (`NXDI_BACKEND`): `cpu` (the default), `xla`
(HLO through torch-xla, run by XLA:CPU) and `neuron` (neuronx-cc, NeuronCores). Each module imports
its toolchain lazily, so naming a backend costs nothing until it is used."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this package stays free of torch (the CLI reads NAMES)
    from nxdi.effects.backends.base import Backend

NAMES = ("cpu", "xla", "neuron")


def backend_named(name: str, *, compiler_args: Sequence[str] = ()) -> Backend:
    """The backend called `name` (one of `NAMES`); `compiler_args` go to neuronx-cc.

    Raises:
        ValueError: `name` is not a backend.
    """
    match name:
        case "cpu":
            from nxdi.effects.backends.cpu import CpuBackend

            return CpuBackend()
        case "xla":
            from nxdi.effects.backends.xla import XlaBackend

            return XlaBackend()
        case "neuron":
            from nxdi.effects.backends.neuron import NeuronBackend

            return NeuronBackend(compiler_args=tuple(compiler_args))
    raise ValueError(f"NXDI_BACKEND={name!r}: is not one of {', '.join(NAMES)}")

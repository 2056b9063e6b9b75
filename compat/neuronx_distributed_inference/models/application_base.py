"""NxDI's `models.application_base`: the base of every application class."""

from nxdi.shell.application import NeuronApplicationBase

__all__ = ["NeuronApplicationBase"]

"""NxDI's `utils.exceptions`."""

from nxdi.shell.exceptions import LogitMatchingValidationError

__all__ = ["LogitMatchingValidationError"]

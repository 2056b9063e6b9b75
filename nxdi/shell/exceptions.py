"""The documented exceptions, and the one place core Failures become them."""

from __future__ import annotations

from typing import TypeVar

from returns.result import Failure, Result, Success

from nxdi.core.errors import CheckpointError, ConfigError

T = TypeVar("T")


class IncompatibleConfigError(ValueError):
    """The requested configuration is invalid; the message lists every problem, one per line."""

    def __init__(self, message: str, error: ConfigError | None = None) -> None:
        super().__init__(message)
        self.error = error
        """The structured problems (field, value, reason, fix), when known."""


class MissingAttributesError(IncompatibleConfigError, AssertionError):
    """An InferenceConfig lacks attributes its model requires (the reference raises AssertionError)."""


class CheckpointValidationError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or misshapen tensors, bad files."""

    def __init__(self, message: str, error: CheckpointError | None = None) -> None:
        super().__init__(message)
        self.error = error


def unwrap_or_raise(result: Result[T, ConfigError], title: str = "Invalid configuration") -> T:
    """The success value, or IncompatibleConfigError listing every problem."""
    match result:
        case Success(value):
            return value
        case Failure(error):
            raise IncompatibleConfigError(error.render(title), error) from None
    raise AssertionError("unreachable")


def unwrap_checkpoint(result: Result[T, CheckpointError], title: str = "Invalid checkpoint") -> T:
    """The success value, or CheckpointValidationError listing every problem."""
    match result:
        case Success(value):
            return value
        case Failure(error):
            raise CheckpointValidationError(error.render(title), error) from None
    raise AssertionError("unreachable")


class LogitMatchingValidationError(AssertionError):
    """Logits differ from the golden model beyond tolerance (`results` holds every compared position)."""

    def __init__(self, status_msg: str, results: object) -> None:
        super().__init__(status_msg)
        self.status_msg = status_msg
        self.results = results

"""The documented exceptions, and the one place core Failures become them (`unwrap`)."""

from __future__ import annotations

from typing import TypeVar

from returns.result import Failure, Result, Success

from nxdi.core.errors import ArtifactError, CheckpointError, ConfigError
from nxdi.effects.distributed.errors import RankError
from nxdi.effects.folder_lock import FolderLockedError

__all__ = [
    "ArtifactIntegrityError",
    "CheckpointValidationError",
    "FolderLockedError",
    "IncompatibleConfigError",
    "LogitMatchingValidationError",
    "MissingAttributesError",
    "RankError",
    "exception_for",
    "unwrap",
]

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


class ArtifactIntegrityError(RuntimeError):
    """A compiled-model folder is corrupt, incomplete, or was made by another nxdi, backend or configuration."""

    def __init__(self, message: str, error: ArtifactError | None = None) -> None:
        super().__init__(message)
        self.error = error


def exception_for(error: ConfigError | CheckpointError | ArtifactError, title: str | None = None) -> Exception:
    """The documented exception for a core error value, its message listing every problem:
    IncompatibleConfigError (a ValueError) for a configuration, CheckpointValidationError (a
    ValueError) for a checkpoint, FileNotFoundError when nothing is compiled or its weights are
    gone, else ArtifactIntegrityError for a compiled folder."""
    match error:
        case ConfigError():
            return IncompatibleConfigError(error.render(title or "Invalid configuration"), error)
        case CheckpointError():
            return CheckpointValidationError(error.render(title or "Invalid checkpoint"), error)
        case ArtifactError(not_found=True):
            return FileNotFoundError(error.render(title or "Nothing to load"))
        case ArtifactError():
            return ArtifactIntegrityError(error.render(title or "Invalid compiled model"), error)


def unwrap(result: Result[T, ConfigError | CheckpointError | ArtifactError], title: str | None = None) -> T:
    """The success value, or the documented exception for the failure (see `exception_for`)."""
    match result:
        case Success(value):
            return value
        case Failure(error):
            raise exception_for(error, title) from None
    raise AssertionError("unreachable")


class LogitMatchingValidationError(AssertionError):
    """Logits differ from the golden model beyond tolerance (`results` holds every compared position)."""

    def __init__(self, status_msg: str, results: object) -> None:
        super().__init__(status_msg)
        self.status_msg = status_msg
        self.results = results

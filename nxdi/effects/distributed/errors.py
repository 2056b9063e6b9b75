"""The exception of a failed rank process (no torch import, so the shell can re-export it cheaply)."""

from __future__ import annotations


class RankError(RuntimeError):
    """A tensor-parallel rank process died, hung or failed unexpectedly; every rank process was
    stopped. The message names the rank (`rank`, -1 when none is to blame) and quotes its log."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

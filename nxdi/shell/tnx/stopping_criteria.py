"""transformers-neuronx's stopping criteria: `StoppingCriteria` and `StoppingCriteriaList`.

`sample(..., stopping_criteria_list=)` calls the list with `(input_ids, probs)` after each step
(the prompt ids, and the step's probabilities over the kept candidates, None under on-device
generation); it stops when any criterion returns True.
"""

from __future__ import annotations

import abc
from typing import Any

from torch import Tensor


class StoppingCriteria(abc.ABC):
    """Subclass and implement `__call__(input_ids, scores, **kwargs) -> bool` (a subclass without it
    cannot be made: Python names the missing method when it is instantiated)."""

    @abc.abstractmethod
    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> bool:
        """True to stop after this step."""


class StoppingCriteriaList(list[StoppingCriteria]):
    """Criteria asked in order; True as soon as one says stop."""

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs: Any) -> bool:
        return any(bool(criterion(input_ids, scores, **kwargs)) for criterion in self)

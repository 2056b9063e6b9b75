"""async_mode: each decode call launches the next one in the background before it returns.

`NeuronBaseForCausalLM.forward` with `async_mode=True` goes through an `AsyncForward`. After a
decode step it predicts the call a decode loop makes next (`nxdi.core.host.async_steps`) and runs
that call on a worker thread, so the step computes while the caller reads this step's tokens,
checks stopping criteria and builds its next inputs. The next call then only waits for what is
still running. The launched step is used only when the call equals the prediction; otherwise it
is discarded once finished (steps never overlap each other: the cache is shared), the model's
bookkeeping and the sampling random stream are put back as they were before it ran, and the call
runs synchronously. So async_mode returns exactly the tokens of synchronous mode.

Every step of an async_mode model runs on its one worker thread, synchronous ones included, and so
do its load and warm-up: on the cpu backend the steps' parallel torch work then always runs on the
same OpenMP thread team. (A second thread running parallel work makes a second team, and libgomp
stops spin-waiting once it manages more threads than there are cores: on 2 cores a decode step of
the ~120M model went from 7.8 to 11.5 ms once two threads had run steps.)

A discarded step has also written its token's keys and values one position past each of its rows'
sequences (the block layout: into the row's own current block). No read sees them: every later
step of such a row writes that position before reading it, and a prompt encoded into the row is
read only up to its own length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
import torch

from nxdi.core.host import async_steps

Run = Callable[[dict[str, Any]], Any]
T = TypeVar("T")


@attrs.define
class AsyncStats:
    """What async_mode did since the model was loaded (or `reset_stats`)."""

    launched: int = 0
    """Steps launched ahead of their call."""
    used: int = 0
    """Launched steps whose call came as predicted (their result answered it)."""
    discarded: int = 0
    """Launched steps whose call never came (another call, a reset, a new seed)."""
    waited_s: float = 0.0
    """Seconds calls spent waiting for their launched step to finish (the part not overlapped)."""


@attrs.frozen
class _Launched:
    call: dict[str, Any]
    result: Future[Any]
    state: Any
    """The model's state before the step ran (`snapshot`), restored when the step is discarded."""


class AsyncForward:
    """Runs a model's forward calls, each decode launching its predicted successor.

    Args:
        run: the synchronous forward, `run(call) -> output` (output.tokens: the sampled tokens).
        snapshot: () -> the state a step changes besides the cache (restored with `restore`).
        restore: puts a `snapshot` back.
        predict: (call, output) -> the next call, or None (`async_steps.next_decode`).
    """

    def __init__(
        self,
        run: Run,
        *,
        snapshot: Callable[[], Any],
        restore: Callable[[Any], None],
        predict: Callable[[dict[str, Any], Any], dict[str, Any] | None],
    ) -> None:
        self._run = run
        self._snapshot = snapshot
        self._restore = restore
        self._predict = predict
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxdi-async")
        self._launched: _Launched | None = None
        self.stats = AsyncStats()

    def execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the worker thread, under the caller's grad modes; its result or
        its exception. A step launched ahead is settled first (discarded: `fn` may change state)."""
        self.settle()
        return self._pool.submit(_in_modes(_modes(), fn, *args, **kwargs)).result()

    def __call__(self, call: dict[str, Any]) -> Any:
        """The output of `call` (from its launched step when it was predicted), launching the next."""
        out = self._take(call)
        if out is None:
            out = self._pool.submit(_in_modes(_modes(), self._run, call)).result()
        following = self._predict(call, out)
        if following is not None:
            self._launch(following)
        return out

    def settle(self) -> None:
        """Wait for a launched step and discard it: before anything else touches the runtime."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        _wait(launched.result)
        self._restore(launched.state)
        self.stats.discarded += 1

    def close(self) -> None:
        """Settle, and stop the worker thread."""
        self.settle()
        self._pool.shutdown(wait=True)

    def _take(self, call: dict[str, Any]) -> Any:
        launched = self._launched
        if launched is None or not async_steps.same_call(launched.call, call):
            self.settle()
            return None
        self._launched = None
        start = time.perf_counter()
        failed = _wait(launched.result)
        self.stats.waited_s += time.perf_counter() - start
        if failed:
            # The same call runs again synchronously, so its error (if it has one) reaches the caller.
            self._restore(launched.state)
            self.stats.discarded += 1
            return None
        self.stats.used += 1
        return launched.result.result()

    def _launch(self, call: dict[str, Any]) -> None:
        state = self._snapshot()
        step = self._pool.submit(_in_modes(_modes(), self._run, call))
        self._launched = _Launched(call=call, result=step, state=state)
        self.stats.launched += 1


def _modes() -> tuple[bool, bool]:
    """The calling thread's inference and grad modes (per thread: the worker takes the caller's)."""
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled()


def _in_modes(modes: tuple[bool, bool], fn: Callable[..., T], *args: Any, **kwargs: Any) -> Callable[[], T]:
    def run() -> T:
        with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
            return fn(*args, **kwargs)

    return run


def _wait(result: Future[Any]) -> bool:
    """Wait for `result`; whether it raised."""
    return result.exception() is not None

"""One step at a time: a runner's steps share its input buffers, and a
result is a view of its graph's output until the next step, so a second
thread calling (or resetting, or capturing) mid-step would overwrite both.
It is refused rather than queued."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from graphmode.errors import InputError

__all__ = ["busy", "one_at_a_time"]

F = TypeVar("F", bound=Callable[..., Any])


def busy(what: str) -> InputError:
    """The error for ``what`` (a call, "runner.reset()") entered while
    another thread's call is running."""
    return InputError(
        f"{what} called while another call is running (from another thread): a runner's buffers, graphs and "
        "outputs belong to one step at a time. Call it from one thread, or serialise the calls (and copy each "
        "result before the next call)"
    )


def one_at_a_time(what: str) -> Callable[[F], F]:
    """A GraphRunner method that takes the runner's step lock (``_busy``,
    re-entrant: the thread holding it may call other guarded methods), or
    refuses, naming ``what``, when another thread holds it."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._busy.acquire(blocking=False):
                raise busy(what)
            try:
                return method(self, *args, **kwargs)
            finally:
                self._busy.release()

        return guarded  # type: ignore[return-value]

    return wrap

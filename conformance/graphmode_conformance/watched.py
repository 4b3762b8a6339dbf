"""A harness whose runner calls run inside a watch, and the watch itself.

Checks that watch what the vendor's code does (the functions it calls, the
waits it makes) watch the runner's steps alone: the eager reference step and
the suite's own checks around it are neither the vendor's nor worth the
cost of watching.
"""

from __future__ import annotations

import gc
import sys
from contextlib import AbstractContextManager
from typing import Any

from graphmode.context import StepInputs
from graphmode_conformance.harness import Harness

__all__ = ["ProfileWatch", "WatchedHarness"]


class WatchedHarness(Harness):
    """:class:`Harness` entering ``watch`` (a reusable context manager, when
    set) around every call of the runner."""

    watch: AbstractContextManager | None = None

    def _call_runner(self, inputs: StepInputs) -> Any:
        if self.watch is None:
            return super()._call_runner(inputs)
        with self.watch:
            return super()._call_runner(inputs)


class ProfileWatch:
    """``with watch:`` (reusable) runs the block with :meth:`_profile` as
    this thread's profile function (``sys.setprofile``: every Python and C
    call) and no garbage collection: a collection mid-step would run
    finalizers of earlier tests' objects inside the watch."""

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        raise NotImplementedError

    def __enter__(self) -> ProfileWatch:
        self._collecting = gc.isenabled()
        gc.disable()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        if self._collecting:
            gc.enable()

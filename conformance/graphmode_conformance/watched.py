"""A harness whose runner calls run inside a watch.

Checks that watch what the vendor's code does (the functions it calls, the
waits it makes) watch the runner's steps alone: the eager reference step and
the suite's own checks around it are neither the vendor's nor worth the
cost of watching.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from graphmode.context import StepInputs
from graphmode_conformance.harness import Harness

__all__ = ["WatchedHarness"]


class WatchedHarness(Harness):
    """:class:`Harness` entering ``watch`` (a reusable context manager, when
    set) around every call of the runner."""

    watch: AbstractContextManager | None = None

    def _call_runner(self, inputs: StepInputs) -> Any:
        if self.watch is None:
            return super()._call_runner(inputs)
        with self.watch:
            return super()._call_runner(inputs)

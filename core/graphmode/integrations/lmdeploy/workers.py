"""graphmode in lmdeploy's worker processes (tensor parallel, the ``mp`` executor).

With ``tp > 1`` lmdeploy starts one process per rank (``ExecutorProc.start``,
multiprocessing's spawn), and each builds its own graph runner there, in a
fresh interpreter where graphmode's builders are not installed. graphmode
goes along with the process: while ``enable()`` holds, ``ExecutorProc.start``
hands lmdeploy's own start a multiprocessing context whose ``Process`` wraps
the worker's target, so that the child first enables graphmode with the same
settings, then runs lmdeploy's worker loop unchanged. The ``ray`` executor is
not covered (its workers are started by ray).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["ContextEnablingGraphmode", "run_enabled"]


def run_enabled(settings: dict[str, Any], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In a worker process: enable graphmode with ``settings`` (``enable()``'s
    keywords), then run lmdeploy's worker ``target``."""
    from graphmode.integrations.lmdeploy import enable

    enable(**settings)
    return target(*args, **kwargs)


class ContextEnablingGraphmode:
    """A multiprocessing context like ``context``, whose processes enable
    graphmode (``settings``) before running their target. Picklable, since
    lmdeploy pickles the object holding it with the worker's target."""

    def __init__(self, context: Any, settings: Any) -> None:
        self.context = context
        self.settings = dataclasses.asdict(settings)

    def Process(self, *args: Any, target: Callable[..., Any], **kwargs: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        return self.context.Process(*args, target=functools.partial(run_enabled, self.settings, target), **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "context":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.context, name)

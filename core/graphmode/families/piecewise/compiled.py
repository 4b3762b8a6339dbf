"""Compiled piecewise graphs: ``torch.compile(model)`` split at the break points.

With ``compile=True`` in execute modes "piecewise" and "full_and_piecewise"
a piecewise capture runs :class:`SplitForward` instead of the model: the
runner's ``torch.compile(model)``, in which every intercepted AttentionOps
call (``breaks.ATTENTION_METHODS``) is a Dynamo graph break. Dynamo compiles
the code between two attention calls into Inductor kernels and calls the
break point itself uncompiled, so the piecewise session sees the same calls
as with the plain model: the warm-up (which compiles, outside any graph)
runs them, the capture cuts a segment at each and records the compiled
kernels in between. This is vLLM's split at its "splitting ops", made with
Dynamo's graph breaks rather than by cutting one FX graph.

Why stable entry points: the piecewise session shadows the attention methods
with a new interceptor per forward (``breaks.intercepted``), and Dynamo
guards on the identity of the function a model calls, so it would compile
again at every capture. Over the interceptors, :class:`SplitForward` places
one ``torch.compiler.disable`` function per (ops object, method), made once,
that calls whichever interceptor is installed: the same object at every
forward, and opaque to Dynamo.

What a token bucket costs (torch 2.13, reference model; counted by
``tests/test_piecewise_compiled.py``): every layer runs the same code objects,
so a layer adds no compilation. Dynamo gives up the model's layer loop (a
graph break inside a loop) and compiles the frames under it: the embedding,
a layer's input norm, the projections and rotary embedding before the KV
write, the output projection after attention, the residual and MLP, the
final norm; six graphs. With the default ``dynamic=True`` they compile once
for every bucket (a bucket of one token, and sizes equal to a model
dimension by chance, specialise once more); with ``dynamic=False`` each
bucket compiles all six anew, so the buckets (full graphs' and token
buckets together: :func:`compiled_shapes`) must stay within Dynamo's
recompile limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from graphmode.families.piecewise.breaks import ATTENTION_METHODS, shadowed
from graphmode.token_buckets import default_token_sizes

if TYPE_CHECKING:
    from graphmode.config import RunnerConfig

__all__ = ["SplitForward", "compiled_shapes"]


class SplitForward:
    """``compiled(**kwargs)`` with every attention method of ``ops_objects``
    a graph break: call it where the model would be called, inside
    ``breaks.intercepted`` (a piecewise session) or outside (the attention
    methods then run as they are). ``compiled`` is ``torch.compile(model)``."""

    def __init__(self, compiled: Callable[..., Any], ops_objects: list[Any]) -> None:
        self.compiled = compiled
        self.ops_objects = ops_objects
        self._installed: dict[tuple[int, str], Callable[..., Any]] = {}
        self._entries = {
            (id(ops), name): _opaque_entry(self._installed, (id(ops), name))
            for ops in ops_objects for name in ATTENTION_METHODS
        }

    def __call__(self, **kwargs: Any) -> Any:
        try:
            with contextlib.ExitStack() as stack:
                for ops in self.ops_objects:
                    for name in ATTENTION_METHODS:
                        key = (id(ops), name)
                        self._installed[key] = getattr(ops, name)  # the session's interceptor, or the method
                        stack.enter_context(shadowed(ops, name, self._entries[key]))
                return self.compiled(**kwargs)
        finally:
            # The interceptors hold their session (its graphs and pool): keep
            # none past the call, or runner.reset() would not free them.
            self._installed.clear()


def _opaque_entry(installed: dict[tuple[int, str], Callable[..., Any]], key: tuple[int, str]) -> Callable[..., Any]:
    def entry(*args: Any, **kwargs: Any) -> Any:
        return installed[key](*args, **kwargs)

    return torch.compiler.disable(entry)


def compiled_shapes(config: RunnerConfig, capture_sizes: tuple[int, ...]) -> int:
    """How many input shapes a runner's compiled forward meets: one per full
    graph bucket (modes "graph" and "full_and_piecewise") plus one per token
    bucket (piecewise modes). With ``dynamic=False`` each is a compilation of
    every compiled frame, counted by Dynamo against its recompile limit."""
    mode = config.execute_mode
    shapes = len(capture_sizes) if mode in ("graph", "full_and_piecewise") else 0
    if mode in ("piecewise", "full_and_piecewise"):
        shapes += len(config.capture_token_sizes or default_token_sizes(config.max_batches))
    return shapes

"""One forward of the model split into captured segments and eager calls.

The runner runs a bucket's first forward twice, as the full-graph runner
does: once eagerly (:class:`EagerForward`, the warm-up, whose result is the
step's answer), then under capture (:class:`CaptureForward`), which opens a
device graph, and at every break point ends it, records the call and opens
the next. Nothing runs at a break point during the capture: a device capture
runs nothing, so the segment's outputs hold no values yet (the emulator rolls
its writes back), and running the call would write garbage into the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmode.context import AttnMetadata
from graphmode.errors import CaptureError
from graphmode.families.piecewise.breaks import Attention, BreakCall, HostWork, KVWrite, LiveStep, Session
from graphmode.graphs import DeviceGraph

__all__ = ["BreakBuffers", "CaptureForward", "EagerForward", "Pieces"]


class BreakBuffers:
    """The static buffers break points write their results into, one per
    break point of the forward, shared by every bucket (one step runs at a
    time): an attention result buffer has rows for the largest bucket, of
    which a bucket's graph reads the first ``bucket``."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def rows(self, index: int, like: torch.Tensor, bucket: int) -> torch.Tensor:
        """``bucket`` rows shaped like ``like``'s rows, for break point ``index``."""
        key = ("rows", index, tuple(like.shape[1:]), like.dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros((self.max_tokens, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return self._buffers[key][:bucket]

    def whole(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s shape and dtype, for break point ``index``."""
        key = ("whole", index, tuple(like.shape), like.dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros_like(like)
        return self._buffers[key]

    def clear(self) -> None:
        self._buffers.clear()

    def views_for(self, layout: list[tuple[Any, ...] | None], bucket: int) -> list[torch.Tensor | None] | None:
        """The views a warm-up of token bucket ``bucket`` would hand the
        capture, from another bucket's warm-up ``layout``
        (:attr:`EagerForward.layout`): its attention results' rows, cut to
        ``bucket``. None when one is a host break's whole result, whose
        shape the layout cannot tell for another bucket."""
        views: list[torch.Tensor | None] = []
        for key in layout:
            if key is None:
                views.append(None)
            elif key[0] == "rows" and key in self._buffers:
                views.append(self._buffers[key][:bucket])
            else:
                return None
        return views


class EagerForward(Session):
    """The warm-up: every break point runs at once, on the live tokens, and
    its result goes to the static buffer the capture will hand the model.
    ``views`` lists those buffers in order, for the capture."""

    def __init__(self, live: LiveStep, buffers: BreakBuffers) -> None:
        self.live, self.buffers = live, buffers
        self.views: list[torch.Tensor | None] = []
        #: Each view's buffer key (BreakBuffers), or None: what :meth:`BreakBuffers.views_for` takes.
        self.layout: list[tuple[Any, ...] | None] = []

    def _run(self, call: BreakCall) -> None:
        with self.calling():
            call.run(self.live)

    def kv_write(self, call: KVWrite) -> None:
        self._run(call)

    def attention(self, decode: Callable[..., Any], prefill: Callable[..., Any], query: torch.Tensor,
                  rest: tuple) -> torch.Tensor:
        index = len(self.views)
        out = self.buffers.rows(index, query, self.live.bucket)
        self._run(Attention(decode, prefill, query, rest, out))
        self.views.append(out)
        self.layout.append(("rows", index, tuple(query.shape[1:]), query.dtype))
        return out

    def host_work(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self.calling():
            result = fn(*args, **kwargs)
        if result is None:
            self.views.append(None)
            self.layout.append(None)
            return None
        if not isinstance(result, torch.Tensor):
            raise CaptureError(
                f"host_break({getattr(fn, '__qualname__', fn)!r}) returned a {type(result).__name__}; "
                "a graph can only read a tensor (or nothing) from host work. Return a tensor or None"
            )
        out = self.buffers.whole(len(self.views), result)
        out.copy_(result)
        self.views.append(out)
        self.layout.append(("whole",))
        return out


@dataclass
class Pieces:
    """A captured forward: ``segments[i]`` replays, then the calls of
    ``gaps[i]`` run, for every i in order."""

    segments: list[DeviceGraph] = field(default_factory=list)
    gaps: list[list[BreakCall]] = field(default_factory=list)

    def replay(self, live: LiveStep) -> None:
        for graph, gap in zip(self.segments, self.gaps):
            graph.replay()
            for call in gap:
                call.run(live)

    def reset(self) -> None:
        for graph in self.segments:
            graph.reset()
        self.segments.clear()
        self.gaps.clear()


class CaptureForward(Session):
    """The capture: a device graph per segment, cut at every break point.

    A ``fill_kv_cache`` call does not cut. Where the ops allow it
    (:func:`~graphmode.families.piecewise.breaks.writes_kv_in_graph`) it is captured in
    the open segment, over the bucket's rows, reading ``slots_attn``'s static
    slots (padding rows -1: they write nothing). Otherwise it is deferred to
    the next cut (the attention call that follows it in every model), where
    it runs first, on the live tokens. It only writes the cache, which only
    attention reads, so it moves past no reader; and the empty segment
    between the two calls (one more graph per layer, one more stream on
    Ascend) is never made.

    ``with forward:`` opens the first segment; leaving closes the last (or,
    on an error, ends the open capture and resets every graph made).
    """

    def __init__(self, views: list[torch.Tensor | None], make_graph: Callable[[], DeviceGraph], pool: Any,
                 slots_attn: AttnMetadata | None = None) -> None:
        self.views = views
        # The metadata a captured KV write reads: the bucket's static slot rows (padding -1).
        self.slots_attn = slots_attn
        self.make_graph = make_graph
        self.pool = pool
        self.pieces = Pieces()
        self._results = 0
        self._pending: list[BreakCall] = []
        self._graph: DeviceGraph | None = None
        self._open_capture: contextlib.ExitStack | None = None

    def __enter__(self) -> CaptureForward:
        self._open()
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is None:
            self._close()
            self.pieces.gaps.append(self._pending)
            return
        stack, self._open_capture = self._open_capture, None
        if stack is not None:
            stack.__exit__(kind, error, trace)  # ends the capture, keeps the body's error
        for graph in [*self.pieces.segments, *([self._graph] if self._graph is not None else [])]:
            with contextlib.suppress(Exception):
                graph.reset()

    def _open(self) -> None:
        self._graph = self.make_graph()
        stack = contextlib.ExitStack()
        stack.enter_context(self._graph.capture(pool=self.pool))
        self._open_capture = stack

    def _close(self) -> None:
        stack, graph = self._open_capture, self._graph
        assert stack is not None and graph is not None
        self._open_capture = None
        stack.close()
        self._graph = None
        self.pieces.segments.append(graph)
        if self.pool is None:
            self.pool = graph.pool()  # every later segment (and graph) shares it

    def _cut(self, call: BreakCall) -> None:
        self._close()
        self.pieces.gaps.append([*self._pending, call])
        self._pending = []
        self._open()

    def _next_view(self, what: str) -> torch.Tensor | None:
        if self._results >= len(self.views):
            raise CaptureError(
                f"the captured forward called {what} more often than its warm-up did ({len(self.views)} "
                "break points with results): the model's break points must not depend on whether it runs "
                "under capture"
            )
        view = self.views[self._results]
        self._results += 1
        return view

    def kv_write(self, call: KVWrite) -> None:
        if call.in_graph and self.slots_attn is not None:
            # Captured here, in the open segment: one launch less per layer at every replay.
            with self.calling():
                call.run_in_graph(self.slots_attn)
            return
        self._pending.append(call)

    def attention(self, decode: Callable[..., Any], prefill: Callable[..., Any], query: torch.Tensor,
                  rest: tuple) -> torch.Tensor:
        out = self._next_view("attention")
        if out is None or out.shape[1:] != query.shape[1:]:
            raise CaptureError("the captured forward's attention calls differ from its warm-up's")
        self._cut(Attention(decode, prefill, query, rest, out))
        return out

    def host_work(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        out = self._next_view("host_break")
        self._cut(HostWork(fn, args, kwargs, out))
        return out


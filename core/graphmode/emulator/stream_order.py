"""Streams of the emulated device, and the order a replay needs.

On a device, work runs on streams; two streams run concurrently unless one
waits for the other (``wait_stream``, ``wait_event``). A runner writes a
step's inputs (the fill's copies into the buffers) on the stream current
when it is called, then replays. A graph class that replays on a stream of
its own ("so that the replay overlaps the host's next step") without making
that stream wait for the inputs' stream reads the buffers before the copies
ran: the previous step's inputs, whenever the device is busy (an H200: 0.663
off eager). Run in order on one thread, the emulator's replay would read the
right inputs; so it models the streams instead and refuses the replay.

The model: :func:`use` makes a :class:`Stream` current (``torch.cuda.stream``);
the runner's replay guard notes, at the end of every fill, that the step's
inputs were written on the current stream (:func:`note_inputs_written`); an
:class:`~graphmode.emulator.EmulatedGraph` replayed on another stream raises
:class:`~graphmode.errors.ReplayError` unless that stream waited for the
inputs' stream after they were written (:meth:`Stream.wait_stream`, or
:meth:`Stream.wait_event` of an :class:`OrderEvent` recorded after them).
Positions are a logical clock: every note, wait and record is one tick.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from graphmode.errors import ReplayError

__all__ = ["OrderEvent", "Stream", "check_replay_ordered", "current_stream", "note_inputs_written", "use"]

_clock = itertools.count(1)


class Stream:
    """A stream of the emulated device (``torch.cuda.Stream``'s ordering
    calls). ``waited``: per stream, the tick up to which this stream's later
    work is ordered after it."""

    _names = itertools.count()

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"emulated stream {next(self._names)}"
        self.waited: dict[Stream, int] = {}
        self.inputs_written = 0  # the tick at which a fill last wrote a step's inputs on this stream

    def wait_stream(self, other: Stream) -> None:
        """Order this stream's later work after everything issued on ``other`` so far."""
        self.waited[other] = next(_clock)

    def wait_event(self, event: OrderEvent) -> None:
        """Order this stream's later work after the point ``event`` recorded."""
        if event.stream is not None:
            self.waited[event.stream] = max(self.waited.get(event.stream, 0), event.tick)

    def record_event(self) -> OrderEvent:
        return OrderEvent().record(self)

    def __repr__(self) -> str:
        return f"<{self.name}>"


class OrderEvent:
    """A point of a stream's order (``torch.cuda.Event`` for ordering)."""

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.tick = 0

    def record(self, stream: Stream | None = None) -> OrderEvent:
        self.stream, self.tick = stream or current_stream(), next(_clock)
        return self


DEFAULT = Stream("the default stream")
_current: list[Stream] = [DEFAULT]


def current_stream() -> Stream:
    return _current[-1]


@contextlib.contextmanager
def use(stream: Stream) -> Iterator[Stream]:
    """Make ``stream`` current inside the block (``torch.cuda.stream``)."""
    _current.append(stream)
    try:
        yield stream
    finally:
        _current.pop()


def note_inputs_written() -> None:
    """A fill has just written the step's inputs on the current stream."""
    current_stream().inputs_written = next(_clock)


def check_replay_ordered(graph: object) -> None:
    """Refuse a replay of ``graph`` on the current stream when a step's
    inputs were written on another stream that it did not wait for since."""
    stream = current_stream()
    for other in (DEFAULT, *_current):
        if other is stream or not other.inputs_written:
            continue
        if stream.waited.get(other, 0) < other.inputs_written:
            raise ReplayError(
                f"{type(graph).__qualname__} replayed on {stream!r}, which is not ordered after the step's input "
                f"copies on {other!r}: nothing since the fill wrote them made {stream!r} wait for {other!r}. On a "
                "device the two streams run concurrently, so whenever the device is busy the replay reads the "
                "buffers before the copies ran: the previous step's inputs (right when every step is "
                "synchronised). Make the replay stream wait for the stream current at the call before replaying "
                "(replay_stream.wait_stream(torch.cuda.current_stream()) on the device, "
                "stream_order.current_stream() in an emulated graph class; or wait_event of an event recorded "
                "there), and the caller's stream wait for the replay stream before it reads the outputs; or "
                "replay on the current stream"
            )

"""An NPU-like runtime on the emulator: streams, external events and ACL
task groups, with the calling conventions of ``torch.npu`` in torch_npu.

On Ascend, kernels that take host values (the kv lengths of fused attention)
are captured inside a task group behind an external-event wait; before each
replay the runner re-issues them with new host values between
``graph_task_update_begin`` and ``graph_task_update_end`` on an update stream
and records the event, which lets the replay proceed. A replay whose event
was not recorded waits forever on the device; here it raises.

:class:`NPUGraph` is ``torch.npu.NPUGraph`` as torch_npu 2.8+ has it: with
``auto_dispatch_capture`` set, the calls it can update are recorded by its
``graph_dispatch_mode``, which the caller enters around the capture (as
``torch.npu.graph`` does) and must leave again: left entered, it intercepts
eager calls too, where its task group fails outside a capture. Which operators
that mode records depends on the torch_npu release (see
:func:`recorded_operators`), and a device has a limited number of streams, so
a capture can fail with error 207008 (see :func:`stream_limit`).

Streams are asynchronous here as on a device: a replay stays *in flight* on
the stream it was launched on until something orders later work after it
(``Stream.synchronize``, ``synchronize()``, ``Event.synchronize``, or another
stream's ``wait_stream`` / ``wait_event`` on an event recorded after it). A
parameter update of the graph (``graph_task_update_begin`` on the update
stream, ``NPUGraph.update`` on torch_npu's update stream) issued while the
graph's previous replay is in flight and not ordered before the update
stream raises: on the device it would change parameters that replay is still
reading. (Everything still runs in order on the host; only the ordering is
checked.)

The Ascend plugin drives this module on the CPU exactly as it drives
``torch.npu`` on an NPU, so both of its update paths run for real in CI. It
plugs into the core emulator through ``EmulatedGraph.record_call`` and the
step protocol of ``graphmode.emulator.recording``; the core knows nothing of
NPUs.

torch_npu's API, as modelled (Ascend/pytorch): ``torch_npu/npu/streams.py``
(``Stream.wait_event``, ``wait_stream``, ``record_event``, ``query``,
``synchronize``; ``Event.record/wait/query/synchronize``;
``ExternalEvent.record/wait/reset``), ``torch_npu/npu/graphs.py``
(``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``NPUGraph.update`` issuing on ``_GraphDispatchMode.update_stream``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.emulator import CaptureSession, EmulatedGraph, call_site, current_session
from graphmode.emulator.capture import named_arguments
from graphmode.errors import CaptureError, ReplayError
from graphmode_ascend.emulated_tasks import DispatchRecord, EventReset, EventWait, TaskGroup, UpdateSession

__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "Stream",
    "TaskGroupHandle",
    "current_stream",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "recorded_arguments",
    "recorded_operators",
    "register_updatable",
    "stream",
    "stream_limit",
    "synchronize",
]


_updatable: set[Any] = set()


def register_updatable(op: Any) -> None:
    """Declare an operator that ``NPUGraph``'s dispatch mode records for
    ``update`` (the emulator's counterpart of torch_npu's
    ``npu_fused_infer_attention_score``, which torch_npu's handlers name)."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    _updatable.add(op)


def is_updatable(op: Any) -> bool:
    """Whether ``op`` was declared with :func:`register_updatable`."""
    return op in _updatable


# -- streams, events and what is in flight -----------------------------------

_streams: weakref.WeakSet[Stream] = weakref.WeakSet()


class Stream:
    """A stream: work launched on it runs in order; other streams and the
    host see it finished only once ordered after it.

    ``launched`` counts the work launched on it; ``done`` how much of it the
    host has waited for; ``after`` maps another stream to how much of its
    work this stream's future work is ordered after."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.launched = 0
        self.done = 0
        self.after: dict[Stream, int] = {}
        _streams.add(self)

    def launch(self) -> Launch:
        """Launch one piece of work (a replay) on this stream."""
        self.launched += 1
        return Launch(self, self.launched)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        """All future work on this stream waits for what ``stream`` has now."""
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The host waits for everything launched on this stream (and what
        that work was ordered after)."""
        _finish({**self.after, self: self.launched})

    def query(self) -> bool:
        """Whether the work is done; the emulator has run it, so it is, and
        the host now knows it (as after ``synchronize``)."""
        self.synchronize()
        return True

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"<emulated stream {id(self):#x}>"


@dataclass(frozen=True)
class Launch:
    """The ``index``-th piece of work launched on ``stream``."""

    stream: Stream
    index: int

    def ordered_before(self, stream: Stream) -> bool:
        """Whether work issued on ``stream`` now runs after this launch."""
        return stream is self.stream or self.stream.done >= self.index or stream.after.get(self.stream, 0) >= self.index


def _finish(points: dict[Stream, int]) -> None:
    for stream, index in points.items():
        stream.done = max(stream.done, index)


def _order_after(stream: Stream, points: dict[Stream, int]) -> None:
    for source, index in points.items():
        if source is not stream:
            stream.after[source] = max(stream.after.get(source, 0), index)


_default_stream = Stream()
_current: list[Stream] = [_default_stream]


def current_stream(device: Any = None) -> Stream:
    return _current[-1]


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[None]:
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


def synchronize(device: Any = None) -> None:
    """The host waits for every stream."""
    _finish({s: s.launched for s in list(_streams)})


class Event:
    """``torch.npu.Event``: marks a point of a stream, which other streams
    (``wait``) or the host (``synchronize``) can wait for."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._points: dict[Stream, int] = {}

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        self._points = {**stream.after, stream: stream.launched}

    def wait(self, stream: Stream | None = None) -> None:
        _order_after(stream if stream is not None else current_stream(), self._points)

    def synchronize(self) -> None:
        _finish(self._points)

    def query(self) -> bool:
        self.synchronize()
        return True


class ExternalEvent:
    """An event that a captured graph waits on and the host records."""

    def __init__(self) -> None:
        self.recorded = False

    def wait(self, stream: Stream | None = None) -> None:
        session = current_session()
        if session is not None:
            session.append(EventWait(self, call_site()))

    def reset(self, stream: Stream | None = None) -> None:
        session = current_session()
        if session is not None:
            session.append(EventReset(self))
        else:
            self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True


def _capturing(what: str) -> Any:
    session = current_session()
    if session is None:
        raise CaptureError(f"{what} outside graph capture: task groups exist only inside a capture")
    return session


class TaskGroupHandle:
    """What ``graph_task_group_end`` returns: an opaque handle, like torch_npu's
    ``_NPUTaskGroupHandle``. It does not keep the captured work (or the tensors
    it names) alive; the graph does."""

    def __init__(self, group: TaskGroup) -> None:
        self._group = weakref.ref(group)

    def group(self) -> TaskGroup:
        group = self._group()
        if group is None:
            raise ReplayError(
                "graph_task_update_begin on a task group whose graph was reset or freed; "
                "capture the graph again and use the handles of that capture"
            )
        return group


# The task groups open in each capture: (the group, its nesting), innermost last.
_open_groups: weakref.WeakKeyDictionary[CaptureSession, list[tuple[TaskGroup, contextlib.ExitStack]]] = (
    weakref.WeakKeyDictionary()
)


def graph_task_group_begin(stream: Stream) -> None:
    session = _capturing("graph_task_group_begin")
    graph = session.graph
    if not isinstance(graph, NPUGraph):
        raise CaptureError(
            f"graph_task_group_begin while capturing a {type(graph).__name__}: task groups exist only in "
            "an NPU graph's capture (graphmode_ascend.emulated_npu.NPUGraph)"
        )
    group = TaskGroup(weakref.ref(graph))
    session.append(group)
    nesting = contextlib.ExitStack()
    nesting.enter_context(session.nested(group.steps))
    _open_groups.setdefault(session, []).append((group, nesting))


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    session = _capturing("graph_task_group_end")
    groups = _open_groups.get(session)
    if not groups:
        raise CaptureError("graph_task_group_end without graph_task_group_begin")
    group, nesting = groups.pop()
    nesting.close()
    return TaskGroupHandle(group)


def recorded_arguments(handle: TaskGroupHandle) -> dict:
    """The arguments, by name, of the last call recorded in a task group, as
    the record holds them: bound to the memory they had at capture."""
    record = handle.group().steps[-1]
    return named_arguments(record.func, record.args, record.kwargs)


_update: list[UpdateSession] = []


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    if current_session() is not None:
        raise ReplayError("graph_task_update_begin inside a capture: update after capture_end")
    if _update:
        raise ReplayError("graph_task_update_begin while another task update is open")
    if not isinstance(handle, TaskGroupHandle):
        raise ReplayError(f"graph_task_update_begin needs a handle from graph_task_group_end, got {handle!r}")
    group = handle.group()
    graph = group.graph()
    if graph is not None:
        graph.check_update_ordered(stream, "graph_task_update_begin")
    session = UpdateSession(group)
    session.__enter__()
    _update.append(session)


def graph_task_update_end(stream: Stream) -> None:
    if not _update:
        raise ReplayError("graph_task_update_end without graph_task_update_begin")
    session = _update.pop()
    session.__exit__(None, None, None)
    session.finish()


# -- torch.npu.NPUGraph ------------------------------------------------------

_recorded: list[frozenset | None] = [None]
# Per stream_limit block: its limit and the graphs captured in it.
_stream_limits: list[tuple[int, weakref.WeakSet[NPUGraph]]] = []

# torch_npu's message for error 207008 (NPU_CHECK_ERROR in NPUException.h,
# the text from NPUErrorCodes.h), as a failed capture raises it.
STREAM_ERROR = (
    "capture_begin:torch_npu/csrc/core/npu/NPUGraph.cpp:318 NPU function error: "
    "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode), error code is 207008\n"
    "[ERROR] (PID:0, Device:0, RankID:-1) ERR00100 PTA call acl api failed\n"
    "[Error]: Stream resources are insufficient.\n"
    "        Check whether the number of streams meets the requirements by referring to the "
    "description of the acl.rt.create_stream interface."
)


@contextlib.contextmanager
def recorded_operators(ops: Iterable[Any]) -> Iterator[None]:
    """Within this block, the dispatch mode of an :class:`NPUGraph` records
    only ``ops`` (of those registered updatable), as an older torch_npu does:
    before its ``.default`` fix (September 2025) it passed
    ``npu_fused_infer_attention_score.default`` through unrecorded."""
    _recorded.append(frozenset(ops))
    try:
        yield
    finally:
        _recorded.pop()


@contextlib.contextmanager
def stream_limit(graphs: int) -> Iterator[None]:
    """Within this block the emulated device has streams left for ``graphs``
    more captured graphs: one more capture fails in ``capture_begin`` with
    torch_npu's error 207008, and a graph reset or freed gives its streams
    back. (How many streams a real graph holds depends on the model, CANN and
    HCCL; the emulator counts graphs.)"""
    _stream_limits.append((graphs, weakref.WeakSet()))
    try:
        yield
    finally:
        _stream_limits.pop()


class GraphDispatchMode(TorchDispatchMode):
    """torch_npu's ``_GraphDispatchMode``: while entered, each call it records
    waits on an external event inside its own task group, to be re-issued by
    :meth:`NPUGraph.update`. Outside a capture its task group fails, as
    ``graph_task_group_begin`` does on a device."""

    # The stream every graph's update is issued on, as torch_npu's class attribute.
    update_stream = Stream()

    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self._graph = weakref.ref(graph)
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.entered -= 1
        super().__exit__(*exc)

    @property
    def graph_dispatch_records(self) -> list:
        """The calls recorded for update, as torch_npu keeps them."""
        graph = self._graph()
        return [] if graph is None else graph._dispatch_records

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if records(func) and current_session() is None:
            _capturing("graph_task_group_begin")  # raises: no capture under way
        # Inside a capture the recorder records it (see NPUGraph.records_updatable).
        return func(*args, **kwargs)


def records(func: Any) -> bool:
    """Whether torch_npu's dispatch mode records ``func`` (see :func:`recorded_operators`)."""
    allowed = _recorded[-1]
    return is_updatable(func) and (allowed is None or func in allowed)


class NPUGraph(EmulatedGraph):
    """``torch.npu.NPUGraph`` on the emulator: with ``auto_dispatch_capture``
    set, its own ``graph_dispatch_mode`` records the updatable calls (only
    while the caller has it entered), each behind an external-event wait in
    its own task group, and :meth:`update` re-issues them with new host
    arguments; a replay stays in flight on the stream it was launched on; each
    captured graph holds device streams until it is reset or freed."""

    def __init__(self) -> None:
        super().__init__()
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = GraphDispatchMode(self)
        self._dispatch_records: list[DispatchRecord] = []
        self._in_flight: Launch | None = None

    def record_call(self, session: CaptureSession, func: Any, args: tuple, kwargs: dict) -> Any:
        """As torch_npu's dispatch capture does for a call it records: the
        call waits on an external event, runs inside its own task group, and
        is remembered so that :meth:`update` can re-issue it."""
        if not self.records_updatable(func):
            return session.record(func, args, kwargs)
        event = ExternalEvent()
        session.append(EventWait(event, call_site()))
        session.append(EventReset(event))
        group = TaskGroup(weakref.ref(self))
        session.append(group)
        named = named_arguments(func, args, kwargs)
        with session.nested(group.steps):
            outputs = session.record(func, (), named)
        self._dispatch_records.append(DispatchRecord(func, named, outputs, event, group))
        return outputs

    def replay(self) -> None:
        """Launch the graph on the current stream: in flight until ordered."""
        super().replay()
        self._in_flight = current_stream().launch()

    def check_update_ordered(self, stream: Stream, what: str) -> None:
        """Refuse a parameter update on ``stream`` while this graph's previous
        replay may still be reading the parameters."""
        launch = self._in_flight
        if launch is None or launch.ordered_before(stream):
            return
        raise ReplayError(
            f"{what} on {stream!r} would change parameters the previous replay is still reading: that "
            f"replay was launched on {launch.stream!r} and nothing since orders the update after it; wait "
            "for the replay stream before updating (replay_stream.synchronize(), as vllm-ascend does before "
            "its attention update, or update_stream.wait_stream(replay_stream))"
        )

    @property
    def num_updatable(self) -> int:
        return len(self._dispatch_records)

    def capture_begin(self, pool: Any = None) -> None:
        if _stream_limits:
            limit, holding = _stream_limits[-1]
            if len(holding) >= limit:
                raise RuntimeError(STREAM_ERROR)
            holding.add(self)
        super().capture_begin(pool)

    def capture_end(self) -> None:
        try:
            super().capture_end()
        except BaseException:
            self._release_streams()
            raise

    def reset(self) -> None:
        super().reset()
        self._dispatch_records = []
        self._in_flight = None
        self._release_streams()

    def _release_streams(self) -> None:
        for _, holding in _stream_limits:
            holding.discard(self)

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """As torch_npu's: re-issue every recorded call with new host
        arguments (one dict per call in capture order, or one for all), on
        the dispatch mode's update stream; with nothing recorded, nothing
        happens (torch_npu says nothing either). Raises if the graph was not
        captured with ``auto_dispatch_capture``, or if its previous replay is
        still in flight (see :meth:`check_update_ordered`)."""
        if not self.auto_dispatch_capture:
            raise ReplayError(
                "this graph was captured without auto_dispatch_capture, so it cannot be updated; "
                "set graph.auto_dispatch_capture = True before capture (torch_npu refuses it too)"
            )
        if self._state != "captured":
            raise ReplayError(f"update of a graph that is {self._state}; capture it first")
        records = self._dispatch_records
        if not records:
            return
        if len(cpu_update_input) == 1:
            cpu_update_input = [cpu_update_input[0]] * len(records)
        if len(cpu_update_input) != len(records):
            raise ReplayError(
                f"update got {len(cpu_update_input)} dicts for {len(records)} captured "
                "updatable operators; pass one dict for all, or one per operator in "
                "capture order"
            )
        self.check_update_ordered(GraphDispatchMode.update_stream, "NPUGraph.update")
        for record, changes in zip(records, cpu_update_input):
            record.update(changes)

    def records_updatable(self, func: Any) -> bool:
        """Whether the capture under way records ``func`` for :meth:`update`."""
        return self.auto_dispatch_capture and self.graph_dispatch_mode.entered > 0 and records(func)

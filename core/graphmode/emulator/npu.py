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

The Ascend plugin drives this module on the CPU exactly as it drives
``torch.npu`` on an NPU, so both of its update paths run for real in CI.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.emulator.capture import UpdateSession, call_site, current_session, is_updatable
from graphmode.emulator.graph import EmulatedGraph
from graphmode.emulator.recording import EventReset, EventWait, TaskGroup
from graphmode.errors import CaptureError, ReplayError

__all__ = [
    "ExternalEvent",
    "NPUGraph",
    "Stream",
    "TaskGroupHandle",
    "current_stream",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "recorded_operators",
    "stream",
    "stream_limit",
    "synchronize",
]


class Stream:
    """A stream; the emulator runs everything in order, on the host."""

    def synchronize(self) -> None:
        """Nothing is ever in flight on the emulator."""

    def __repr__(self) -> str:
        return f"<emulated stream {id(self):#x}>"


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
    """Nothing is ever in flight on the emulator."""


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


def graph_task_group_begin(stream: Stream) -> None:
    session = _capturing("graph_task_group_begin")
    group = TaskGroup()
    session.append(group)
    session.targets.append(group.steps)
    session.open_groups.append(group)


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    session = _capturing("graph_task_group_end")
    if not session.open_groups:
        raise CaptureError("graph_task_group_end without graph_task_group_begin")
    session.targets.pop()
    return TaskGroupHandle(session.open_groups.pop())


_update: list[UpdateSession] = []


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    if current_session() is not None:
        raise ReplayError("graph_task_update_begin inside a capture: update after capture_end")
    if _update:
        raise ReplayError("graph_task_update_begin while another task update is open")
    if not isinstance(handle, TaskGroupHandle):
        raise ReplayError(f"graph_task_update_begin needs a handle from graph_task_group_end, got {handle!r}")
    session = UpdateSession(handle.group())
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
    """``torch.npu.NPUGraph`` on the emulator: its own ``graph_dispatch_mode``
    records the updatable calls, only while the caller has it entered; each
    captured graph holds device streams until it is reset or freed."""

    def __init__(self) -> None:
        super().__init__()
        self.graph_dispatch_mode = GraphDispatchMode(self)

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
        self._release_streams()

    def _release_streams(self) -> None:
        for _, holding in _stream_limits:
            holding.discard(self)

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """As torch_npu's: with nothing recorded, there is nothing to do (it
        says nothing either); see :meth:`EmulatedGraph.update` otherwise."""
        if self._state == "captured" and not self._dispatch_records:
            return
        super().update(cpu_update_input)

    def records_updatable(self, func: Any) -> bool:
        return self.auto_dispatch_capture and self.graph_dispatch_mode.entered > 0 and records(func)

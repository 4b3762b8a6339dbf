"""An NPU-like runtime on the emulator: streams, external events and ACL
task groups, with the calling conventions of ``torch.npu`` in torch_npu.

On Ascend, kernels that take host values (the kv lengths of fused attention)
are captured inside a task group behind an external-event wait; before each
replay the runner re-issues them with new host values between
``graph_task_update_begin`` and ``graph_task_update_end`` on an update stream
and records the event, which lets the replay proceed. A replay whose event
was not recorded waits forever on the device; here it raises.

The Ascend plugin drives this module on the CPU exactly as it drives
``torch.npu`` on an NPU, so both of its update paths run for real in CI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from graphmode.emulator.capture import UpdateSession, call_site, current_session
from graphmode.emulator.recording import EventReset, EventWait, TaskGroup
from graphmode.errors import CaptureError, ReplayError

__all__ = [
    "ExternalEvent",
    "Stream",
    "current_stream",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "stream",
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


def graph_task_group_begin(stream: Stream) -> None:
    session = _capturing("graph_task_group_begin")
    group = TaskGroup()
    session.append(group)
    session.targets.append(group.steps)
    session.open_groups.append(group)


def graph_task_group_end(stream: Stream) -> TaskGroup:
    session = _capturing("graph_task_group_end")
    if not session.open_groups:
        raise CaptureError("graph_task_group_end without graph_task_group_begin")
    session.targets.pop()
    return session.open_groups.pop()


_update: list[UpdateSession] = []


def graph_task_update_begin(stream: Stream, handle: TaskGroup) -> None:
    if current_session() is not None:
        raise ReplayError("graph_task_update_begin inside a capture: update after capture_end")
    if _update:
        raise ReplayError("graph_task_update_begin while another task update is open")
    if not isinstance(handle, TaskGroup):
        raise ReplayError(f"graph_task_update_begin needs a handle from graph_task_group_end, got {handle!r}")
    session = UpdateSession(handle)
    session.__enter__()
    _update.append(session)


def graph_task_update_end(stream: Stream) -> None:
    if not _update:
        raise ReplayError("graph_task_update_end without graph_task_update_begin")
    session = _update.pop()
    session.__exit__(None, None, None)
    session.finish()

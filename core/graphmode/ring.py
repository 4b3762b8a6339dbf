"""Host staging's mirrors: whose turn it is, and the ordering of their
copies (graphmode.staging says what host staging is).

The host must not write a pinned mirror before the copy launched from it
has run. Steps take the :data:`SLOTS` mirrors in turn, in groups of
:data:`GROUP`; an event is recorded after the copy from a group's last
mirror, and a step that starts a group waits on that group's event from
the previous lap: with four mirrors in pairs, for the copy launched three
steps before it. :class:`Ring` is the Python ring (the emulator, and CUDA
where ``graphmode.native`` is not built); ``graphmode.native``'s C++
``Ring`` is the same, used on CUDA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphmode.emulator import stream as emulated_stream
from graphmode.native import native_module

__all__ = ["GROUP", "SLOTS", "Ring", "native_ring"]

#: Pinned mirrors, used in turn: a step written while earlier ones run waits only
#: for a copy SLOTS - GROUP + 1 steps back.
SLOTS = 4
#: Consecutive mirrors whose copies one event orders: an event record costs the
#: host about as much as a launch (3 to 5 us on the H100), so one per GROUP steps.
GROUP = 2


class Ring:
    """The mirrors' turns and the ordering of their copies: the mirrors in
    groups of :data:`GROUP` consecutive ones, an event per group, recorded
    after the copy from its last mirror (or, when that step stopped before
    its copy, as the next group is entered), and waited on before the
    group's first mirror is written again: that wait covers every copy from
    the group, which ran before the event in stream order. One record every
    :data:`GROUP` steps, not one per step (``graphmode.native`` has the same
    in C++, ``Ring``, used on CUDA where it is built)."""

    def __init__(self, device: torch.device, emulated: bool) -> None:
        event = emulated_stream.Event if emulated else torch.cuda.Event
        self.events: list[Any] = [event() for _ in range(SLOTS // GROUP)]
        self.recorded = [False] * (SLOTS // GROUP)
        self.pending = [False] * (SLOTS // GROUP)  # a copy launched since the group's event was recorded
        self.stream = None if emulated else _CurrentStream(device)
        self.slot = SLOTS - 1  # the first step takes mirror 0

    def begin(self) -> int:
        slot = (self.slot + 1) % SLOTS
        if slot % GROUP == 0:
            left = self.slot // GROUP
            if self.pending[left]:  # the group just left ended with a step stopped before its copy
                self._record(left)
            group = slot // GROUP
            if self.recorded[group]:
                self.events[group].synchronize()
        self.slot = slot
        return slot

    def copy(self, arena: torch.Tensor, mirror: torch.Tensor) -> None:
        group = self.slot // GROUP
        if self.stream is None:  # the emulator
            emulated_stream.launch(functools.partial(arena.copy_, mirror))
        else:
            arena.copy_(mirror, non_blocking=True)
        self.pending[group] = True
        if self.slot % GROUP == GROUP - 1:
            self._record(group)

    def _record(self, group: int) -> None:
        if self.stream is None:  # the emulator
            self.events[group].record()
        else:  # on the stream the copies ran on (the arena device's current one)
            self.events[group].record(self.stream())
        self.recorded[group], self.pending[group] = True, False

    def wait(self) -> None:
        for group in range(SLOTS // GROUP):
            if self.pending[group]:
                self._record(group)
            if self.recorded[group]:
                self.events[group].synchronize()


def native_ring(device: torch.device) -> Any:
    """The C++ ring (graphmode.native) for a CUDA device, or None."""
    module = native_module()
    if module is None or device.type != "cuda":
        return None
    return module.Ring(SLOTS, GROUP, device.index if device.index is not None else torch.cuda.current_device())


class _CurrentStream:
    """``torch.cuda.current_stream(device)``, the Stream object made once per
    stream: ``current_stream()`` builds a new one at every call (a few
    microseconds of Python per step, more than the event record it is for)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index
        self._id: int | None = None
        self._stream: Any = None
        self._query = getattr(torch._C, "_cuda_getCurrentStream", None)

    def __call__(self) -> Any:
        if self._query is None:  # a build without it: the public call
            return torch.cuda.current_stream(self.index)
        stream_id, index, kind = self._query(self.index)
        if stream_id != self._id:
            self._stream = torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)
            self._id = stream_id
        return self._stream

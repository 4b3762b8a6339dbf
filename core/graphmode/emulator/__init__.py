"""The CPU graph emulator: device-graph semantics without a device.

On ``device="cpu"`` the runner captures and replays :class:`EmulatedGraph`
through the same code as on a GPU, so graph-mode bugs (stale buffers, frozen
host values, padding writes) show up in CI and on laptops.
"""

from graphmode.emulator import npu
from graphmode.emulator.capture import current_session, register_updatable
from graphmode.emulator.graph import EmulatedGraph, EmulatedPool
from graphmode.emulator.host import is_host, is_pinned_host, mark_host

__all__ = [
    "EmulatedGraph",
    "EmulatedPool",
    "current_session",
    "is_host",
    "is_pinned_host",
    "mark_host",
    "npu",
    "register_updatable",
]

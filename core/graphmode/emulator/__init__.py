"""The CPU graph emulator: device-graph semantics without a device.

On ``device="cpu"`` the runner captures and replays :class:`EmulatedGraph`
through the same code as on a GPU, so graph-mode bugs (stale buffers, frozen
host values, padding writes, host reads on the replay path) show up in CI and
on laptops. A vendor models its own runtime on top of it through the
extension point described in ``capture.py`` (``EmulatedGraph.record_call``).
"""

from graphmode.emulator.capture import CaptureSession, call_site, current_session
from graphmode.emulator.graph import EmulatedGraph, EmulatedPool
from graphmode.emulator.host import is_host, is_pinned_host, mark_host
from graphmode.emulator.replay import ReplayHostReadGuard

__all__ = [
    "CaptureSession",
    "EmulatedGraph",
    "EmulatedPool",
    "ReplayHostReadGuard",
    "call_site",
    "current_session",
    "is_host",
    "is_pinned_host",
    "mark_host",
]

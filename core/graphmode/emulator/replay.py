"""Host reads of device memory on the replay path, refused on the emulator.

A replay step (the vendor's fill, its graph-parameter update, the replay and
the outputs) must not read a device value on the host: on a device each such
read (``.item()``, ``.tolist()``, ``.cpu()``, printing, ``bool()``, ...)
waits for the device, every step. On the emulator every tensor is a CPU
tensor, so :class:`ReplayHostReadGuard` refuses reads of memory not marked as
host memory (:func:`graphmode.emulator.mark_host`, which
``graphmode.buffers.host_zeros`` applies), naming the hook that was running.
Host memory reads are fine: Ascend reads its host kv-length buffer every step.

The emulator's own replay runs with torch functions disabled (a device replay
runs no Python), so the guard costs only the calls the hooks make.
"""

from __future__ import annotations

from typing import Any

from graphmode.emulator.capture import HostReadGuard, call_site
from graphmode.errors import ReplayError

__all__ = ["ReplayHostReadGuard", "host_read_error"]


def host_read_error(hook: str, what: str, where: str) -> ReplayError:
    """The error for a host read of device memory during a replay step."""
    return ReplayError(
        f"{hook} read a device value on the host during a replay step ({what}{where}): on a device "
        "that read waits for the device to finish, every step. Read a host copy instead (a buffer "
        "allocated with graphmode.buffers.host_zeros, or the engine's host-side values such as "
        "attn_metadata.kv_seqlens_cpu), or keep the value on the device"
    )


class ReplayHostReadGuard:
    """``with guard:`` around a replay step refuses host reads of device
    memory; :meth:`running` names the hook that runs now, for the error.
    Reusable, one step after another; not reentrant."""

    def __init__(self) -> None:
        self.hook = "the replay step"
        self._mode = HostReadGuard(self._refuse)

    def running(self, hook: str) -> None:
        """Name what runs from now on in this step (a hook's name)."""
        self.hook = hook

    def __enter__(self) -> ReplayHostReadGuard:
        self.hook = "the replay step"
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _refuse(self, what: str) -> ReplayError:
        return host_read_error(self.hook, f"{what} of device memory", f", called at {call_site()}")

"""An asynchronous (and optionally slow) device for the emulator.

On a device, ``graph.replay()`` and a copy from pinned host memory return as
soon as they are launched: the device runs them later, in launch order, while
the host goes on (and may write host memory the launched work has not read
yet). The emulator runs everything at once by default. Within
:func:`asynchronous`, launched work (:func:`launch`: graph replays, host
staging's copy, and whatever a test launches) runs instead on a thread of its
own, in launch order, each piece ``delay`` seconds after the previous one
finished; the host thread returns from the launch at once. :class:`Event`
marks a point of that order, which the host waits for (``synchronize``).

So a runner that writes host memory a launched replay still reads is caught
on the CPU: the replay reads what the host wrote later, and its result
differs from eager.

Only launched work is asynchronous: every other operation runs at once on
the calling thread, as if the device were idle. Code under test orders its
own device accesses through :func:`launch` (a read of a result launched after
the step that produced it, as an engine samples on the device) or
:func:`synchronize`; a step with device inputs, whose fill copies run on the
host thread here, must not be issued while a replay is in flight.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from graphmode.emulator import in_flight as pinned_copies

__all__ = ["Event", "asynchronous", "in_flight", "launch", "synchronize"]


class _Device:
    """A thread that runs launched work in order, ``delay`` seconds apart."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.error: BaseException | None = None
        self._work: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="graphmode-emulated-device", daemon=True)
        self._thread.start()

    def launch(self, work: Callable[[], object]) -> None:
        self._work.put(work)

    def marker(self) -> threading.Event:
        """A flag the device sets once it has run everything launched before."""
        reached = threading.Event()
        self._work.put(reached.set)
        return reached

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                work = self._work.get()
                if work is None:
                    return
                if isinstance(getattr(work, "__self__", None), threading.Event):
                    work()  # a marker: no device time
                    continue
                if self.delay:
                    time.sleep(self.delay)
                if self.error is None:
                    try:
                        work()
                    except BaseException as error:  # reported to the host at its next wait
                        self.error = error


_active: list[_Device] = []


@contextlib.contextmanager
def asynchronous(delay: float = 0.0) -> Iterator[None]:
    """Within this block launched work runs on the emulated device's own
    thread, each piece ``delay`` seconds after the previous one; leaving it
    waits for all of it (and raises what it raised)."""
    if _active:
        raise RuntimeError("graphmode.emulator.stream.asynchronous() is already active")
    device = _Device(delay)
    _active.append(device)
    try:
        yield
        synchronize()
    finally:
        _active.pop()
        device.close()


def in_flight() -> bool:
    """Whether launched work runs asynchronously now (within :func:`asynchronous`)."""
    return bool(_active)


def launch(work: Callable[[], object]) -> None:
    """Run ``work`` on the emulated device: at once, or within
    :func:`asynchronous` later, after the work launched before it."""
    if _active:
        _active[-1].launch(work)
    else:
        work()


def synchronize() -> None:
    """Wait until the emulated device has run everything launched."""
    Event().record().synchronize()


class Event:
    """``torch.cuda.Event`` on the emulator: :meth:`record` marks the point
    of the launch order reached so far; :meth:`synchronize` waits for it."""

    def __init__(self) -> None:
        self._reached: threading.Event | None = None
        self._copies = 0  # the copies in flight it orders (emulator.in_flight)

    def record(self) -> Event:
        self._reached = _active[-1].marker() if _active else None
        self._copies = pinned_copies.mark()
        return self

    def synchronize(self) -> None:
        if self._reached is not None:
            self._reached.wait()
        pinned_copies.complete(self._copies)
        _raise_device_error()

    def query(self) -> bool:
        return self._reached is None or self._reached.is_set()


def _raise_device_error() -> None:
    if _active and _active[-1].error is not None:
        error, _active[-1].error = _active[-1].error, None
        raise error

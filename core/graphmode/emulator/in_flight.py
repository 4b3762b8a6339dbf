"""Copies from pinned host memory still in flight when the host rewrites it.

On a device, ``device.copy_(pinned, non_blocking=True)`` returns at once;
the copy runs later, in stream order, and reads the pinned memory as it is
then. A vendor that stages every step's lengths through ONE pinned buffer is
right while steps are synchronised, but an engine issuing two steps back to
back rewrites the buffer before the first step's copy ran: that step reads
the second's lengths (an H200: 0.0205 off eager). The emulator runs every
copy at once, so it tracks them instead, while :func:`tracked` is active (a
test issuing steps back to back, with no host wait between them): each such
copy made on a replay step's path is in flight, with a snapshot of what it
copied, until the host waits for it (``stream.synchronize()``, or
``Event.synchronize()`` of an event recorded after it); a copy whose source
no longer holds its snapshot while in flight, seen at the next such copy or
replay (:func:`check`), raises :class:`~graphmode.errors.ReplayError`
naming where the copy was issued. Outside :func:`tracked` the device is
idle between steps, as the emulator's synchronous model has it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from graphmode.errors import ReplayError

__all__ = ["check", "complete", "issued", "mark", "tracked", "tracking"]

_sequence = itertools.count(1)


@dataclass
class _Copy:
    number: int
    source: torch.Tensor  # the pinned memory the copy reads (a view)
    snapshot: torch.Tensor  # what it held when the copy was issued
    where: str  # the hook and the call site


_active: list[list[_Copy]] = []


@contextlib.contextmanager
def tracked() -> Iterator[None]:
    """Track copies from pinned host memory as in flight inside the block."""
    _active.append([])
    try:
        yield
    finally:
        _active.pop()


def tracking() -> bool:
    return bool(_active)


def mark() -> int:
    """The point of the copy order reached so far (an event's record)."""
    return next(_sequence)


def issued(source: torch.Tensor, where: str) -> None:
    """A non-blocking copy from pinned host memory ``source`` was issued."""
    if _active:
        check()
        _active[-1].append(_Copy(next(_sequence), source, source.clone(), where))


def complete(upto: int | None = None) -> None:
    """The host waited for every copy issued before ``upto`` (all: None)."""
    if _active:
        _active[-1][:] = [c for c in _active[-1] if upto is not None and c.number > upto]


def check() -> None:
    """Refuse when the host rewrote the source of a copy still in flight."""
    for copy in _active[-1] if _active else ():
        if not torch.equal(copy.source, copy.snapshot):
            now, then = copy.source.reshape(-1)[:8].tolist(), copy.snapshot.reshape(-1)[:8].tolist()
            raise ReplayError(
                f"pinned host memory rewritten while a copy from it is in flight: the non-blocking copy issued in "
                f"{copy.where} read {then} when issued, but the host has since written {now} there, and nothing "
                "the host waited on (an event recorded after the copy, then synchronized; stream.synchronize()) "
                "says the copy ran. On a device the copy runs later, in stream order, and reads what the host "
                "wrote last: when steps are issued back to back, the earlier step reads the later one's values "
                "(right when every step is synchronised). Give every step in flight a pinned buffer of its own "
                "(a ring of them, each reused only after an event recorded after its copy completed: "
                "graphmode.ring), or copy from the engine's host tensors of the step"
            )

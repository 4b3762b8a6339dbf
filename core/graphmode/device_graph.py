"""DeviceGraph: the one interface the runner needs from any device graph.

The vocabulary is ``torch.accelerator.Graph``'s: ``capture_begin``,
``capture_end``, ``replay``, ``reset``, ``pool``, ``debug_dump``. Adapters wrap
``torch.cuda.CUDAGraph``, ``torch.accelerator.Graph``, a vendor's graph class,
or the CPU emulator.
"""

from __future__ import annotations

import abc
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

__all__ = ["DeviceGraph"]


class DeviceGraph(abc.ABC):
    """A graph captured once and replayed many times on one device.

    Contract, as for CUDA graphs: tensors the captured work reads are read at
    their fixed addresses on every replay; host values are frozen at capture;
    outputs are written into the tensors the capture produced.
    """

    @abc.abstractmethod
    def capture_begin(self, pool: Any = None) -> None:
        """Start recording device work on this graph's capture stream.
        ``pool`` is another graph's :meth:`pool` token to share memory with."""

    @abc.abstractmethod
    def capture_end(self) -> None:
        """Stop recording; the graph can replay afterwards."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the captured work again."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop the captured work; the graph can be captured again."""

    @abc.abstractmethod
    def pool(self) -> Any:
        """The token of this graph's memory pool."""

    def debug_dump(self, path: str) -> None:
        """Write a description of the captured work to ``path``."""
        raise NotImplementedError(f"{type(self).__name__} has no debug dump")

    def enable_debug_mode(self) -> None:
        """Keep what :meth:`debug_dump` needs from the next capture: call it
        before :meth:`capture_begin`. torch's CUDA, MLU and accelerator
        graphs write a dump only when asked so before capture; a graph that
        needs no asking (the emulator's, torch_npu's) does nothing here."""
        return None

    @contextlib.contextmanager
    def capture(self, pool: Any = None) -> Iterator[None]:
        """``with graph.capture(pool): forward()`` records ``forward``.

        If the body fails, the capture is still ended and the body's error is
        the one raised (an error from ending a broken capture says nothing new).

        Python's cyclic garbage collector is paused while the graph records.
        A collection during a capture runs the finalizers of whatever it
        frees (an earlier runner's graphs, events, tensors), in the capturing
        thread; a finalizer that calls a device API the capture forbids
        invalidates it, and the next kernel launch fails ("operation failed
        due to a previous error during capture", seen on an H100 after a
        collection of 3808 objects mid-capture). The garbage is collected
        after the capture instead.
        """
        with _collector_paused():
            self.capture_begin(pool)
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):
                    self.capture_end()
                raise
            self.capture_end()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

"""Warm-up progress: a tqdm bar on rank 0, messages through logging.

graphmode is a library: it writes nothing to stderr itself. Each capture of a
warm-up is a DEBUG record of the ``graphmode`` logger and the whole warm-up
one INFO record (how many graphs, how long, the device memory left), shown
only when the application configures logging. A bar is drawn when tqdm is
installed (the ``hf`` extra installs it), on rank 0 of a process group only,
and by tqdm's own rule only on a terminal; without tqdm there is no bar.
"""

from __future__ import annotations

import logging
import time
from typing import IO, Any

import torch

__all__ = ["CaptureProgress", "free_memory", "logger"]

logger = logging.getLogger("graphmode")


def free_memory(device: torch.device) -> str:
    """The device memory left, in words (the emulator's graphs use host memory)."""
    module: Any = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(module, "mem_get_info"):
        return "emulated graphs (host memory)"
    free, _ = module.mem_get_info(device)
    return f"{free / 2**30:.2f} GiB free"


def _rank_zero() -> bool:
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0


class CaptureProgress:
    """One warm-up's captures, ``total`` of them: call it with each capture's
    message (and whether it is the last of its kind) as the capture starts;
    use it as a context manager, which closes the bar and logs the summary.

    ``bar``: False never draws one (``warmup(progress=False)``). ``file``:
    where the bar goes (tqdm's default, stderr, when None)."""

    def __init__(self, total: int, device: torch.device, *, bar: bool = True, file: IO[str] | None = None) -> None:
        self.total, self.device, self.done = total, device, 0
        self.started = time.perf_counter()
        self._bar: Any = None
        if bar and total and _rank_zero():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass  # tqdm is optional: no bar
            else:
                # disable=None: tqdm draws only on a terminal, so logs and CI output stay clean.
                self._bar = tqdm(total=total, desc="graphmode: capturing", unit="graph", disable=None, file=file)

    def __call__(self, message: str, last: bool = False) -> None:
        self.done += 1
        logger.debug("%s, %s", message, free_memory(self.device))
        if self._bar is not None:
            self._bar.set_postfix_str(f"{message.removeprefix('capturing ')}, {free_memory(self.device)}")
            self._bar.update(1)

    def __enter__(self) -> CaptureProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.done:
            logger.info("captured %d graphs in %.2f s; %s", self.done, time.perf_counter() - self.started,
                        free_memory(self.device))

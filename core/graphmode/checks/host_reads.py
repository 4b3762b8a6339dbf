"""The runner's guard against host reads of device values on the replay path.

The runner enters one guard around each replay step (fill, parameter update,
replay, outputs) and names the hook that runs. A read caught there raises a
:class:`graphmode.ReplayError` naming that hook:

- on the CPU emulator, always: :class:`graphmode.emulator.ReplayHostReadGuard`
  refuses reads of memory not marked as host memory;
- on CUDA, only with ``$GRAPHMODE_CHECK_HOST_READS=1`` (the conformance suite
  sets it): the step runs under ``torch.cuda.set_sync_debug_mode("error")``.
  PyTorch raises there on ``memcpy_and_sync`` (``.item()``, ``.tolist()``,
  ``.cpu()``, blocking device-to-host copies, ``nonzero``) and on
  ``stream_synchronize`` (``Stream.synchronize()``), per
  ``c10/cuda/CUDAFunctions.h``, ``aten/src/ATen/native/cuda/CUDAScalar.cu``
  and ``Copy.cu`` (torch 2.5 to 2.13); ``torch.cuda.synchronize()`` and
  ``Event.synchronize()`` are not caught. The mode is process-wide, so the
  step's other threads are checked too while it is set.
- elsewhere, nothing.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphmode.emulator.replay import ReplayHostReadGuard, host_read_error

__all__ = ["ENV_CHECK_HOST_READS", "CudaSyncGuard", "NoGuard", "replay_guard"]

ENV_CHECK_HOST_READS = "GRAPHMODE_CHECK_HOST_READS"
_CUDA_SYNC_ERROR = "called a synchronizing CUDA operation"


class NoGuard:
    """Checks nothing (devices without a check, or CUDA unless asked)."""

    def running(self, hook: str) -> None:
        pass

    def __enter__(self) -> NoGuard:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CudaSyncGuard:
    """The replay step under ``torch.cuda.set_sync_debug_mode("error")``,
    the previous mode restored after it; a synchronising call is re-raised
    as a ReplayError naming the hook."""

    def __init__(self) -> None:
        self.hook = "the replay step"
        self._previous = 0

    def running(self, hook: str) -> None:
        self.hook = hook

    def __enter__(self) -> CudaSyncGuard:
        self.hook = "the replay step"
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        torch.cuda.set_sync_debug_mode(self._previous)
        if isinstance(error, RuntimeError) and _CUDA_SYNC_ERROR in str(error):
            raise host_read_error(self.hook, "a synchronizing CUDA operation, under set_sync_debug_mode('error')", "") from error


def replay_guard(device: torch.device) -> ReplayHostReadGuard | CudaSyncGuard | NoGuard:
    """The guard for replay steps on ``device`` (see the module's doc)."""
    if device.type == "cpu":
        return ReplayHostReadGuard()
    if device.type == "cuda" and os.environ.get(ENV_CHECK_HOST_READS, "").strip() not in ("", "0"):
        return CudaSyncGuard()
    return NoGuard()

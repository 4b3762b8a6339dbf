"""Host reads of device memory on the replay path, refused on the emulator.

A replay step (the vendor's fill, its graph-parameter update, the replay and
the outputs) must not read a device value on the host: on a device each such
read (``.item()``, ``.tolist()``, ``.cpu()``, printing, ``bool()``, ...)
waits for the device, every step. On the emulator every tensor is a CPU
tensor, so :class:`ReplayHostReadGuard` refuses reads of memory not marked as
host memory (:func:`graphmode.emulator.mark_host`, which
``graphmode.buffers.host_zeros`` applies), naming the hook that was running.
Host memory reads are fine: Ascend reads its host kv-length buffer every step.
A copy of device memory into host memory is refused too (``host.copy_(x)``,
``host[:n] = x``, ``torch._foreach_copy_``, an in-place operator or ``out=``
writing host memory from device memory): on a device it is a device-to-host
read like ``.cpu()``, however the value lands. The engine's host tensors are
host memory too: on the emulator an engine marks them (the reference engine
marks ``kv_seqlens_cpu``; host staging's copies are marked).

The emulator's own replay runs with torch functions disabled (a device replay
runs no Python), so the guard costs only the calls the hooks make.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmode.emulator import in_flight
from graphmode.emulator.capture import HostReadGuard, call_site
from graphmode.emulator.host import is_host, is_pinned_host
from graphmode.emulator.stream_order import note_inputs_written
from graphmode.errors import ReplayError
from graphmode.tensor_trees import tensors_in

__all__ = ["ReplayHostReadGuard", "copies_to_host", "host_read_error"]


def host_read_error(hook: str, what: str, where: str) -> ReplayError:
    """The error for a host read of device memory during a replay step."""
    return ReplayError(
        f"{hook} read a device value on the host during a replay step ({what}{where}): on a device "
        "that read waits for the device to finish, every step. Read a host copy instead (a buffer "
        "declared BufferSpec(..., host=True), read as meta.input_buffers[name], filled from the engine's "
        "host-side values such as attn_metadata.kv_seqlens_cpu), or keep the value on the device"
    )


class ReplayHostReadGuard:
    """``with guard:`` around a replay step refuses host reads of device
    memory; :meth:`running` names the hook that runs now, for the error.
    Reusable, one step after another; not reentrant."""

    def __init__(self) -> None:
        self.hook = "the replay step"
        self._mode = _ReplayMode(self._refuse, self._where)

    def running(self, hook: str) -> None:
        """Name what runs from now on in this step (a hook's name). The end
        of ``graphmode_fill_buffers`` is where the step's inputs have been
        written, on the current stream (``stream_order``)."""
        if self.hook == "graphmode_fill_buffers" and hook != self.hook:
            note_inputs_written()
        self.hook = hook

    def _where(self) -> str:
        return f"{self.hook}, called at {call_site()}"

    def __enter__(self) -> ReplayHostReadGuard:
        self.hook = "the replay step"
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _refuse(self, what: str) -> ReplayError:
        if what.endswith("into host memory"):  # a copy (copies_to_host)
            what = what.replace("() into host memory", "() of device memory into host memory")
        else:
            what = f"{what} of device memory"
        return host_read_error(self.hook, what, f", called at {call_site()}")


class _ReplayMode(HostReadGuard):
    """:class:`HostReadGuard`, plus copies of device memory into host memory;
    non-blocking copies from pinned host memory are noted as in flight
    (``in_flight``, while tracked)."""

    def __init__(self, refuse: Any, where: Any) -> None:
        super().__init__(refuse)
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copied = copies_to_host(func, args, kwargs)
        if copied is not None:
            raise self.refuse(copied)
        if in_flight.tracking() and getattr(func, "__name__", "") == "copy_" and len(args) >= 2:
            destination, source = args[0], args[1]
            if (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and isinstance(source, torch.Tensor) \
                    and is_pinned_host(source) and not is_host(destination):
                in_flight.issued(source, self.where())
        return super().__torch_function__(func, types, args, kwargs)


def copies_to_host(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What a call that writes device memory into host memory is called
    (``Tensor.copy_() into host memory``), or None for any other call."""
    name = getattr(func, "__name__", str(func))
    if func is torch._foreach_copy_:
        pairs = list(zip(tensors_in(args[0]), tensors_in(args[1] if len(args) > 1 else kwargs.get("src"))))
    elif name == "__setitem__" and len(args) == 3 and isinstance(args[0], torch.Tensor):
        pairs = [(args[0], t) for t in tensors_in(args[1:])]
    elif name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor):
        pairs = [(args[0], t) for t in tensors_in((args[1:], kwargs))]  # in place: copy_, add_, index_copy_, ...
    elif isinstance(kwargs.get("out"), torch.Tensor):
        pairs = [(kwargs["out"], t) for t in tensors_in((args, {k: v for k, v in kwargs.items() if k != "out"}))]
    else:
        return None
    if any(is_host(destination) and not is_host(source) for destination, source in pairs):
        prefix = "torch." if func is torch._foreach_copy_ else "Tensor."
        return f"{prefix}{name}() into host memory"
    return None

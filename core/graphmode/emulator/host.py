"""Host tensors: memory the emulator treats as living on the host.

On a device, a CPU tensor is host memory: reading it on the host inside a
capture is allowed and freezes the value read. On the emulator every tensor is
a CPU tensor, so host memory is marked explicitly. Vendors allocate host
buffers with :func:`graphmode.buffers.host_zeros`, which marks them.

Host memory is pageable or pinned (page-locked), as on a device: a copy
between pinned host memory and the device inside a capture becomes a memcpy
node that reads (or writes) the host memory live at every replay; the same
copy from pageable memory is refused, as CUDA refuses it.

What an operator computes from host memory alone is host memory too, as on
a device, where it runs on the host and returns CPU tensors
(``kv_seqlens_cpu.to(torch.int32)``): the emulator's guards mark it
(:func:`mark_derived`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["is_host", "is_pinned_host", "mark_derived", "mark_host", "pageable_move"]

#: Calls that move a tensor to the device (``x.cuda()``; ``x.to(device)`` is told by its arguments).
_MOVES = frozenset({"cuda", "npu", "mlu", "xpu", "musa"})

# storage address -> (a weak reference to the marked storage, whether the memory is pinned). The mark lives
# as long as the memory does: a view kept past its owner (a slice of a dropped runner's host buffer) is still
# host memory, as a CPU tensor is on a device; once the storage is freed its address may be device memory.
_host_storages: dict[int, tuple[StorageWeakRef, bool]] = {}
_swept_at = [64]  # _host_storages' size at which freed storages' marks are dropped next


def mark_host(tensor: torch.Tensor, *, pinned: bool | None = None) -> torch.Tensor:
    """Mark ``tensor``'s memory as host memory, pageable or ``pinned``
    (page-locked), and return the tensor; ``pinned=None`` leaves marked memory
    as it is and marks unmarked memory pageable. The mark is the memory's
    (its storage's), for every view of it, for as long as the memory lives."""
    if not is_host(tensor) or (pinned is not None and pinned != is_pinned_host(tensor)):
        storage = tensor.untyped_storage()
        _host_storages[storage.data_ptr()] = (StorageWeakRef(storage), bool(pinned))
        if len(_host_storages) >= _swept_at[0]:
            for key in [key for key, (ref, _) in list(_host_storages.items()) if ref.expired()]:
                _host_storages.pop(key, None)
            _swept_at[0] = max(64, 2 * len(_host_storages))
    return tensor


def mark_derived(func: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """Mark the tensors ``func(*args, **kwargs)`` returned as host memory
    when every tensor it was given is (at least one): pinned for
    ``pin_memory()``, else pageable. A call that names a device
    (``x.to(device)``, ``device=``, ``x.cuda()``) is a copy to the device
    there, and is not marked; only the string ``"cpu"`` names the host (a
    ``torch.device`` is the device's in device-agnostic code, ``y.device``,
    though on the emulator it is the CPU)."""
    inputs = [x for value in (*args, *kwargs.values())
              for x in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(x, torch.Tensor)]
    if not inputs or not all(map(is_host, inputs)):
        return
    name = getattr(func, "__name__", "")
    named = [v for v in (*args[1:], kwargs.get("device")) if isinstance(v, (str, torch.device))] \
        if name == "to" or "device" in kwargs else []
    if name in _MOVES or any(device != "cpu" for device in named):  # a torch.device too: see _targets_cpu
        return
    for tensor in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(tensor, torch.Tensor) and tensor.numel() and tensor.layout == torch.strided:
            mark_host(tensor, pinned=True if name == "pin_memory" else None)


def _mark(tensor: torch.Tensor) -> tuple[StorageWeakRef, bool] | None:
    key = tensor.untyped_storage().data_ptr()
    entry = _host_storages.get(key)
    if entry is None:
        return None
    ref = entry[0]
    if ref.expired():  # the marked memory was freed: this is other memory at its address
        _host_storages.pop(key, None)
        return None
    if ref.cdata != tensor.untyped_storage()._cdata:  # the marked storage moved (resized): other memory here
        return None
    return entry


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it views) was marked as host memory."""
    return _mark(tensor) is not None


def is_pinned_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it views) was marked as pinned host memory."""
    entry = _mark(tensor)
    return entry is not None and entry[1]


PAGEABLE_MOVE = (
    "Tensor.to(device) of pageable host memory inside graph capture: CUDA refuses it ('Cannot copy between CPU "
    "and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned'). Called at {site}. A graph would "
    "read the value the host held at capture at every replay: compute it on the device from device tensors "
    "(attn.kv_seqlens, not kv_seqlens_cpu), or declare it a buffer (BufferSpec) the fill refreshes every step."
)


def pageable_move(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` copies pageable host memory to the device:
    ``Tensor.to`` of a host tensor naming a device other than the string
    "cpu" (a ``torch.device`` object is the device's, ``query.device``, as in
    :func:`mark_derived`), or a device tensor to match; ``x.cuda()`` and the
    like. On a device that is a host-to-device copy, which a graph capture
    takes from pinned memory only (CUDA refuses pageable memory), where the
    emulator would run it once, at capture, and freeze its value."""
    if not args or not isinstance(args[0], torch.Tensor) or not is_host(args[0]) or is_pinned_host(args[0]):
        return False
    name = getattr(func, "__name__", "")
    if name in _MOVES:
        return True
    if name != "to":
        return False
    for value in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        if isinstance(value, torch.Tensor) and not is_host(value):
            return True
        if isinstance(value, torch.device) or (isinstance(value, str) and value.split(":")[0] != "cpu"):
            return True
    return False

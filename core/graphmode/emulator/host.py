"""Host tensors: memory the emulator treats as living on the host.

On a device, a CPU tensor is host memory: reading it on the host inside a
capture is allowed and freezes the value read. On the emulator every tensor is
a CPU tensor, so host memory is marked explicitly. Vendors allocate host
buffers with :func:`graphmode.buffers.host_zeros`, which marks them.

Host memory is pageable or pinned (page-locked), as on a device: a copy
between pinned host memory and the device inside a capture becomes a memcpy
node that reads (or writes) the host memory live at every replay; the same
copy from pageable memory is refused, as CUDA refuses it.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["is_host", "is_pinned_host", "mark_host"]

# storage address -> (the tensor owning the mark, whether the memory is pinned)
_host_storages: dict[int, tuple[weakref.ref, bool]] = {}


def mark_host(tensor: torch.Tensor, *, pinned: bool | None = None) -> torch.Tensor:
    """Mark ``tensor``'s memory as host memory, pageable or ``pinned``
    (page-locked), and return the tensor; ``pinned=None`` leaves marked memory
    as it is and marks unmarked memory pageable. Keep the tensor alive as long
    as its memory is used: the mark goes with it (a view of marked memory
    leaves the mark with the tensor that owns it)."""
    if not is_host(tensor) or (pinned is not None and pinned != is_pinned_host(tensor)):
        _host_storages[tensor.untyped_storage().data_ptr()] = (weakref.ref(tensor), bool(pinned))
    return tensor


def _mark(tensor: torch.Tensor) -> tuple[weakref.ref, bool] | None:
    entry = _host_storages.get(tensor.untyped_storage().data_ptr())
    if entry is None:
        return None
    owner = entry[0]()
    if owner is None or owner.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        return None
    return entry


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it views) was marked as host memory."""
    return _mark(tensor) is not None


def is_pinned_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it views) was marked as pinned host memory."""
    entry = _mark(tensor)
    return entry is not None and entry[1]

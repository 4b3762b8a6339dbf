"""Host tensors: memory the emulator treats as living on the host.

On a device, a CPU tensor is host memory: reading it on the host inside a
capture is allowed and freezes the value read. On the emulator every tensor is
a CPU tensor, so host memory is marked explicitly. Vendors allocate host
buffers with :func:`graphmode.buffers.host_zeros`, which marks them.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["is_host", "mark_host"]

_host_storages: dict[int, weakref.ref] = {}


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s memory as host memory and return the tensor. Keep the
    tensor alive as long as its memory is used: the mark goes with it (a view
    of marked memory leaves the mark with the tensor that owns it)."""
    if not is_host(tensor):
        _host_storages[tensor.untyped_storage().data_ptr()] = weakref.ref(tensor)
    return tensor


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it views) was marked as host memory."""
    ref = _host_storages.get(tensor.untyped_storage().data_ptr())
    if ref is None:
        return False
    owner = ref()
    return owner is not None and owner.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()

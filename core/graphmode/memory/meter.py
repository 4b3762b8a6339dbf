"""How much device memory is in use, as an engine sizing its KV cache sees it.

On a device whose torch module has ``mem_get_info`` (CUDA, and so MACA and
PPU; ``torch.npu`` and ``torch.mlu`` have one of the same signature, called
the same way but not run here) the meter reads the driver's free memory after
synchronising and returning the caching allocator's unused blocks
(``empty_cache``): what is in use is then what tensors, graph pools' reserved
segments, the driver's own graph objects and loaded kernels hold, which is
what an engine's ``total - free`` read before allocating its KV cache sees.

On the CPU emulator there is no device to ask, so the meter keeps an
allocation record instead: while it is entered, every storage an operator
returns that none of its arguments had (a new allocation: a factory
function, an operator's result, an emulated capture's intermediates) is
noted with a weak reference, and what is in use is the bytes of those still
alive. An emulated graph keeps every intermediate its capture allocated (its
records replay into them), so the emulator holds more than a device pool,
which reuses freed blocks; the meter counts what the emulator holds. Storages
allocated before the meter was entered are not seen. (A device module
without ``mem_get_info`` gets the allocation record too: it sees tensors,
not the driver's own memory.)
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.tensor_trees import tensors_in

__all__ = ["MemoryMeter", "device_module"]


def device_module(device: torch.device) -> Any:
    """The torch module that reports ``device``'s free memory, or None (the CPU)."""
    module: Any = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(module, "mem_get_info"):
        return None
    return module


class MemoryMeter:
    """``with MemoryMeter(device) as meter: ...; meter.used()``: the bytes in
    use on ``device`` (a device's driver count, or on the CPU the live bytes
    allocated since the meter was entered). Differences of :meth:`used` are
    what the work between the reads took."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.module = device_module(self.device)
        self._record: _Allocations | None = None
        #: How the figures were taken, in words.
        self.method = (
            f"torch.{self.device.type}.mem_get_info after synchronize and empty_cache"
            if self.module is not None else "the emulator's allocation record (live storages allocated while measured)"
        )

    def __enter__(self) -> MemoryMeter:
        if self.module is None:
            self._record = _Allocations()
            self._record.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._record is not None:
            self._record.__exit__(*exc)

    def used(self) -> int:
        """Bytes in use now. Unreachable objects are collected first: memory
        held only by a reference cycle (freed at Python's next collection, not
        at once) is not in use."""
        gc.collect()
        if self.module is not None:
            self.module.synchronize(self.device)
            self.module.empty_cache()
            free, total = self.module.mem_get_info(self.device)
            return int(total - free)
        assert self._record is not None, "MemoryMeter.used() outside its with block on the CPU"
        return self._record.live_bytes()


class _Allocations(TorchDispatchMode):
    """Every new storage an operator returns, by weak reference.

    Entered beneath any later mode (an emulated capture's recorder calls the
    operator through it), so it sees the operators the recorder runs."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        inputs = {key for key in map(_key, tensors_in((args, kwargs))) if key is not None}
        for tensor in tensors_in(outputs):
            key = _key(tensor)
            if key is None or key in inputs:
                continue
            known = self._storages.get(key)
            if known is None or known[0].expired():  # a new storage (an address may be reused once freed)
                storage = tensor.untyped_storage()
                self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return outputs

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self._storages.values() if not ref.expired())


def _key(tensor: torch.Tensor) -> int | None:
    """The storage's address, or None for memory the meter does not count
    (meta tensors, tensors without a storage of their own, empty storages)."""
    if tensor.device.type == "meta" or tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None

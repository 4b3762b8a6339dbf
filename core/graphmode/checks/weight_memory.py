"""The memory of the model's parameters and buffers that the graphs captured,
checked before every graph step.

A device graph reads the addresses it captured. A weight given new memory
under the same tensor object (``param.data = new``, ``param.set_(other)``, a
rotary buffer regrown with ``.data =`` in an eager forward) registers nothing
(PyTorch's registration hooks, which ``graphmode.checks.model_state`` uses to
see new tensor *objects*, do not fire) and leaves every later replay reading
the old memory: graph output silently differs from eager (0.476 off eager on
every vendor before 2026-12). :class:`WeightMemory` keeps, from the first
capture after a reset, the model's parameters and buffers and their data
pointers, and refuses a graph step where one moved, until ``runner.reset()``.

Host facts only, no synchronisation. In debug mode the runner leaves it to
debug mode's own address check (``graphmode.checks.debug``), which also
covers the extra inputs and names the graph. With the native step
(``graphmode.native``) the comparison is a C++ loop over held tensors
(``Addresses``), inside the native step and called from the Python path; without it,
a Python list of ``const_data_ptr()`` compared with the one kept
(``scripts/weight_pointer_cost.py`` measures both).

Not seen: a weight replaced by a view of the same memory in another shape
(the address holds), and the memory of tensors the model keeps outside its
parameters and buffers (plain attributes; debug mode does not see those
either).
"""

from __future__ import annotations

from typing import Any

import torch

from graphmode.errors import ReplayError
from graphmode.native import native_module

__all__ = ["WeightMemory"]

# const_data_ptr reads the address without materialising a copy-on-write tensor.
_data_ptr = getattr(torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr)


class WeightMemory:
    """The captured parameters and buffers of one runner's model, and their
    addresses at capture.

    ``hold(model)`` after every capture (only the first since a reset, or
    since construction, takes the snapshot: later captures read the same
    memory, or a step before them was refused); ``check()`` before every
    graph step (raises :class:`ReplayError` naming the first tensor whose
    memory moved, its address, the captured address and the fix);
    ``forget()`` at ``runner.reset()``. :attr:`addresses`: the
    ``Addresses`` of ``graphmode.native`` that the native step checks too,
    made at the first :meth:`hold` (the first capture builds the module, as
    the first replay would), or None where the module cannot be built."""

    def __init__(self) -> None:
        self.addresses: Any = None
        self._native_decided = False
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._pointers: list[int] = []
        self.held = False

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (in ``Addresses`` order), none before the first capture."""
        return list(self._tensors)

    def hold(self, model: Any) -> None:
        """Keep ``model``'s parameters and buffers and their addresses, unless held already."""
        if self.held:
            return
        named: list[tuple[str, torch.Tensor]] = []
        if hasattr(model, "named_parameters") and hasattr(model, "named_buffers"):
            named += [(f"parameter {name!r}", p) for name, p in model.named_parameters()]
            named += [(f"buffer {name!r}", b) for name, b in model.named_buffers()]
        names, tensors, pointers = [], [], []
        for name, tensor in named:
            try:
                pointer = _data_ptr(tensor)
            except (RuntimeError, TypeError):  # no storage (a wrapper subclass, sparse): no address to keep
                continue
            names.append(name)
            tensors.append(tensor)
            pointers.append(pointer)
        self._names, self._tensors, self._pointers = names, tensors, pointers
        if not self._native_decided:
            module = native_module()
            self.addresses = module.Addresses() if module is not None else None
            self._native_decided = True
        if self.addresses is not None:
            self.addresses.hold(tensors)
        self.held = True

    def forget(self) -> None:
        """Drop the snapshot (``runner.reset()``: the next capture takes another)."""
        self._names, self._tensors, self._pointers = [], [], []
        if self.addresses is not None:
            self.addresses.clear()
        self.held = False

    def check(self) -> None:
        """Refuse a graph step while a captured parameter or buffer is at
        another address than the graphs captured."""
        if self.addresses is not None:
            moved = self.addresses.moved()
            if moved < 0:
                return
        else:
            try:
                now = list(map(_data_ptr, self._tensors))
            except RuntimeError:  # a tensor that lost its storage
                now = [_address(t) for t in self._tensors]
            if now == self._pointers:
                return
            moved = next(i for i, (a, b) in enumerate(zip(now, self._pointers)) if a != b)
        tensor = self._tensors[moved]
        raise ReplayError(
            f"the model's {self._names[moved]} is at address {_address(tensor):#x}, but the graphs captured it at "
            f"{self._pointers[moved]:#x}: its memory was replaced under the same tensor object (param.data = new, "
            "tensor.set_(...), a weight reload into new tensors), which graphs cannot see, so every graph step "
            "would keep reading the old memory while eager steps read the new. Change weights in place "
            "(param.copy_(new), load_state_dict without assign=True), or call runner.reset() after giving them new "
            "memory; the next step of each bucket then captures again"
        )


def _address(tensor: torch.Tensor) -> int:
    """The tensor's data pointer, 0 where it has none any more (as ``Addresses`` reads it)."""
    try:
        return _data_ptr(tensor)
    except RuntimeError:
        return 0

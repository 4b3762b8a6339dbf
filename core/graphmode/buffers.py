"""Helpers for vendor buffer hooks: host buffers, and staging a step's rows.

Filling buffers is on the replay path, so it is batched: every live-row copy
and every padding reset of one step go to the device as one ``_foreach_copy_``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from graphmode.emulator.host import mark_host
from graphmode.meta import GraphMeta

__all__ = ["host_zeros", "padding_rows", "stage"]


def host_zeros(meta: GraphMeta, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host (CPU) buffer, for kernels that take host values.

    On the emulator the buffer is marked as host memory, so reading it inside
    a capture freezes the value read, exactly as on a device."""
    tensor = torch.zeros(tuple(shape), dtype=dtype, device="cpu")
    if meta.device.type == "cpu":
        mark_host(tensor)
    return tensor


def padding_rows(
    meta: GraphMeta, names: Iterable[str], start: int, stop: int, dim: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, padding) pairs resetting positions ``start:stop`` along
    ``dim`` of each named buffer to the values it was made with."""
    if start >= stop:
        return []
    return [
        (meta.input_buffers[name].narrow(dim, start, stop - start),
         meta.padding_buffers[name].narrow(dim, start, stop - start))
        for name in names
    ]


def stage(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every source into its destination: one ``_foreach_copy_`` per
    destination device (host buffers and device buffers go separately)."""
    by_device: dict[torch.device, tuple[list, list]] = {}
    for destination, source in pairs:
        destinations, sources = by_device.setdefault(destination.device, ([], []))
        destinations.append(destination)
        sources.append(source)
    for destinations, sources in by_device.values():
        torch._foreach_copy_(destinations, sources)

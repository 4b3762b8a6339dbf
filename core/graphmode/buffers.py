"""Helpers for vendor buffer hooks: host buffers, and staging a step's rows.

Filling buffers is on the replay path, so it is batched: every live-row copy
and every padding reset of one step go to the device as one ``_foreach_copy_``
per dtype, or, with host staging, into the pinned host mirror on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from graphmode.context import StepInputs
from graphmode.emulator.host import mark_host
from graphmode.meta import GraphMeta
from graphmode.staging import route

__all__ = ["ROW_BUFFERS", "TOKEN_BUFFERS", "decode_rows", "host_zeros", "padding_rows", "stage"]

# The buffers a decode step writes (the others are constant): per-token rows of
# shape (1, max_tokens), and per-sequence or per-token rows along dimension 0.
TOKEN_BUFFERS = ("input_ids", "position_ids")
ROW_BUFFERS = ("block_offsets", "kv_seqlens", "kv_start_indices")


def host_zeros(meta: GraphMeta, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
    """A zeroed host (CPU) buffer, for kernels that take host values;
    ``pinned``: page-locked, so that a graph can copy it to the device.

    On the emulator the buffer is marked as host memory, so reading it inside
    a capture freezes the value read, exactly as on a device."""
    on_device = meta.device.type != "cpu"
    tensor = torch.zeros(tuple(shape), dtype=dtype, device="cpu", pin_memory=pinned and on_device)
    if not on_device:
        mark_host(tensor, pinned=pinned)
    return tensor


def decode_rows(
    meta: GraphMeta, inputs: StepInputs, batch_size: int, kv_seqlens: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer rows, step rows) pairs copying a decode step into the buffers
    named in ``TOKEN_BUFFERS`` and ``ROW_BUFFERS``, and clearing the block-table
    columns a narrower table leaves. ``kv_seqlens`` overrides the source of the
    lengths (a host copy, for host-length buffers)."""
    attn = inputs.attn_metadata
    width = attn.block_offsets.shape[1]
    key = ("decode", batch_size, width)
    targets = meta.views.get(key)
    if targets is None:
        targets = meta.views[key] = _decode_targets(meta, batch_size, width)
    destinations, constant_pairs = targets
    sources = (
        inputs.input_ids,
        inputs.position_ids,
        attn.block_offsets,
        attn.kv_seqlens if kv_seqlens is None else kv_seqlens,
        attn.kv_start_indices,
    )
    return [*zip(destinations, sources), *constant_pairs]


def _decode_targets(meta: GraphMeta, n: int, width: int) -> tuple[list, list]:
    buffers = meta.input_buffers
    blocks = buffers["block_offsets"]
    destinations = [
        _like_contiguous(buffers["input_ids"][:, :n]),
        _like_contiguous(buffers["position_ids"][:, :n]),
        blocks[:n, :width],
        buffers["kv_seqlens"][:n],
        buffers["kv_start_indices"][:n].view(n),  # one slot per token, whatever the buffer's shape
    ]
    clear_tail = [(blocks[:n, width:], meta.padding_buffers["block_offsets"][:n, width:])] if width < meta.num_blocks else []
    return destinations, clear_tail


def _like_contiguous(view: torch.Tensor) -> torch.Tensor:
    """The same memory with a contiguous tensor's strides. A (1, n) slice of
    a (1, max_tokens) buffer has stride max_tokens in its size-1 dimension, a
    step's (1, n) tensor has n: harmless for a copy, but ``_foreach_copy_``
    only takes its fused path when destination and source strides match."""
    return view.as_strided(view.shape, torch.empty(view.shape, device="meta").stride(), view.storage_offset())


def padding_rows(
    meta: GraphMeta, names: Iterable[str], start: int, stop: int, dim: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, padding) pairs resetting positions ``start:stop`` along
    ``dim`` of each named buffer to the values it was made with."""
    if start >= stop:
        return []
    names = tuple(names)
    key = ("padding", names, start, stop, dim)
    pairs = meta.views.get(key)
    if pairs is None:
        pairs = meta.views[key] = [
            (meta.input_buffers[name].narrow(dim, start, stop - start),
             meta.padding_buffers[name].narrow(dim, start, stop - start))
            for name in names
        ]
    return pairs


def stage(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every source into its destination: one ``_foreach_copy_`` per
    destination device and dtype, so that each group takes the fused path (one
    kernel on a GPU) rather than one copy per buffer.

    In a runner with host staging (``graphmode.staging``), a destination in
    the device arena is written through its pinned host mirror instead, on the
    host: its source must then be a host tensor (or a view of the padding
    snapshot, whose host copy is used); a device source raises InputError."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for destination, source in route(pairs):
        destinations, sources = groups.setdefault((destination.device, destination.dtype), ([], []))
        destinations.append(destination)
        sources.append(source)
    for destinations, sources in groups.values():
        torch._foreach_copy_(destinations, sources)

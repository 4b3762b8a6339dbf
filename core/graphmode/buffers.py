"""Helpers for vendor buffer hooks: host buffers, and staging a step's rows.

Filling buffers is on the replay path, so it is batched: every live-row copy
and every padding reset of one step go to the device as one ``_foreach_copy_``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from graphmode.context import StepInputs
from graphmode.emulator.host import mark_host
from graphmode.meta import GraphMeta

__all__ = ["ROW_BUFFERS", "TOKEN_BUFFERS", "decode_rows", "host_zeros", "padding_rows", "stage"]

# The buffers a decode step writes (the others are constant): per-token rows of
# shape (1, max_tokens), and per-sequence or per-token rows along dimension 0.
TOKEN_BUFFERS = ("input_ids", "position_ids")
ROW_BUFFERS = ("block_offsets", "kv_seqlens", "kv_start_indices")


def host_zeros(meta: GraphMeta, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host (CPU) buffer, for kernels that take host values.

    On the emulator the buffer is marked as host memory, so reading it inside
    a capture freezes the value read, exactly as on a device."""
    tensor = torch.zeros(tuple(shape), dtype=dtype, device="cpu")
    if meta.device.type == "cpu":
        mark_host(tensor)
    return tensor


def decode_rows(
    meta: GraphMeta, inputs: StepInputs, batch_size: int, kv_seqlens: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer rows, step rows) pairs copying a decode step into the buffers
    named in ``TOKEN_BUFFERS`` and ``ROW_BUFFERS``, and clearing the block-table
    columns a narrower table leaves. ``kv_seqlens`` overrides the source of the
    lengths (a host copy, for host-length buffers)."""
    n, buffers, attn = batch_size, meta.input_buffers, inputs.attn_metadata
    blocks, slots = buffers["block_offsets"], buffers["kv_start_indices"]
    width = attn.block_offsets.shape[1]
    pairs = [
        (buffers["input_ids"][:, :n], inputs.input_ids),
        (buffers["position_ids"][:, :n], inputs.position_ids),
        (blocks[:n, :width], attn.block_offsets),
        (buffers["kv_seqlens"][:n], attn.kv_seqlens if kv_seqlens is None else kv_seqlens),
        (slots[:n], attn.kv_start_indices.view(slots[:n].shape)),
    ]
    if width < meta.num_blocks:
        pairs.append((blocks[:n, width:], meta.padding_buffers["block_offsets"][:n, width:]))
    return pairs


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

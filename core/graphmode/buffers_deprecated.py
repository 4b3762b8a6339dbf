"""The buffer helpers of the plugin API before the GraphSpec declarations
(before commit 74dafc9, 2026-11-22), kept for one release.

``graphmode.buffers`` hands them out with a DeprecationWarning naming the
replacement (:data:`DEPRECATED`); they behave exactly as
they did, so that a plugin written against them keeps working meanwhile.
The old ``stage(pairs)`` call form is served by :func:`stage_pairs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from graphmode.context import StepInputs
from graphmode.meta import GraphMeta
from graphmode.staging import route_any

__all__ = ["DEPRECATED", "ROW_BUFFERS", "TOKEN_BUFFERS", "decode_rows", "padding_rows", "stage_pairs"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]

_PADDING_PAIRS = (
    "pairs of meta.input_buffers[name].narrow(dim, start, stop - start) and "
    "meta.padding_buffers[name].narrow(dim, start, stop - start)"
)
_DECLARED = "a BufferSpec in the vendor's GraphSpec, which graphmode.buffers.fill fills and pads"
# Each deprecated name of graphmode.buffers and what replaces it (the warning's text).
DEPRECATED = {
    "padding_rows": f"{_PADDING_PAIRS}, passed to graphmode.buffers.stage(meta, pairs); or {_DECLARED}",
    "decode_rows": f"graphmode.buffers.fill(meta, inputs, batch_size, bucket) over {_DECLARED}",
    "TOKEN_BUFFERS": "the names of meta.spec.buffers whose BufferSpec has per_token=True",
    "ROW_BUFFERS": "the names of meta.spec.buffers whose BufferSpec has written=True",
}

# The buffers a decode step writes (the others are constant): per-token rows of
# shape (1, max_tokens), and per-sequence or per-token rows along dimension 0.
TOKEN_BUFFERS = ("input_ids", "position_ids")
ROW_BUFFERS = ("block_offsets", "kv_seqlens", "kv_start_indices")


def decode_rows(
    meta: GraphMeta, inputs: StepInputs, batch_size: int, kv_seqlens: torch.Tensor | None = None
) -> Pairs:
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
    padding = meta.padding_buffers["block_offsets"]
    clear_tail = [(blocks[:n, width:], padding[:n, width:])] if width < meta.num_blocks else []
    return destinations, clear_tail


def _like_contiguous(view: torch.Tensor) -> torch.Tensor:
    """The same memory with a contiguous tensor's strides (``_foreach_copy_``
    takes its fused path only when destination and source strides match)."""
    return view.as_strided(view.shape, torch.empty(view.shape, device="meta").stride(), view.storage_offset())


def padding_rows(meta: GraphMeta, names: Iterable[str], start: int, stop: int, dim: int = 0) -> Pairs:
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


def stage_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The old ``stage(pairs)``: copy every source into its destination, one
    ``_foreach_copy_`` per destination device and dtype; a destination in the
    arena of any live runner with host staging is written through its pinned
    host mirror (the runner is found from the destination, as before)."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for destination, source in route_any(pairs):
        destinations, sources = groups.setdefault((destination.device, destination.dtype), ([], []))
        destinations.append(destination)
        sources.append(source)
    for destinations, sources in groups.values():
        torch._foreach_copy_(destinations, sources)

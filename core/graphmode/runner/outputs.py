"""One output buffer shared by every bucket's graph.

A graph's result tensor lives in the graph memory pool for as long as the
graph does, so with one result per bucket the pool holds the sum of all
buckets' results (for logits, bucket x vocabulary each: most of the pool).
Only one step's result is live at a time (a result is valid until the next
step), so every graph instead ends by copying its result into the first
``bucket`` token columns of one buffer per output tensor, sized for the
largest bucket and allocated outside the pool. The graph's own result is then
an intermediate like any other, whose memory later captures reuse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["SharedOutputs"]


class SharedOutputs:
    """The shared buffers, made from the first warm-up result.

    An output tensor is shared when its second dimension is the step's token
    count (the model contract); any other output (a scalar, a tensor of
    another layout) stays the graph's own."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.buffers: list[torch.Tensor | None] | None = None

    def prepare(self, example: Any, tokens: int) -> None:
        """Allocate the buffers from a result computed outside any graph."""
        if self.buffers is not None:
            return
        self.buffers = [
            torch.empty((leaf.shape[0], self.max_tokens, *leaf.shape[2:]), dtype=leaf.dtype, device=leaf.device)
            if _per_token(leaf, tokens) else None
            for leaf in tree_flatten(example)[0]
        ]

    def publish(self, output: Any, tokens: int) -> Any:
        """Inside the capture: copy ``output`` into the shared buffers and
        return the same structure made of their views."""
        leaves, spec = tree_flatten(output)
        buffers = self.buffers or []
        if len(leaves) != len(buffers):  # another structure than the first result: keep it
            return output
        published = []
        for leaf, buffer in zip(leaves, buffers):
            if buffer is not None and _per_token(leaf, tokens) and leaf.shape[2:] == buffer.shape[2:] \
                    and leaf.shape[0] == buffer.shape[0] and leaf.dtype == buffer.dtype:
                view = buffer.narrow(1, 0, tokens)
                view.copy_(leaf)
                published.append(view)
            else:
                published.append(leaf)
        return tree_unflatten(published, spec)


def _per_token(leaf: Any, tokens: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] == tokens

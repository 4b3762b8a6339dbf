"""The hand-written floor of a replay step's host path: one graph for
exactly one batch size whose static inputs are views of one device buffer
with a pinned host mirror; a call writes the step into the mirror (one host
``_foreach_copy_``), launches one packed host-to-device copy and replays.
``scripts/host_path.py`` and the decode bench's host cost time graphmode's
runner call against it."""

from __future__ import annotations

from typing import Any

import torch

from graphmode.buffers import host_zeros
from graphmode.context import AttnMetadata, StepInputs
from graphmode.graphs import make_device_graph
from graphmode.meta import GraphMeta
from graphmode.staging import to_host

__all__ = ["HandPacked"]


class HandPacked:
    """One graph for exactly ``batch`` sequences whose static inputs are views
    of one device buffer with a pinned host mirror. ``in_graph``: the
    mirror-to-device copy is the graph's first node; else it is launched
    before each replay."""

    def __init__(self, model: Any, step: StepInputs, kv_cache: Any, in_graph: bool) -> None:
        attn, device = step.attn_metadata, step.input_ids.device
        sources = [step.input_ids, step.position_ids, attn.block_offsets, attn.q_start_loc, attn.q_seqlens,
                   attn.kv_seqlens, attn.kv_start_indices]
        offsets, size = [], 0
        for tensor in sources:
            offsets.append(size)
            size += -(-tensor.numel() * tensor.element_size() // 256) * 256
        meta = GraphMeta(max_batchs=1, max_tokens=1, num_blocks=1, block_size=1, device=device)
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.pinned = host_zeros(meta, (size,), torch.uint8, pinned=True)

        def views(memory: torch.Tensor) -> list[torch.Tensor]:
            return [memory[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                    for o, t in zip(offsets, sources)]

        self.static, self.mirror = views(self.device_bytes), views(self.pinned)
        self.in_graph = in_graph
        ids, pos, blocks, q_start, q_lens, kv_lens, slots = self.static
        context = AttnMetadata(True, blocks, q_start, q_lens, kv_lens, slots, 1, -1)
        self.write(to_host(step, device))
        self.device_bytes.copy_(self.pinned)
        model(ids, pos, kv_cache, context)  # warm-up outside the graph
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.graph = make_device_graph(device)
        with self.graph.capture():
            if in_graph:
                self.device_bytes.copy_(self.pinned, non_blocking=True)
            self.output = model(ids, pos, kv_cache, context)

    def write(self, host_step: StepInputs) -> None:
        attn = host_step.attn_metadata
        torch._foreach_copy_(self.mirror, [host_step.input_ids, host_step.position_ids, attn.block_offsets,
                                           attn.q_start_loc, attn.q_seqlens, attn.kv_seqlens, attn.kv_start_indices])

    def __call__(self, host_step: StepInputs) -> torch.Tensor:
        self.write(host_step)
        if not self.in_graph:
            self.device_bytes.copy_(self.pinned, non_blocking=True)
        self.graph.replay()
        return self.output

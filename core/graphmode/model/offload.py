"""The reference model with its layers' weights offloaded to host memory.

nano-vllm's offloaded decode (seed 004): the decoder layers' weights live in
(pinned) host memory, and the layers run from a ring of ``num_buffers``
device layers: before layer ``i`` runs, its weights are copied into ring slot
``i % num_buffers``. The copy is host work that must happen at every step,
so it is placed in :func:`graphmode.families.piecewise.host_break`: under a piecewise
runner each layer replays as graphs with the loads between them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from graphmode.attention import KVCache
from graphmode.context import AttnMetadata
from graphmode.emulator.host import mark_host
from graphmode.errors import ConfigError
from graphmode.families.piecewise import host_break
from graphmode.model.llama import LlamaModel, embed

__all__ = ["OffloadedLlama"]


class OffloadedLlama(nn.Module):
    """``model`` with its decoder layers' weights moved to host memory and a
    ring of ``num_buffers`` device layers to run them from. Embedding, final
    norm, head and rotary tables stay on the device. Same forward contract
    and results as ``model``.

    ``host_weights[i]`` are layer ``i``'s weights on the host (pinned when the
    device is not the CPU; marked as pinned host memory on the emulator); an
    engine may update them in place between steps."""

    def __init__(self, model: LlamaModel, num_buffers: int = 2) -> None:
        super().__init__()
        layers = len(model.layers)
        if not 1 <= num_buffers <= layers:
            raise ConfigError(f"num_buffers={num_buffers}: the ring needs 1..{layers} slots (one per layer at most)")
        self.config, self.ops = model.config, model.ops
        self.embed_tokens, self.norm, self.lm_head = model.embed_tokens, model.norm, model.lm_head
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin
        device = model.embed_tokens.weight.device
        self.ring = nn.ModuleList(copy.deepcopy(model.layers[slot]) for slot in range(num_buffers))
        self.host_weights = [[_to_host(p.detach(), device) for p in layer.parameters()] for layer in model.layers]
        self.loads = 0  # host-to-device layer loads so far

    def load(self, layer: int, slot: int) -> None:
        """Copy layer ``layer``'s host weights into ring slot ``slot``."""
        with torch.no_grad():
            for target, source in zip(self.ring[slot].parameters(), self.host_weights[layer]):
                target.copy_(source, non_blocking=True)
        self.loads += 1

    def make_kv_cache(
        self, num_cache_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> KVCache:
        config = self.config
        return self.ops.make_kv_cache(
            config.num_hidden_layers, num_cache_blocks, block_size, config.num_key_value_heads, config.head_dim,
            config.dtype, torch.device(device) if device is not None else self.embed_tokens.weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache,
        attn_metadata: AttnMetadata,
        **extras: Any,
    ) -> torch.Tensor:
        hidden, cos, sin = embed(self, input_ids, position_ids)
        for index, kv_cache in enumerate(past_key_values):
            slot = index % len(self.ring)
            host_break(self.load, index, slot)  # host work at every step, between the layer graphs
            hidden = self.ring[slot](hidden, cos, sin, kv_cache, attn_metadata)
        return self.lm_head(self.norm(hidden))[None]


def _to_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return mark_host(tensor.clone(), pinned=True)
    return tensor.cpu().pin_memory()

"""Cambricon's attention contract, in pure PyTorch.

The paged KV cache is [num_blocks, kv_heads, block_size, head_dim] with
blocks of 16 tokens. The decode kernel (torch_mlu_ops) honours
``max_kv_seq_len``: a positive value limits how many cached tokens it reads;
zero or less means "derive the maximum from kv_seqlens". A graph freezes that
integer at capture, so graph contexts must pass -1.
"""

from __future__ import annotations

import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.context import AttnMetadata

__all__ = ["CambAttentionOps"]


class CambAttentionOps(ReferenceAttentionOps):
    layout = "[num_blocks, kv_heads, block_size, head_dim]"
    contract = "camb"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def block_view(self, cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        return cache.transpose(1, 2)

    def _decode_limit(self, attn: AttnMetadata) -> torch.Tensor:
        limit = attn.kv_seqlens[:, None]
        if attn.max_kv_seq_len > 0:
            return limit.clamp(max=attn.max_kv_seq_len)
        return limit

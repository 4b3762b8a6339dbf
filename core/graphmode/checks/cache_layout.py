"""Where a KV-cache tensor keeps its blocks (the model's attention ops say),
and the check, once at capture, that the cache's blocks hold ``block_size``
tokens. Read from shapes only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphmode.errors import InputError

__all__ = ["CacheGeometry", "cache_geometry", "check_cache_layout"]


@dataclass(frozen=True)
class CacheGeometry:
    """Where one KV-cache tensor keeps its blocks, read from the attention
    ops' ``cache_shape``: ``ndim`` dimensions, the block count in dimension
    ``blocks_dim``, the tokens per block in ``block_size_dim``."""

    layout: str
    ndim: int
    blocks_dim: int
    block_size_dim: int


def cache_geometry(model: Any) -> CacheGeometry | None:
    """The cache geometry of the model's attention ops (``model.ops``), or
    None when the model does not expose ops with a ``cache_shape``. The ops
    are asked for the shape of a cache with distinct prime sizes, so that
    each size's position is unambiguous whatever the layout."""
    ops = getattr(model, "ops", None)
    shape_of = getattr(ops, "cache_shape", None)
    if shape_of is None:
        return None
    shape = tuple(shape_of(11, 13, 17, 19))  # num_blocks, block_size, kv_heads, head_dim
    if shape.count(11) != 1 or shape.count(13) != 1:
        return None
    return CacheGeometry(getattr(ops, "layout", str(shape)), len(shape), shape.index(11), shape.index(13))


def check_cache_layout(model: Any, tensors: list[Any], block_size: int) -> None:
    """Refuse, once at capture, KV-cache tensors whose blocks hold another
    number of tokens than the runner's ``block_size`` (or whose rank is not
    the layout's): every slot and length the graph computes would address the
    wrong tokens. Read from the shapes only, in the layout of the model's
    attention ops; skipped for models that do not expose them."""
    geometry = cache_geometry(model)
    if geometry is None:
        return
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.dim() != geometry.ndim:
            raise InputError(
                f"KV-cache tensor {index} has shape {tuple(tensor.shape)}, but the model's attention ops keep "
                f"{geometry.ndim}-dimensional caches in the layout {geometry.layout}; make the cache with "
                "the model's make_kv_cache"
            )
        found = tensor.shape[geometry.block_size_dim]
        if found != block_size:
            raise InputError(
                f"KV-cache tensor {index} has shape {tuple(tensor.shape)}: blocks of {found} tokens "
                f"(dimension {geometry.block_size_dim} of the layout {geometry.layout}), but the runner "
                f"was built with block_size={block_size}; build the runner with block_size={found}, or "
                f"make the cache with block_size={block_size}"
            )

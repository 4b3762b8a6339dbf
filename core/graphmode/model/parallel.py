"""Tensor parallelism for the reference model.

Each rank keeps a slice of every layer: the QKV and gate/up projections are
split by output (column parallel: a rank owns whole heads and a slice of the
MLP), the output and down projections by input (row parallel), followed by an
all-reduce. The LM head is replicated. The all-reduce is the functional
collective, which a device graph captures (NCCL kernels in a CUDA graph) and
the emulator records and replays (gloo on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphmode.model.llama import Attention, DecoderLayer, LlamaModel

__all__ = ["AllReduce", "shard_model"]


class AllReduce:
    """Sum a tensor over the ranks of a process group, through graph-
    capturable functional collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group_name = group.group_name

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        reduced = torch.ops._c10d_functional.all_reduce(tensor, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(reduced)


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """This rank's share of each consecutive block of rows."""
    parts, start = [], 0
    for size in sizes:
        share = size // world
        parts.append(weight[start + rank * share: start + (rank + 1) * share])
        start += size
    return torch.cat(parts)


def shard_model(model: LlamaModel, group: dist.ProcessGroup) -> LlamaModel:
    """Turn a full reference model into this rank's tensor-parallel shard, in
    place. Every rank must start from the same weights (same seed)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config = model.config
    for name, count in (("num_attention_heads", config.num_attention_heads),
                        ("num_key_value_heads", config.num_key_value_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % world:
            raise ValueError(f"{name}={count} does not split over {world} tensor-parallel ranks")
    reduce = AllReduce(group)
    head_dim = config.head_dim
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)
            attn = layer.self_attn
            q, kv = attn.heads * head_dim, attn.kv_heads * head_dim
            attn.qkv_proj.weight = torch.nn.Parameter(_rows(attn.qkv_proj.weight, [q, kv, kv], rank, world))
            attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.chunk(world, dim=1)[rank].contiguous())
            attn.heads //= world
            attn.kv_heads //= world
            attn.reduce = reduce
            size = config.intermediate_size
            layer.gate_up_proj.weight = torch.nn.Parameter(_rows(layer.gate_up_proj.weight, [size, size], rank, world))
            layer.down_proj.weight = torch.nn.Parameter(layer.down_proj.weight.chunk(world, dim=1)[rank].contiguous())
            layer.reduce = reduce
    model.tp_size = world
    return model

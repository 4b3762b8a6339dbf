"""A Triton paged-decode attention kernel: :class:`TritonAttentionOps`.

Flash-decoding: each program takes one sequence, one KV head (with all the
query heads that share it: grouped-query attention) and one partition of the
block table's token range, and runs an online softmax in float32 over its
tokens, read through the block table. When there are too few sequences to
fill the GPU, the KV length is split into partitions and a second kernel
merges their partial softmaxes, so that batch 1 with a long context still
uses every multiprocessor.

Graph capture: the grid and the number of partitions depend only on tensor
shapes (batch, heads, block-table width) and the device, never on the
lengths; each sequence's length is read on the device from ``kv_seqlens``,
so nothing synchronises with the host and a captured graph stays right for
any lengths the table can hold. Lengths above the table's capacity read the
whole table (as the reference does); lengths <= 0 give zeros.

This module imports without Triton: Triton is imported when a kernel first
runs. On a device other than CUDA the ops fall back to the reference kernels,
unless Triton's interpreter is on (``TRITON_INTERPRET=1``), which runs the
kernels on CPU tensors (for tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.kernels.triton_prefill import opaque_paged_prefill, paged_prefill

__all__ = ["TritonAttentionOps", "paged_decode", "triton_available", "write_kv"]

BLOCK_N = 64  # tokens per inner iteration (and the partition granule)
PROGRAMS_PER_SM = 4  # split the KV length until batch x KV heads x partitions reaches this many per multiprocessor
# The most partitions the merge kernel reads at a time. It reads the count
# rounded up to a power of two, up to this, and loops past it: a fixed 32
# made the merge 2.4x slower at 2 partitions (batch 256 on an H100).
MERGE_CHUNK = 32


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels() -> Any:
    from graphmode.kernels import _triton_kernels

    return _triton_kernels


def _next_power_of_two(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few partitions, so that the combine kernel is exercised


def num_partitions(batch: int, kv_heads: int, capacity: int, device: torch.device) -> int:
    """How many partitions the KV range of ``capacity`` tokens is split
    into: enough for batch x KV heads x partitions programs to reach
    PROGRAMS_PER_SM per multiprocessor, at most one per BLOCK_N tokens."""
    wanted = -(-PROGRAMS_PER_SM * _multiprocessors(device) // (batch * kv_heads))
    return max(1, min(wanted, -(-capacity // BLOCK_N)))


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_offsets: torch.Tensor, kv_seqlens: torch.Tensor) -> None:
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            f"(num_blocks, block_size, kv_heads, head_dim={dim}) for queries {tuple(query.shape)}"
        )
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if block_offsets.shape[0] != batch or kv_seqlens.shape != (batch,):
        raise ValueError(
            f"block_offsets {tuple(block_offsets.shape)} and kv_seqlens {tuple(kv_seqlens.shape)} "
            f"must have one row per sequence ({batch})"
        )
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != query.dtype:
        raise ValueError(
            f"queries {query.dtype} and cache {k_cache.dtype}: the kernel takes one of float16, "
            "bfloat16, float32 for both"
        )
    for name, tensor in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {tensor.stride(-1)}); pass .contiguous()")


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_offsets: torch.Tensor, kv_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, D) queries over each sequence's first ``kv_seqlens`` cached
    tokens, read through ``block_offsets`` (B, W) from caches of shape
    (num_blocks, block_size, K, D) -> (B, H, D) in the queries' dtype."""
    _check(query, k_cache, v_cache, block_offsets, kv_seqlens)
    kernels = _kernels()
    batch, heads, dim = query.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    table = block_offsets if block_offsets.stride(-1) == 1 else block_offsets.contiguous()
    lengths = kv_seqlens if kv_seqlens.stride(0) == 1 else kv_seqlens.contiguous()
    capacity = table.shape[1] * page
    splits = num_partitions(batch, kv_heads, capacity, query.device)
    tokens_per_split = -(-capacity // (splits * BLOCK_N)) * BLOCK_N
    splits = -(-capacity // tokens_per_split)  # no partition lies wholly past the table
    block_d = max(16, _next_power_of_two(dim))
    out = torch.empty_like(query)
    if splits > 1:
        part_acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # not read: the kernel writes ``out`` directly
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    kernels.decode_partition_kernel[(batch, kv_heads, splits)](
        query, k_cache, v_cache, table, lengths, out, part_acc, part_ml,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1),
        capacity, tokens_per_split, splits,
        GROUP=group, GROUP_PAD=max(16, _next_power_of_two(group)), HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, PAGE=page, PARTIAL=splits > 1, PRECISION=precision,
        num_warps=4,
    )
    if splits > 1:
        kernels.combine_kernel[(batch, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), heads, splits,
            HEAD_DIM=dim, BLOCK_D=block_d, CHUNK=min(MERGE_CHUNK, _next_power_of_two(splits)),
            num_warps=4,
        )
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``cache[slot // block_size, slot % block_size] = key/value`` for each
    token whose slot is >= 0, in one kernel; slots < 0 write nothing."""
    tokens, kv_heads, dim = key.shape
    slots = slots if slots.stride(0) == 1 else slots.contiguous()
    if value.shape != key.shape or slots.shape != (tokens,) or k_cache.shape[2:] != (kv_heads, dim):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)}, slots {tuple(slots.shape)} and cache "
            f"{tuple(k_cache.shape)} do not match: key and value (T, K, D), slots (T,), cache (N, bs, K, D)"
        )
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if tokens == 0:
        return
    _kernels().write_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=dim, BLOCK_H=_next_power_of_two(kv_heads),
        BLOCK_D=_next_power_of_two(dim), PAGE=k_cache.shape[1], num_warps=1,
    )


# An opaque operator for torch.compile: Dynamo records one call, Inductor
# leaves it alone, and a graph captured around the compiled code replays the
# Triton launches.
@torch.library.custom_op("graphmode::triton_paged_decode", mutates_args=())
def _paged_decode_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_offsets: torch.Tensor, kv_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_decode(query, k_cache, v_cache, block_offsets, kv_seqlens, scale)


@_paged_decode_op.register_fake
def _(query, k_cache, v_cache, block_offsets, kv_seqlens, scale):
    return torch.empty_like(query)


# The KV write as one opaque operator too: Inductor's own code for the
# reference write took two kernels and 2.5 us per layer more than this one
# kernel (a batch-1 step on an H100, docs/performance.md). It mutates the
# caches in place (Inductor reinplaces it: no copy of a cache).
@torch.library.custom_op("graphmode::triton_write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    write_kv(key, value, k_cache, v_cache, slots)


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slots):
    return None


class TritonAttentionOps(ReferenceAttentionOps):
    """The reference ops with Triton's paged decode attention, prefill
    attention (:mod:`graphmode.kernels.triton_prefill`, opaque to
    torch.compile) and KV write, on CUDA tensors (or any tensors under
    ``TRITON_INTERPRET=1``); elsewhere, and for decode steps of several
    tokens per sequence, the reference kernels. Same cache layout and
    contract.

    Under ``torch.compile`` the KV write and decode attention are opaque
    operators (``graphmode::triton_write_kv``, ``graphmode::triton_paged_decode``)
    that Inductor leaves alone."""

    def _runs_triton(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" or interpreting()

    kv_write_in_graph = True  # as the reference write: slots only, -1 writes nothing

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        if not self._runs_triton(key):
            return super().fill_kv_cache(key, value, k_cache, v_cache, attn)
        head_dim = key.shape[-1]
        write = _write_kv_op if torch.compiler.is_compiling() else write_kv
        write(key, value, self.block_view(k_cache, head_dim), self.block_view(v_cache, head_dim), self._slots(attn))

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        # The Triton kernel takes one query per sequence; a decode step of
        # several tokens per sequence (speculative verify, MTP) runs the
        # reference kernel, chosen by shapes, so the choice is graph-safe.
        if not self._runs_triton(query) or query.shape[0] != attn.block_offsets.shape[0]:
            return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)
        head_dim = query.shape[-1]
        # The opaque operator only under torch.compile: eagerly (a piecewise
        # break point) it is dispatcher work around the same launch.
        decode = _paged_decode_op if torch.compiler.is_compiling() else paged_decode
        return decode(query, self.block_view(k_cache, head_dim), self.block_view(v_cache, head_dim),
                      attn.block_offsets, self._decode_limit(attn).reshape(-1), float(scale))

    def prefill_attention(self, query, k_cache, v_cache, attn, scale, out=None):
        if not self._runs_triton(query):
            result = super().prefill_attention(query, k_cache, v_cache, attn, scale)
            return result if out is None else out.copy_(result)
        head_dim = query.shape[-1]
        # torch.compiler.disable's wrapper only under torch.compile: eagerly (a
        # piecewise break point, every layer) it is Dynamo's bookkeeping per call.
        prefill = opaque_paged_prefill() if torch.compiler.is_compiling() else paged_prefill
        return prefill(
            query, self.block_view(k_cache, head_dim), self.block_view(v_cache, head_dim), attn.block_offsets,
            attn.q_start_loc, attn.q_seqlens, attn.kv_seqlens, attn.max_q_seq_len, float(scale), out)

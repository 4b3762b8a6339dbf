"""A Triton prefill attention kernel over the paged cache: the CUDA
plugin's prefill and mixed-step attention (:func:`paged_prefill`).

One kernel call per layer for any mix of sequences: whole prompts, chunks
after cached tokens (chunked prefill) and one-token decodes of a mixed step,
as an engine's varlen flash attention does. Each program takes one
sequence, a block of its new tokens and one KV head with the query heads
that share it, and runs an online softmax in float32 over the cached tokens
up to its last token's position, read through the block table.

Nothing is read on the host: each sequence's start, new tokens and cached
tokens are read on the device, and the grid comes from shapes and the host
bound ``max_q_seq_len`` (the step's token count when the bound is not
given). So the call makes no synchronisation, and the engine's host lengths
are needed nowhere in a layer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["opaque_paged_prefill", "paged_prefill"]

# The launch configuration, chosen on an H100 (torch 2.11) at the bench
# model's 16x2048 prefill (bf16, 14 query and 2 KV heads, head_dim 64,
# 64-token pages), one call (scripts/sweep_triton_prefill.py, 2026-11-26):
# 0.396 ms with 128 rows, 8 warps, 2 stages and one query head per program
# (304 TFLOP/s; 0.402 with 4 warps); 0.420 ms with a program per KV head and
# its 7 query heads padded to 8 (0.445 ms on 2026-11-25, before the scale
# joined the max subtraction); 0.518 ms with 128 cached tokens per
# iteration. PyTorch's fused attention on the same prompts as a dense batch,
# no paging: FLASH_ATTENTION 0.453 ms, CUDNN_ATTENTION 0.303 ms.
BLOCK_N = 64  # cached tokens per inner iteration
ROWS = 128  # query rows (tokens x query heads) per program
NUM_WARPS = 8
NUM_STAGES: int | None = 2  # software pipelining depth; None: Triton's default
# Query heads of one KV head per program (a power of two) when a sequence
# may hold ROWS new tokens or more, or None: the whole group, padded to a
# power of two. One head per program computes no padding (a group of 7
# padded to 8 does an eighth more) and reads each cached block once per
# head, from L2 after the first. Steps of shorter queries (decodes and
# short chunks of a mixed step) always take the whole group: their rows are
# few, so a block read once for the group is what they cost.
HEADS_PER_PROGRAM: int | None = 1
# Tensor descriptors (Hopper's tensor memory accelerator) for one query head
# per program, where the shapes allow (_descriptors_fit): queries and whole
# pages fetched by the copy engine, no address computed per element. The
# bench model's 16x2048 layer on an H100 (2026-11-26, a sweep of 36
# configurations): 0.324 ms (371 TFLOP/s) with 64 rows, 4 warps, 2 stages,
# against 0.397 ms for the pointer kernel above; 128 rows took 0.357 ms at
# best. A whole page is one key block, so the page size sets the tile:
# DESC_TILES holds the (page, head dim) pairs where descriptors measured
# faster (16x2048 and 4x2048, same H100, descriptors / pointers): page 64
# and 128 at head dim 64 (0.81-0.84, 0.91-0.99), page 32 and 64 at head
# dim 128 (0.81-0.82, 0.77). Elsewhere they lost: pages of 16 (1.05-1.39,
# too small a tile), page 32 at dim 64 (1.05-1.07), page 128 at dim 128
# (1.09-1.12), every page at dim 256 (0.98-1.75; page 128 exceeds shared
# memory). Making three descriptors costs the host about 30 us a call
# (Triton validates and encodes each at launch), 0.7 ms a step of the
# bench model's 24 layers: so only steps of DESC_MIN_TOKENS or more take
# them, whose device work (about 15 ms at 8192 tokens) keeps the device,
# not the host, the bound.
TENSOR_DESCRIPTORS = True
DESC_TILES = frozenset({(64, 64), (128, 64), (32, 128), (64, 128)})  # (page, head dim)
DESC_ROWS, DESC_WARPS, DESC_STAGES = 64, 4, 2
DESC_MIN_TOKENS = 4096


def _next_power_of_two(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_offsets: torch.Tensor,
                  q_start_loc: torch.Tensor, q_seqlens: torch.Tensor, kv_seqlens: torch.Tensor,
                  max_q_seq_len: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H, D) queries of sequences back to back -> (T, H, D): sequence
    ``s`` owns rows ``q_start_loc[s]`` to ``+ q_seqlens[s]``; its token ``i``
    sees its first ``kv_seqlens[s] - q_seqlens[s] + i + 1`` cached tokens
    (earlier context and this step's, already written), read through
    ``block_offsets`` (B, W) from caches of shape (num_blocks, block_size,
    K, D). Rows after the last sequence's are zeros. Written into ``out``
    when given (and returned).

    ``max_q_seq_len`` bounds every ``q_seqlens`` (as the step context
    promises); <= 0 means not known, and the token count bounds it."""
    tokens, heads, dim = query.shape
    batch = block_offsets.shape[0]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            f"(num_blocks, block_size, kv_heads, head_dim={dim}) with kv_heads dividing the {heads} query heads"
        )
    if q_start_loc.shape != (batch,) or q_seqlens.shape != (batch,) or kv_seqlens.shape != (batch,):
        raise ValueError(
            f"q_start_loc {tuple(q_start_loc.shape)}, q_seqlens {tuple(q_seqlens.shape)} and kv_seqlens "
            f"{tuple(kv_seqlens.shape)} must have one entry per block-table row ({batch})"
        )
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"prefill attention: out is {tuple(out.shape)} {out.dtype}, the queries "
                         f"{tuple(query.shape)} {query.dtype}: out must match them, contiguous in head_dim")
    if tokens == 0:
        return out
    if batch == 0:
        return out.zero_()
    query = query if query.stride(-1) == 1 else query.contiguous()
    table = block_offsets if block_offsets.stride(-1) == 1 else block_offsets.contiguous()
    group = heads // kv_heads
    bound = max_q_seq_len if 0 < max_q_seq_len <= tokens else tokens
    per_program = _next_power_of_two(group)
    if HEADS_PER_PROGRAM is not None and bound >= ROWS:
        per_program = min(HEADS_PER_PROGRAM, per_program)
    descriptors = per_program == 1 and tokens >= DESC_MIN_TOKENS and _descriptors_fit(query, k_cache, v_cache)
    rows, block_n = (DESC_ROWS, page) if descriptors else (ROWS, BLOCK_N)
    warps, stages = (DESC_WARPS, DESC_STAGES) if descriptors else (NUM_WARPS, NUM_STAGES)
    block_q = max(1, rows // per_program)
    from graphmode.kernels import _triton_kernels

    grid = (batch + 1, -(-bound // block_q), kv_heads * -(-group // per_program))
    _triton_kernels.prefill_kernel[grid](
        query, k_cache, v_cache, out, table, q_start_loc.contiguous(), q_seqlens.contiguous(),
        kv_seqlens.contiguous(), *(_make_descriptors(query, k_cache, v_cache, block_q) if descriptors else [None] * 3),
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        batch, tokens, table.shape[1] * page,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEADS=per_program, BLOCK_Q=block_q, HEAD_DIM=dim,
        BLOCK_D=max(16, _next_power_of_two(dim)), BLOCK_N=block_n, PAGE=page,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DESC=descriptors,
        num_warps=warps, **({} if stages is None else {"num_stages": stages}),
    )
    return out


def _descriptors_fit(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether tensor descriptors serve the kernel: a Hopper or later GPU,
    16-bit queries and caches of one dtype, a (page, head dim) in
    DESC_TILES, every tensor's base and strides multiples of 16 bytes (what
    the copy engine addresses)."""
    if not (TENSOR_DESCRIPTORS and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == v_cache.dtype == query.dtype):
        return False
    if (k_cache.shape[1], query.shape[2]) not in DESC_TILES:
        return False
    return all(_addressable(tensor) for tensor in (query, k_cache, v_cache)) and _hopper(query.device)


def _make_descriptors(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_q: int) -> list[Any]:
    """The kernel's descriptors: ``block_q`` rows of one query head, one
    page of one KV head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    page_block = [1, k_cache.shape[1], 1, query.shape[2]]
    return [TensorDescriptor(query, list(query.shape), list(query.stride()), [block_q, 1, query.shape[2]]),
            *(TensorDescriptor(cache, list(cache.shape), list(cache.stride()), page_block)
              for cache in (k_cache, v_cache))]


def _addressable(tensor: torch.Tensor) -> bool:
    size = tensor.element_size()
    return (tensor.stride(-1) == 1 and tensor.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in tensor.stride()[:-1]))


@functools.cache
def _hopper(device: torch.device) -> bool:
    """Compute capability 9 or more, and a Triton with tensor descriptors."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def opaque_paged_prefill() -> Any:
    """:func:`paged_prefill` behind ``torch.compiler.disable``, made on first
    use (applying it imports Dynamo): under ``torch.compile`` Dynamo breaks
    the graph at prefill attention, as vLLM's compile splits at attention."""
    return torch.compiler.disable(paged_prefill)

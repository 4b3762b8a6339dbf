"""Prefill attention through ``torch.nn.functional.scaled_dot_product_attention``:
the CUDA plugin's prefill (and mixed-step) attention.

The reference ``prefill_attention`` loops over sequences in Python and
computes in float32 over a key tensor expanded to one copy per query token:
at 2048 tokens that is 2 GiB per sequence and layer, and it dominates a
prefill step. An engine runs a fused kernel instead (vLLM and SGLang: varlen
flash attention). This does the same with PyTorch's fused kernels, which
need no extra dependency:

- sequences adding one token (the decodes of a mixed step) go, all at once,
  through the ops' ``paged_decode_attention`` (Triton on CUDA);
- the others are grouped by (new tokens, cached tokens); each group is one
  batched SDPA call over keys and values gathered from the paged cache.
  Causal with no earlier context is SDPA's ``is_causal`` (flash attention on
  CUDA); a chunk after cached tokens gets a bottom-right-aligned causal mask
  (the chunk's token ``i`` sees cached positions ``<= context + i``).

The lengths are read on the host once per call (one device-to-host copy);
this is a break point of piecewise graphs and an eager operator, never
captured. Under ``torch.compile`` it is opaque (:func:`opaque_sdpa_prefill`,
``torch.compiler.disable``): Dynamo breaks the graph here, as vLLM's compile
splits at attention.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from graphmode.context import AttnMetadata

__all__ = ["opaque_sdpa_prefill", "sdpa_prefill"]


@functools.cache
def opaque_sdpa_prefill() -> Any:
    """:func:`sdpa_prefill` behind ``torch.compiler.disable``, made on first
    use: applying it imports Dynamo (and with it Triton), which choosing the
    ops must not."""
    return torch.compiler.disable(sdpa_prefill)


def sdpa_prefill(ops: Any, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attn: AttnMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.prefill_attention``'s contract with fused kernels: (T, H, D)
    queries, each sequence's rows causal over its cached tokens (earlier
    context and this step's, already written) -> (T, H, D), written into
    ``out`` when given (and returned).

    ``ops`` supplies ``block_view`` (the cache as (num_blocks, block_size, K,
    D)) and ``paged_decode_attention`` (for one-token sequences)."""
    head_dim = query.shape[-1]
    k_blocks, v_blocks = ops.block_view(k_cache, head_dim), ops.block_view(v_cache, head_dim)
    lengths = torch.stack([attn.q_start_loc.long(), attn.q_seqlens.long(), attn.kv_seqlens.long()]).tolist()
    starts, q_lens, kv_lens = lengths
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"prefill attention: out is {tuple(out.shape)} {out.dtype}, the queries "
                         f"{tuple(query.shape)} {query.dtype}: out must match them")
    # Rows no sequence owns are zero; when the sequences tile every row
    # (always, from a well-formed step) there are none to clear.
    tiles = list(itertools.accumulate(q_lens, initial=0))
    if tiles[:-1] != starts or tiles[-1] != query.shape[0]:
        out.zero_()
    decodes = [seq for seq, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        _decode_rows(ops, query, k_cache, v_cache, attn, scale, out, decodes, starts, kv_lens)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for seq, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len > 1:
            if kv_len < q_len:
                raise ValueError(
                    f"prefill attention: sequence {seq} adds {q_len} tokens but kv_seqlens is {kv_len}; "
                    "kv_seqlens must count this step's tokens too"
                )
            groups[(q_len, kv_len)].append(seq)
    for (q_len, kv_len), seqs in groups.items():
        rows = _rows([starts[seq] for seq in seqs], q_len, query.device)
        table = attn.block_offsets[seqs, : -(-kv_len // k_blocks.shape[1])].long()
        keys = _gathered(k_blocks, table, kv_len, query.shape[1])
        values = _gathered(v_blocks, table, kv_len, query.shape[1])
        q = query[rows].view(len(seqs), q_len, *query.shape[1:]).transpose(1, 2)  # (G, H, q, D)
        if q_len == kv_len:
            result = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        else:
            context = kv_len - q_len
            mask = torch.arange(kv_len, device=query.device)[None, :] <= (
                torch.arange(context, kv_len, device=query.device)[:, None])
            result = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out[rows] = result.transpose(1, 2).reshape(len(seqs) * q_len, *query.shape[1:]).to(out.dtype)
    return out


def _rows(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    """The query rows of sequences starting at ``starts``, ``length`` each."""
    offsets = torch.arange(length, device=device)
    return (torch.tensor(starts, device=device)[:, None] + offsets[None, :]).reshape(-1)


def _gathered(blocks: torch.Tensor, table: torch.Tensor, length: int, heads: int) -> torch.Tensor:
    """(G, heads, length, D): the first ``length`` cached tokens of each
    table row, KV heads repeated for their query-head group."""
    groups, width = table.shape
    gathered = blocks[table].reshape(groups, width * blocks.shape[1], *blocks.shape[2:])[:, :length]
    kv_heads = blocks.shape[2]
    return gathered.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)


def _decode_rows(ops: Any, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                 scale: float, out: torch.Tensor, seqs: list[int], starts: list[int], kv_lens: list[int]) -> None:
    """The one-token sequences through the ops' batched decode kernel."""
    device = query.device
    index = torch.tensor(seqs, device=device)
    rows = torch.tensor([starts[seq] for seq in seqs], device=device)
    int32 = attn.q_seqlens.dtype
    decode = attn.replace(
        is_decoding=True,
        block_offsets=attn.block_offsets[index],
        q_start_loc=torch.arange(len(seqs), dtype=int32, device=device),
        q_seqlens=torch.ones(len(seqs), dtype=int32, device=device),
        kv_seqlens=attn.kv_seqlens[index],
        kv_start_indices=attn.kv_start_indices.reshape(-1)[rows],
        max_q_seq_len=1,
        max_kv_seq_len=max(kv_lens[seq] for seq in seqs),
        kv_seqlens_cpu=torch.tensor([kv_lens[seq] for seq in seqs], dtype=torch.int32),
        x_active_mask=None,
    )
    out[rows] = ops.paged_decode_attention(query[rows], k_cache, v_cache, decode, scale)

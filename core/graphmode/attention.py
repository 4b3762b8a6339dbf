"""Attention ops: the contract the reference model calls, and its reference
implementation in pure PyTorch.

The cache writes and decode attention are captured in graphs: no host
synchronisation and static shapes. The KV-cache contract, common to every
vendor:

- slot ``-1`` writes nothing (the cache stays byte-for-byte unchanged);
- a padded row's block table points at the reserved block 0, and its length
  (>= 1 unless a vendor says otherwise) makes it read only that block.

Vendors differ in cache layout and in how lengths reach the kernel. The
vendors here subclass :class:`ReferenceAttentionOps` and override
``cache_shape``, ``block_view`` and the small ``_slots`` / ``_decode_limit``
methods; any class with the members of :class:`AttentionOps` will do.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from graphmode.context import AttnMetadata

__all__ = ["AttentionOps", "ReferenceAttentionOps", "attend", "owned_positions", "token_rows", "write_slots"]

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class AttentionOps(Protocol):
    """What graphmode calls on a vendor's attention kernels: the reference
    model and the Hugging Face adapter (``model.ops``), the runner's checks,
    piecewise graphs and the conformance suite. docs/writing-a-plugin.md
    walks through an implementation.

    Shapes: ``T`` new tokens, ``B`` sequences, ``H`` query heads, ``K`` KV
    heads, ``D`` head dim. In decode ``T == B``, or ``T > B`` when sequences
    add several tokens (speculative verify, MTP).

    The KV cache is one (key, value) pair of tensors per layer, in the
    vendor's layout, of ``num_blocks`` blocks of ``block_size`` token slots;
    slot ``s`` is offset ``s % block_size`` of block ``s // block_size``.
    Block 0 is reserved: no sequence owns it, graphs point padding rows (and
    the unused tail of every block table) at it, and it may hold anything
    (NaN included): no live result may depend on it.

    Values: the tensors of ``attn`` are device tensors, except
    ``kv_seqlens_cpu`` and the buffers a vendor declares with ``host=True``;
    ``max_q_seq_len`` and ``max_kv_seq_len`` are host ints. Inside a graph the
    maxima are what the vendor's ``GraphSpec`` says (-1 for "derive it from
    the length tensors", or a bound valid at every replay); eagerly they are
    the step's own maxima. Vendor inputs declared in the ``GraphSpec`` reach
    the kernels as ``attn.vendor_fields[name]`` in graph steps only: an eager
    step (prefill, a batch above the buckets, piecewise attention) carries
    the engine's fields alone, so a kernel derives its own inputs when they
    are absent.
    """

    #: The layout of one cache tensor, in words (``"[num_blocks, block_size,
    #: kv_heads, head_dim]"``): named in the runner's errors.
    layout: str
    #: The vendor whose graph contract (buffers, lengths, host values) these
    #: kernels follow: a runner refuses a model whose ops follow another
    #: vendor's contract than its own vendor's ``graphmode_attention_ops``.
    contract: str

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's key (or value) cache tensor. The block
        count and the block size must each be one dimension of their own:
        the runner reads them from a cache's shape to refuse a cache whose
        blocks hold another number of tokens than its ``block_size``."""

    def make_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype, device: torch.device,
    ) -> KVCache:
        """One (key, value) pair per layer, each of ``cache_shape``, block 0
        included (reserved)."""

    def block_view(self, cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        """``cache`` as (num_blocks, block_size, K, D), sharing its memory
        (a view: writing it writes the cache). The conformance suite compares
        caches slot by slot through it, whatever the layout."""

    def fill_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, attn: AttnMetadata,
    ) -> None:
        """Write key and value (T, K, D) of token ``t`` to slot
        ``attn.kv_start_indices[t]`` ((T,), or (T, 1) where the vendor
        declares a column). A slot < 0 writes nothing: every byte of the
        cache stays as it was (padding rows and warm-up steps pass -1). No
        other slot changes. Captured in decode graphs: no host read of a
        device value, no host-side branching on one."""

    def paged_decode_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        attn: AttnMetadata, scale: float,
    ) -> torch.Tensor:
        """(T, H, D) queries of a decode step -> (T, H, D). With ``T == B``
        (one new token per sequence) row ``b`` reads the first
        ``attn.kv_seqlens[b]`` cached tokens of its block table
        ``attn.block_offsets[b]`` (this step's token included). With
        ``T > B`` sequence ``b``'s ``q_seqlens[b]`` tokens (from
        ``q_start_loc[b]``) are its last cached tokens, and each reads the
        cache up to its own position (causal among the new tokens). Captured
        in decode graphs: no host read of a device value. A padding row has a
        table of block 0 and the declared padding kv length: its result is
        discarded, but it must be finite whatever block 0 holds."""

    def prefill_attention(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        attn: AttnMetadata, scale: float,
    ) -> torch.Tensor:
        """(T, H, D) queries, sequence ``b``'s ``attn.q_seqlens[b]`` tokens
        starting at ``attn.q_start_loc[b]``, causal over its
        ``attn.kv_seqlens[b]`` cached tokens (earlier context and this step's)
        -> (T, H, D). Eager only (piecewise graphs call it between their
        segments): it may read host values.

        Optionally a kernel takes a keyword ``out=None`` (here or in
        ``paged_decode_attention``): a (T, H, D) tensor to write the result
        into and return (or return None). Piecewise graphs then pass the rows of the buffer
        the next segment reads, instead of copying the result there."""


def write_slots(blocks: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``blocks[slot // bs, slot % bs] = values`` for every slot >= 0, where
    ``blocks`` is a (num_blocks, block_size, K, D) view of a cache.

    Slots < 0 are redirected to slot 0 and write back what slot 0 holds, so
    the cache stays byte-for-byte unchanged, with no host synchronisation.
    """
    block_size = blocks.shape[1]
    valid = slots >= 0
    safe = torch.where(valid, slots, 0)
    block, offset = safe // block_size, safe % block_size
    current = blocks[block, offset]
    blocks[block, offset] = torch.where(valid[:, None, None], values.to(blocks.dtype), current)


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention in float32.

    query (N, H, D); keys, values (N, L, K, D); visible (N, L) bool.
    A row with nothing visible gets zeros. Positions that are not visible
    never reach the result, whatever they hold: their values are zeroed
    before the weighted sum, because a zero weight times a NaN (a cache made
    with ``torch.empty``, or the reserved block) is still NaN."""
    n, heads, dim = query.shape
    kv_heads = keys.shape[2]
    q = query.float().view(n, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("nkgd,nlkd->nkgl", q, keys.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    values = values.float().masked_fill(~visible[:, :, None, None], 0.0)
    out = torch.einsum("nkgl,nlkd->nkgd", probs, values)
    return out.reshape(n, heads, dim).to(query.dtype)


def token_rows(attn: AttnMetadata, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of a step's ``tokens`` new tokens, on the device: the row
    (sequence) it belongs to, from ``q_start_loc`` (ascending: sequences back
    to back), and how many of its sequence's new tokens come after it, from
    ``q_seqlens``. No host reads; shapes depend only on ``tokens`` and the
    batch."""
    token = torch.arange(tokens, device=attn.q_start_loc.device)
    starts = attn.q_start_loc.long()
    row = (token[:, None] >= starts[None, :]).sum(1) - 1
    ahead = starts[row] + attn.q_seqlens.long()[row] - 1 - token
    return row, ahead


def owned_positions(block_offsets: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) False where a gathered position lies in the reserved
    block 0, which no sequence owns: padding rows (whose table is all block 0)
    then read nothing and get zeros, whatever the reserved block holds."""
    block_size = length // block_offsets.shape[1]
    return (block_offsets != 0).repeat_interleave(block_size, dim=1)


class ReferenceAttentionOps:
    """Pure-PyTorch kernels on a (num_blocks, block_size, K, D) cache: the
    CUDA default, and the base of the vendors' reference kernels."""

    layout = "[num_blocks, block_size, kv_heads, head_dim]"
    # The vendor whose graph contract (buffers, lengths, host values) these
    # kernels follow: a runner refuses a model built on another's.
    contract = "cuda"

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's key (or value) cache in this layout."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def make_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = self.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    def block_view(self, cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The cache as (num_blocks, block_size, K, D), sharing its memory."""
        return cache

    def _slots(self, attn: AttnMetadata) -> torch.Tensor:
        """One slot per token: a (T,) vector, or the squeezed column of a
        (T, 1) slot buffer (MACA, PPU)."""
        return attn.kv_start_indices.reshape(-1)

    def _decode_limit(self, attn: AttnMetadata) -> torch.Tensor:
        """(B, 1) how many cached tokens each row may read."""
        return attn.kv_seqlens[:, None]

    #: fill_kv_cache reads only ``attn.kv_start_indices`` (through ``_slots``)
    #: and a slot of -1 writes nothing: piecewise graphs capture it in their
    #: segments (graphmode.families.piecewise.breaks.writes_kv_in_graph).
    kv_write_in_graph = True

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = self._slots(attn)
        write_slots(self.block_view(k_cache, key.shape[-1]), slots, key)
        write_slots(self.block_view(v_cache, value.shape[-1]), slots, value)

    def _gather(self, cache: torch.Tensor, block_offsets: torch.Tensor, head_dim: int) -> torch.Tensor:
        blocks = self.block_view(cache, head_dim)[block_offsets.long()]  # (B, W, bs, K, D)
        batch, width, block_size, kv_heads, dim = blocks.shape
        return blocks.reshape(batch, width * block_size, kv_heads, dim)

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        keys = self._gather(k_cache, attn.block_offsets, query.shape[-1])
        values = self._gather(v_cache, attn.block_offsets, query.shape[-1])
        positions = torch.arange(keys.shape[1], device=query.device)
        limit = self._decode_limit(attn)
        owned = owned_positions(attn.block_offsets, keys.shape[1])
        if query.shape[0] == attn.block_offsets.shape[0]:  # one new token per sequence
            return attend(query, keys, values, (positions[None, :] < limit) & owned, scale)
        # Several new tokens per sequence: each token sees its sequence's cache
        # up to its own position, kv_seqlens - (its sequence's tokens after it).
        row, ahead = token_rows(attn, query.shape[0])
        visible = (positions[None, :] < limit[row] - ahead[:, None]) & owned[row]
        return attend(query, keys[row], values[row], visible, scale)

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        k_blocks, v_blocks = self.block_view(k_cache, head_dim), self.block_view(v_cache, head_dim)
        block_size = k_blocks.shape[1]
        out = torch.empty_like(query)
        starts = attn.q_start_loc.tolist()
        q_lens = attn.q_seqlens.tolist()
        kv_lens = attn.kv_seqlens.tolist()
        for seq, (start, q_len, kv_len) in enumerate(zip(starts, q_lens, kv_lens)):
            blocks = attn.block_offsets[seq, : -(-kv_len // block_size)].long()
            keys = k_blocks[blocks].flatten(0, 1)[:kv_len]
            values = v_blocks[blocks].flatten(0, 1)[:kv_len]
            positions = torch.arange(kv_len - q_len, kv_len, device=query.device)
            visible = torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None]
            rows = query[start : start + q_len]
            out[start : start + q_len] = attend(
                rows, keys.expand(q_len, -1, -1, -1), values.expand(q_len, -1, -1, -1), visible, scale
            )
        return out

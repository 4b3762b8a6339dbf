"""T-Head PPU's attention contract, in pure PyTorch.

Upstream PPU (dlinfer's ``dlinfer/vendor/ppu/ppu_ops.py``, removed in 2025)
called vLLM's FlashAttention ``flash_attn_varlen_func`` for decode and prefill,
with ``seqused_k=kv_seqlens``, a ``block_table`` and
``max_seqlen_k=max_kv_seq_len``. FlashAttention documents ``max_seqlen_k`` as
the "Maximum key sequence length in the batch" and has no "derive it" value:
``mha_varlen_fwd`` (``csrc/flash_attn/flash_api.cpp``) launches the kernel only
``if (max_seqlen_k > 0)`` and otherwise zeroes the output. So -1 gives zeros,
and a value below a sequence's length breaks the documented contract.

A graph freezes the integer at capture, so graph contexts pass a bound that
holds at every replay: the block table's capacity, ``num_blocks x
block_size`` (FlashAttention's own paged ``mha_fwd_kvcache`` uses exactly that,
``max_num_blocks_per_seq * page_block_size``, as its ``seqlen_k``).

This reference kernel enforces the contract, so that the conformance suite
fails a plugin that breaks it:

- ``max_q_seq_len`` or ``max_kv_seq_len`` <= 0 raises :class:`InputError` at
  the call (eager, warm-up or capture): it is a host integer;
- a kv (or query) length above ``max_kv_seq_len`` (``max_q_seq_len``) fails
  a device-side assertion
  (``torch._assert_async``): no host read, so it is captured into the graph
  and checked at every replay. On CUDA a failed device assertion is fatal to
  the process, as an out-of-contract FlashAttention call would be at best.
"""

from __future__ import annotations

import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.context import AttnMetadata
from graphmode.errors import InputError

__all__ = ["PPUAttentionOps", "check_maxima"]


def check_maxima(attn: AttnMetadata) -> None:
    """Refuse maxima FlashAttention's varlen kernels cannot take; check on the
    device, without a host read, that no kv length is above the bound."""
    for name in ("max_q_seq_len", "max_kv_seq_len"):
        value = getattr(attn, name)
        if value <= 0:
            raise InputError(
                f"{name}={value}: PPU's FlashAttention varlen kernel needs a positive upper bound "
                "(it returns zeros for max_seqlen_k <= 0; there is no 'derive it' value). In a graph "
                "context pass the block table's capacity, block_offsets width x block_size"
            )
    for lengths, name in ((attn.kv_seqlens, "max_kv_seq_len"), (attn.q_seqlens, "max_q_seq_len")):
        bound = getattr(attn, name)
        # Under 255 characters: CUDA refuses a longer assertion message.
        torch._assert_async(
            (lengths <= bound).all(),
            f"PPU: a length is above {name}={bound}. An engine: pass the step's real maximum "
            "(debug mode names the row). A graph context: a bound valid at every replay (kv: the table's capacity)",
        )


class PPUAttentionOps(ReferenceAttentionOps):
    """The reference kernels (CUDA layout) with FlashAttention's maxima
    contract enforced."""

    contract = "ppu"

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        check_maxima(attn)
        return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        check_maxima(attn)
        return super().prefill_attention(query, k_cache, v_cache, attn, scale)

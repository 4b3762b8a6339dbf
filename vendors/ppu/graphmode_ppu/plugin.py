"""T-Head PPU: CUDA graphs with power-of-two buckets, a (max_batches, 1)
int64 slot column, -1 for padding, and maxima that hold at every replay.

Upstream read ``max_q_seq_len`` and ``max_kv_seq_len`` with ``.item()``
while filling buffers: a host synchronisation every step, and a value the
graph froze at capture. This plugin reads nothing on the host: filling is the
default's device-side copy. PPU's FlashAttention varlen kernel needs positive
maxima (it returns zeros for ``max_seqlen_k <= 0``; see ``graphmode_ppu.ops``),
so graph contexts pass upper bounds a graph can keep: ``max_q_seq_len = 1``
(decode) and ``max_kv_seq_len`` = the block table's capacity,
``num_blocks x block_size``.
"""

from __future__ import annotations

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.context import StepInputs
from graphmode.meta import GraphMeta
from graphmode_ppu.ops import PPUAttentionOps


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    if not torch.cuda.is_available():
        detected, reason = False, "no CUDA-compatible device is visible"
    else:
        name = torch.cuda.get_device_name(0)
        detected = "ppu" in name.lower()
        reason = f"PPU device: {name}" if detected else (
            f"the CUDA device is not a T-Head PPU ({name}); graphs run there with PPU's reference contract"
        )
    return VendorInfo(
        name="ppu",
        device_types=("cuda",),
        runtime="T-Head torch (PPU)",
        runtime_version=torch.version.cuda,
        detected=detected,
        reason=reason,
    )


@hookimpl(wrapper=True)
def graphmode_make_buffers(meta: GraphMeta):
    buffers = yield
    buffers["kv_start_indices"] = torch.full((meta.max_batchs, 1), -1, dtype=torch.int64, device=meta.device)
    return buffers


@hookimpl(wrapper=True)
def graphmode_update_context(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int):
    static = yield
    attn = static.attn_metadata
    # Every replay's block table fits the buffer, so its capacity bounds every
    # replay's kv lengths; each decode row adds one query token.
    attn.max_kv_seq_len = attn.block_offsets.shape[1] * meta.block_size
    attn.max_q_seq_len = 1
    return static


@hookimpl
def graphmode_attention_ops() -> PPUAttentionOps:
    return PPUAttentionOps()

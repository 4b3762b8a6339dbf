"""T-Head PPU: CUDA graphs with a (max_batches, 1) int64 slot column (one
row per token), -1 for padding, and maxima that hold at every replay.

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
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec, GraphSpec
from graphmode_ppu.ops import PPUAttentionOps

# Every replay's block table fits the buffer, so its capacity bounds every
# replay's kv lengths; a decode graph's rows add its q_len query tokens
# ("bound"). FlashAttention's varlen kernel takes several causal queries per
# sequence (taken by the reference contract, not checked on a PPU).
PPU_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS, 1), padding=-1),
).replace(max_q_policy="bound", max_kv_policy="capacity", max_q_len=None)


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


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return PPU_SPEC


@hookimpl
def graphmode_attention_ops() -> PPUAttentionOps:
    return PPUAttentionOps()

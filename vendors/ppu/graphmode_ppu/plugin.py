"""T-Head PPU: CUDA graphs with power-of-two buckets and a (max_batches, 1)
int64 slot column, -1 for padding.

Upstream read ``max_q_seq_len`` and ``max_kv_seq_len`` with ``.item()``
while filling buffers: a host synchronisation every step, and a value the
graph froze at capture. This plugin reads nothing on the host: filling is the
default's device-side copy, and the graph context passes -1 maxima.
"""

from __future__ import annotations

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.meta import GraphMeta


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

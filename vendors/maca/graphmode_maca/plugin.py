"""MetaX MACA: CUDA graphs (``torch.cuda.CUDAGraph``) with MACA's buffers.

Differences from the CUDA default:
- ``kv_start_indices`` is a (max_batches, 1) int64 column, -1 for padding; the
  fill-cache kernel takes the squeezed column and skips negative slots;
- padding kv lengths are 0 (the flash-attention-with-kvcache kernel takes
  ``cache_seqlens`` as a device tensor and returns zeros for empty rows).
Padding is reset every step (upstream MACA left stale rows from an earlier,
larger batch).
"""

from __future__ import annotations

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.meta import GraphMeta


def _metax_device() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA-compatible device is visible"
    name = torch.cuda.get_device_name(0)
    if getattr(torch.version, "maca", None) or "metax" in name.lower():
        return True, f"MetaX device: {name}"
    return False, f"the CUDA device is not a MetaX GPU ({name}); graphs run there with MACA's reference contract"


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    detected, reason = _metax_device()
    return VendorInfo(
        name="maca",
        device_types=("cuda",),
        runtime="MetaX torch (MACA)",
        runtime_version=getattr(torch.version, "maca", None) or torch.version.cuda,
        detected=detected,
        reason=reason,
    )


@hookimpl(wrapper=True)
def graphmode_make_buffers(meta: GraphMeta):
    buffers = yield
    buffers["kv_start_indices"] = torch.full((meta.max_batchs, 1), -1, dtype=torch.int64, device=meta.device)
    buffers["kv_seqlens"] = torch.zeros(meta.max_batchs, dtype=torch.int32, device=meta.device)
    return buffers

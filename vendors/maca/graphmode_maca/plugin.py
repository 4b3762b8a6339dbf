"""MetaX MACA: CUDA graphs (``torch.cuda.CUDAGraph``) with MACA's buffers.

Its declarations differ from the CUDA default in two buffers:
- ``kv_start_indices`` is a column, one row per token (in decode, one per
  sequence: (max_batches, 1)), int64, -1 for padding; the fill-cache kernel
  takes the squeezed column and skips negative slots;
- padding kv lengths are 0 (the flash-attention-with-kvcache kernel takes
  ``cache_seqlens`` as a device tensor and returns zeros for empty rows).
Padding is reset every step by the core (upstream MACA left stale rows from
an earlier, larger batch).
"""

from __future__ import annotations

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec, GraphSpec

# Decode graphs of several causal queries per sequence (flash attention with
# kvcache takes a (B, q, H, D) query): taken by the reference contract, not
# checked on a MetaX GPU.
MACA_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS, 1), padding=-1),
    BufferSpec("kv_seqlens", torch.int32, padding=0),
).replace(max_q_len=None)


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


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return MACA_SPEC

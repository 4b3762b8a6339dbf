"""NPU stream budget and the advice for capture failures it causes.

An ACL graph holds about (layers + 1) streams, more with communication
groups, and an NPU has 2048. vllm-ascend caps graphs at a budget of about
1800 streams and keeps an evenly spaced subset of capture sizes that includes
the smallest and the largest.
"""

from __future__ import annotations

from graphmode.errors import CaptureError

__all__ = ["DEFAULT_STREAM_BUDGET", "capture_advice", "trim_to_stream_budget"]

DEFAULT_STREAM_BUDGET = 1800
_STREAM_SIGNATURES = ("207008", "insufficient stream resources")
_OLD_DRIVER_SIGNATURE = "alloc sq cq fail"


def trim_to_stream_budget(sizes: list[int], num_layers: int | None, budget: int, comm_groups: int = 0) -> list[int]:
    """At most ``budget // ((layers + 1) * (1 + comm_groups))`` sizes, evenly
    spaced over ``sizes`` and keeping its first and last."""
    if num_layers is None:
        return sizes
    per_graph = (num_layers + 1) * (1 + comm_groups)
    room = max(2, budget // per_graph)
    if len(sizes) <= room:
        return sizes
    last = len(sizes) - 1
    picked = {round(i * last / (room - 1)) for i in range(room)}
    return [sizes[i] for i in sorted(picked)]


def capture_advice(error: BaseException, bucket: int, capture_sizes: tuple[int, ...]) -> CaptureError | None:
    """Advice for a capture failure with a known Ascend signature, or None."""
    text = str(error).lower()
    if any(signature in text for signature in _STREAM_SIGNATURES):
        return CaptureError(
            f"capturing bucket {bucket} ran out of NPU streams (error 207008, insufficient stream "
            f"resources): each graph holds about (layers + 1) streams, {len(capture_sizes)} graphs were "
            "asked for, and the device has 2048. Capture fewer sizes: pass capture_batch_sizes, or lower "
            "vendor_options={'stream_budget': ...} so that graphmode trims the list; "
            "HCCL_OP_EXPANSION_MODE=AIV also frees streams"
        )
    if _OLD_DRIVER_SIGNATURE in text:
        return CaptureError(
            f"capturing bucket {bucket} failed with 'alloc sq cq fail': the Ascend driver (HDK) is too "
            "old for graphs of this size. Upgrade the HDK, or capture fewer sizes (capture_batch_sizes)"
        )
    return None

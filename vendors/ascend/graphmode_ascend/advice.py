"""Advice for Ascend capture failures with a known signature.

graphmode captures every size asked for, as vllm-ascend does since it removed
its stream-budget trimming (``update_aclgraph_sizes``, PR 9962, June 2026). A
device that runs out of streams fails the capture with error 207008; that
failure becomes advice saying how many graphs were captured out of how many
were asked for, and what to set. In piecewise modes the setting is
``capture_token_sizes`` and each token size costs one graph per piece, about
layers + 1 (SGLang #12287; vllm-ascend's old budget formula counted the same),
not one graph per size. The signature is matched as vllm-ascend
matches it (``vllm_ascend/compilation/acl_graph.py``): torch_npu prints the
code with the text of ``NPUErrorCodes.h``, "Stream resources are insufficient".
"""

from __future__ import annotations

from collections.abc import Sequence

from graphmode.errors import CaptureError

__all__ = ["capture_advice", "is_old_hdk_error", "is_stream_error"]

_STREAM_CODE = "207008"
_STREAM_MARKERS = ("insufficient_stream_resources", "stream resources are insufficient")
_OLD_HDK_MARKER = "alloc sq cq fail"


def is_stream_error(error: BaseException) -> bool:
    """vllm-ascend's test: a marker, or the code together with "stream resource"."""
    text = str(error).lower()
    return any(marker in text for marker in _STREAM_MARKERS) or (_STREAM_CODE in text and "stream resource" in text)


def is_old_hdk_error(error: BaseException) -> bool:
    return _OLD_HDK_MARKER in str(error).lower()


def _spread(sizes: Sequence[int], count: int) -> list[int]:
    """``count`` of ``sizes``, evenly spaced, keeping the largest (and the
    smallest when there is room): every batch then still has a graph."""
    if count >= len(sizes):
        return list(sizes)
    if count == 1:
        return [sizes[-1]]
    last = len(sizes) - 1
    return [sizes[i] for i in sorted({round(i * last / (count - 1)) for i in range(count)})]


def capture_advice(
    error: BaseException, bucket: int, captured: int, asked: Sequence[int], pieces: int | None = None
) -> CaptureError | None:
    """Advice for a capture failure with a known Ascend signature, or None.

    ``captured``: how many graphs are captured and alive; ``asked``: every
    capture size, ascending. ``pieces``: None when a full graph of batch
    bucket ``bucket`` failed; when a piecewise graph of token bucket
    ``bucket`` failed, how many of the ``captured`` graphs are pieces of
    piecewise graphs, and ``asked`` is the token sizes."""
    if is_stream_error(error):
        if pieces is not None:
            return _piecewise_stream_advice(bucket, captured, asked, pieces)
        fits = captured
        if fits:
            fewer = (
                f"pass capture_batch_sizes with at most {fits} sizes, for example {_spread(asked, fits)}, "
                "or lower max_batches"
            )
        else:
            fewer = "no graph fits: free the streams other processes hold on this NPU"
        return CaptureError(
            f"capturing bucket {bucket} ran out of NPU streams (error 207008, \"Stream resources are "
            f"insufficient\") after {fits} of the {len(asked)} graphs asked for were captured. Each "
            "captured graph holds NPU streams until it is freed, and the device has a fixed number. "
            f"Capture fewer graphs: {fewer}; HCCL_OP_EXPANSION_MODE=AIV frees the streams HCCL takes; "
            "execute_mode='eager' captures nothing"
        )
    if is_old_hdk_error(error):
        return CaptureError(
            f"capturing bucket {bucket} failed with 'alloc sq cq fail': the Ascend driver (HDK) is too "
            "old for graphs of this size. Upgrade the HDK to 25.5.1 or later with its matching CANN, or "
            "capture fewer sizes (capture_batch_sizes)"
        )
    return None


def _piecewise_stream_advice(bucket: int, captured: int, asked: Sequence[int], pieces: int) -> CaptureError:
    """Piecewise graphs: one graph per piece of every token size."""
    if captured:
        fewer = (
            f"pass capture_token_sizes with at most {captured} / (layers + 1) sizes (it has {len(asked)}: "
            f"{list(asked)}), keeping the largest, or use execute_mode='graph' (one graph per batch size)"
        )
    else:
        fewer = "no graph fits: free the streams other processes hold on this NPU"
    return CaptureError(
        f"capturing the piecewise graph of token bucket {bucket} ran out of NPU streams (error 207008, "
        f"\"Stream resources are insufficient\") after {captured} graphs were captured ({pieces} of them "
        "pieces of piecewise graphs). In piecewise modes every token size is captured as one graph per "
        "piece, about layers + 1 graphs (the pieces between attention calls), so the "
        f"{len(asked)} token sizes asked for need about {len(asked)} x (layers + 1) graphs; each graph holds "
        "NPU streams until it is freed, and the device has a fixed number. Capture fewer token sizes: "
        f"{fewer}; HCCL_OP_EXPANSION_MODE=AIV frees the streams HCCL takes; execute_mode='eager' captures "
        "nothing"
    )

"""Fused attention kernels for the reference model, and the choice between
them and the pure-PyTorch reference kernels.

Each kernel module imports its kernel library (Triton) only when a kernel
first runs, so everything here imports on a machine without it.
"""

from __future__ import annotations

import os

import torch

from graphmode.attention import ReferenceAttentionOps

__all__ = ["ATTENTION_CHOICES", "ENV_ATTENTION", "cuda_attention_ops"]

ENV_ATTENTION = "GRAPHMODE_ATTENTION"
ATTENTION_CHOICES = ("auto", "triton", "reference")


def cuda_attention_ops(choice: str | None = None) -> ReferenceAttentionOps:
    """The CUDA plugin's attention ops.

    choice: "auto" (the default) takes the Triton kernels when Triton can be
    imported and a CUDA device is visible, else the reference kernels;
    "triton" takes them whatever the device (they fall back to the reference
    kernels on tensors that are not on CUDA); "reference" takes the
    pure-PyTorch kernels. None reads ``$GRAPHMODE_ATTENTION``.
    """
    from graphmode.kernels.triton_decode import TritonAttentionOps, triton_available

    if choice is None:
        choice = os.environ.get(ENV_ATTENTION, "").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(
            f"attention={choice!r} (from the argument or ${ENV_ATTENTION}) is not one of "
            f"{', '.join(ATTENTION_CHOICES)}"
        )
    if choice == "triton" and not triton_available():
        raise ValueError(
            f"attention='triton' (from the argument or ${ENV_ATTENTION}) needs Triton, which is not "
            "installed here: `pip install triton`, or choose 'reference'"
        )
    if choice == "triton" or (choice == "auto" and triton_available() and torch.cuda.is_available()):
        return TritonAttentionOps()
    return ReferenceAttentionOps()

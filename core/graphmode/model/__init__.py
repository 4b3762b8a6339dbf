"""The reference model: a Llama-style decoder on the vendor's attention ops."""

from __future__ import annotations

import torch

from graphmode.model.config import ModelConfig
from graphmode.model.llama import LlamaModel
from graphmode.model.ops import AttentionOps, ReferenceAttentionOps, attend, write_slots

__all__ = [
    "AttentionOps",
    "LlamaModel",
    "ModelConfig",
    "ReferenceAttentionOps",
    "attend",
    "build_reference_model",
    "write_slots",
]


def build_reference_model(
    config: ModelConfig, vendor=None, device: torch.device | str = "cpu", seed: int = 0,
    ops: AttentionOps | None = None,
) -> LlamaModel:
    """The reference model on ``device`` with the vendor's attention ops
    (a :class:`graphmode.Vendor`, a vendor name, or None for the default),
    or with ``ops`` when given (in the vendor's cache layout)."""
    from graphmode.plugins import Vendor, load_vendor

    if ops is None:
        if not isinstance(vendor, Vendor):
            vendor = load_vendor(vendor or "cuda")
        ops = vendor.hook.graphmode_attention_ops()
    model = LlamaModel(config, ops).init_weights(seed).to(device=device, dtype=config.dtype)
    # Rotary angles stay in float32 whatever the weights' dtype.
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval()

"""The reference model: a Llama-style decoder on the vendor's attention ops."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphmode.attention import AttentionOps
from graphmode.errors import ConfigError
from graphmode.model.config import ModelConfig
from graphmode.model.llama import LlamaModel

if TYPE_CHECKING:
    from graphmode.plugins import Vendor

__all__ = ["LlamaModel", "ModelConfig", "build_reference_model"]


def build_reference_model(
    config: ModelConfig, vendor=None, device: torch.device | str = "cpu", seed: int = 0,
    ops: AttentionOps | None = None, vendor_options: Any = None,
) -> LlamaModel:
    """The reference model on ``device``, in eval mode, weights from ``seed``.

    Its attention comes from one of two places:

    - ``ops=``: an object implementing :class:`AttentionOps` (the protocol in
      ``graphmode.attention``; :class:`ReferenceAttentionOps` is the
      pure-PyTorch one), used as given: the entry
      point for a kernel under development, a test, or a vendor's ops before
      any plugin exists; no plugin manager is involved;
    - ``vendor=`` (a :class:`graphmode.Vendor`, a vendor name, or None for the
      built-in one), a convenience: the vendor's ``graphmode_attention_ops``
      hook gives the ops, built for ``vendor_options`` (what the engine passes
      the runner too; None for the vendor's defaults).

    Giving both is an error: the model would silently ignore one of them.
    """
    if ops is not None:
        if vendor is not None:
            raise ConfigError(
                f"build_reference_model got both vendor={getattr(vendor, 'name', vendor)!r} and ops={ops!r}; "
                "pass ops= alone to use those ops, or vendor= alone to use the vendor's"
            )
    else:
        ops = _vendor_ops(vendor, vendor_options)
    model = LlamaModel(config, ops).init_weights(seed).to(device=device, dtype=config.dtype)
    # Rotary angles stay in float32 whatever the weights' dtype.
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval()


def _vendor_ops(vendor: Vendor | str | None, vendor_options: Any) -> AttentionOps:
    """The attention ops of ``vendor`` (a Vendor, a name, or None: the built-in)."""
    # Only this convenience needs the plugin manager (and through it the vendors).
    from graphmode.plugins import Vendor, load_vendor

    if not isinstance(vendor, Vendor):
        vendor = load_vendor(vendor or "cuda")
    return vendor.attention_ops(vendor_options)

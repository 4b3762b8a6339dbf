"""Choosing the active vendor: explicit argument, then ``$GRAPHMODE_VENDOR``,
then detection. Exactly one vendor is active; every refusal lists what is
installed and why each vendor is or is not usable.
"""

from __future__ import annotations

import os

import torch

from graphmode.errors import VendorError
from graphmode.plugins.manager import BUILTIN_VENDOR, Vendor, describe_vendors, load_vendor, vendor_statuses

__all__ = ["ENV_VENDOR", "select_vendor"]

ENV_VENDOR = "GRAPHMODE_VENDOR"


def select_vendor(vendor: str | None = None, device: torch.device | str | None = None) -> Vendor:
    """The vendor to use on ``device`` (any device when None)."""
    requested = vendor or os.environ.get(ENV_VENDOR) or None
    if requested:
        chosen = load_vendor(requested.strip())
        source = "vendor=" if vendor else f"${ENV_VENDOR}="
    else:
        detected = [v for name, v, _ in vendor_statuses() if v is not None and name != BUILTIN_VENDOR and v.info.detected]
        if len(detected) > 1:
            raise VendorError(
                f"more than one vendor detected ({', '.join(v.name for v in detected)}); "
                f"choose one with vendor= or ${ENV_VENDOR}. Installed vendors:\n{describe_vendors()}"
            )
        chosen = detected[0] if detected else load_vendor(BUILTIN_VENDOR)
        source = "detected "
    if device is not None:
        try:
            device = torch.device(device)
        except RuntimeError:
            raise VendorError(
                f"torch does not know the device {device!r}: the vendor's torch extension "
                f"is not installed or failed to load. Installed vendors:\n{describe_vendors()}"
            ) from None
        usable, why = chosen.info.runs_on(device)
        if not usable:
            raise VendorError(
                f"{source}{chosen.name!r} cannot run graphs on {device}: {why}. "
                f"Installed vendors:\n{describe_vendors()}"
            )
    return chosen

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


def select_vendor(vendor: str | Vendor | None = None, device: torch.device | str | None = None) -> Vendor:
    """The vendor to use on ``device`` (any device when None): ``vendor``, a
    name or a loaded :class:`Vendor` (``load_vendor(name, plugin=...)``: a
    plugin not installed), else ``$GRAPHMODE_VENDOR``, else detection."""
    if isinstance(vendor, Vendor):
        chosen, source = vendor, "vendor="
    elif vendor is not None and not isinstance(vendor, str):
        raise VendorError(
            f"vendor={vendor!r}: give an installed vendor's name (its entry-point name), or a graphmode.Vendor "
            "(graphmode.load_vendor(name, plugin=module) for a plugin that is not installed)"
        )
    else:
        chosen, source = _named_or_detected(vendor)
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


def _named_or_detected(vendor: str | None) -> tuple[Vendor, str]:
    """The vendor named by ``vendor`` or ``$GRAPHMODE_VENDOR``, else the one
    detected, else the built-in one; and where the choice came from."""
    requested = vendor or os.environ.get(ENV_VENDOR) or None
    if requested:
        return load_vendor(requested.strip()), "vendor=" if vendor else f"${ENV_VENDOR}="
    detected = [v for name, v, _ in vendor_statuses() if v is not None and name != BUILTIN_VENDOR and v.info.detected]
    if len(detected) > 1:
        raise VendorError(
            f"more than one vendor detected ({', '.join(v.name for v in detected)}); "
            f"choose one with vendor= or ${ENV_VENDOR}. Installed vendors:\n{describe_vendors()}"
        )
    return (detected[0] if detected else load_vendor(BUILTIN_VENDOR)), "detected "

"""Choosing the active vendor: explicit argument, then ``$GRAPHMODE_VENDOR``,
then detection. Exactly one vendor is active; every refusal lists what is
installed and why each vendor is or is not usable.
"""

from __future__ import annotations

import os

import torch

from graphmode.errors import VendorError
from graphmode.plugins.manager import BUILTIN_VENDOR, Vendor, installed_vendor_names, load_vendor

__all__ = ["ENV_VENDOR", "describe_vendors", "select_vendor", "vendor_statuses"]

ENV_VENDOR = "GRAPHMODE_VENDOR"


def vendor_statuses() -> list[tuple[str, Vendor | None, str]]:
    """(name, loaded vendor or None, one-line status) per installed vendor."""
    rows: list[tuple[str, Vendor | None, str]] = []
    for name in installed_vendor_names():
        try:
            vendor = load_vendor(name)
            info = vendor.info
        except Exception as error:  # a broken plugin must not hide the others
            rows.append((name, None, f"cannot load: {error}".splitlines()[0]))
            continue
        state = "detected" if info.detected else "not detected"
        version = info.runtime_version or "unavailable"
        rows.append((
            name,
            vendor,
            f"{state}: {info.reason} [{info.runtime} {version}; graphs on "
            f"{', '.join(info.device_types)} and the cpu emulator]",
        ))
    return rows


def describe_vendors() -> str:
    """One line per installed vendor, for error messages and the CLI."""
    return "\n".join(f"  {name}: {status}" for name, _, status in vendor_statuses())


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

"""Detection agrees with the machine.

Automatic selection (``graphmode.select_vendor()`` with no vendor named)
picks the vendor whose ``graphmode_vendor_info`` says ``detected``. A vendor
that says so where its runtime or device is absent is picked there, and its
graphs then run on a device that does not exist. What the vendor declares is
enough to check it on any machine: ``detected`` requires

- its runtime, where ``VendorInfo.runtime`` names a module
  (``torch_npu``, ``torch_mlu``), to be importable
  (``importlib.util.find_spec``);
- a device of one of its ``device_types`` to be visible to torch
  (``torch.<type>.is_available()``).

(Where both are present, not being detected is allowed: MACA and PPU run on
NVIDIA GPUs with their reference contract but detect only their own.)
"""

from __future__ import annotations

import importlib.util

import torch

from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure

__all__ = ["DetectionTests", "runtime_module", "visible_device_types"]


def runtime_module(runtime: str) -> str | None:
    """The module ``VendorInfo.runtime`` names, or None where it names a
    stack in words ("torch CUDA", "MetaX torch (MACA)")."""
    return runtime if all(part.isidentifier() for part in runtime.split(".")) else None


def visible_device_types(device_types: tuple[str, ...]) -> list[str]:
    """Those of ``device_types`` with a device torch sees here."""
    visible = []
    for device_type in device_types:
        module = getattr(torch, device_type, None)
        available = getattr(module, "is_available", None)
        if available is not None and available():
            visible.append(device_type)
    return visible


class DetectionTests(ConformanceFixtures):
    def test_detection_agrees_with_this_machine(self, vendor):
        info = vendor.hook.graphmode_vendor_info()  # asked again: Vendor.info is cached
        if not info.detected:
            return
        missing = []
        module = runtime_module(info.runtime)
        if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
            missing.append(f"its runtime {module} is not installed (importlib.util.find_spec({module!r}) is None)")
        if not visible_device_types(info.device_types):
            types = ", ".join(f"torch.{t}.is_available()" for t in info.device_types)
            missing.append(f"no device of its types is visible ({types}: none is True)")
        if missing:
            raise ConformanceFailure(
                f"[detection] vendor {vendor.name}: graphmode_vendor_info says detected (reason: {info.reason!r}), "
                f"but on this machine {' and '.join(missing)}. Automatic selection (select_vendor() with no vendor "
                f"named) would pick {vendor.name} here. Hook: graphmode_vendor_info must report detected=False "
                "unless its runtime imports and its device is visible (graphmode.vendor_info.probe_runtime does both)"
            )

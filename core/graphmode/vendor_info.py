"""VendorInfo: what a vendor plugin says about itself."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

__all__ = ["CAPABILITIES", "VendorInfo", "device_available", "probe_runtime"]

CAPABILITIES = {
    "inductor_graphs": "Inductor's kernels (torch.compile) run inside the vendor's graphs on "
    "its device types: build_graph_runner(compile=True) is supported",
    "host_kv_lengths": "the attention kernel takes kv lengths as host values, which a "
    "graph freezes: the vendor must push them into the graph before every replay",
    "positive_max_len_limits": "the attention kernel reads only max_kv_seq_len tokens "
    "when it is positive, so graphs must pass -1",
    "x_active_mask": "the step context carries x_active_mask, False for padding tokens",
    "host_staging": "every write of the plugin's graphmode_fill_buffers goes through "
    "graphmode.buffers.stage, so the runner may stage the buffers in a pinned host mirror",
}


@dataclass(frozen=True)
class VendorInfo:
    """A vendor's self-description, from ``graphmode_vendor_info``.

    name: the vendor's name, equal to its entry-point name.
    device_types: torch device types its graphs run on (its own, and "cuda"
        for vendors whose CUDA-compatible contract also runs on NVIDIA GPUs).
        Every vendor also runs on "cpu", through the graph emulator.
    runtime: the software stack the vendor needs ("torch_npu", ...).
    runtime_version: that stack's version, or None when it is not installed.
    detected: whether the vendor's own hardware and runtime are present here.
    reason: why it was or was not detected, in words.
    capabilities: what the vendor's kernels do that tests must know, from
        ``CAPABILITIES``; the conformance suite and the runner gate on these,
        never on names.
    execute_mode: the execute mode a runner takes when the engine names none
        (one of ``graphmode.config.EXECUTE_MODES``): "graph" unless the
        vendor says otherwise.
    """

    name: str
    device_types: tuple[str, ...]
    runtime: str
    runtime_version: str | None
    detected: bool
    reason: str
    capabilities: frozenset[str] = frozenset()
    execute_mode: str = "graph"

    def __post_init__(self) -> None:
        from graphmode.config import EXECUTE_MODES

        if self.execute_mode not in EXECUTE_MODES:
            raise ValueError(f"VendorInfo({self.name!r}) has execute_mode {self.execute_mode!r}; use one of {EXECUTE_MODES}")
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"VendorInfo({self.name!r}) has unknown capabilities {sorted(unknown)}; known: {sorted(CAPABILITIES)}")
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    def runs_on(self, device: torch.device) -> tuple[bool, str]:
        """Whether graphs of this vendor can run on ``device``, and why not."""
        device = torch.device(device)
        if device.type == "cpu":
            return True, "the CPU graph emulator"
        if device.type not in self.device_types:
            return False, (
                f"it runs on {', '.join(self.device_types)} (and the cpu emulator), "
                f"not {device.type}"
            )
        available, why = device_available(device)
        return (True, f"{device.type} graphs") if available else (False, why)


def device_available(device: torch.device) -> tuple[bool, str]:
    """Whether torch has a device of ``device``'s type here, and why not."""
    if device.type == "cpu":
        return True, "the cpu"
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        return False, f"no {device.type} device is available to torch here"
    return True, f"{device.type} devices"


def probe_runtime(module_name: str, device_type: str) -> tuple[str | None, bool, str]:
    """A vendor runtime's version, whether its device is usable, and why (not).

    Never raises: a runtime whose import fails (missing driver libraries) is
    reported, so that listing vendors works on any machine."""
    if importlib.util.find_spec(module_name) is None:
        return None, False, f"{module_name} is not installed"
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        return None, False, f"{module_name} failed to import: {error}".splitlines()[0]
    version = getattr(module, "__version__", "unknown")
    device_module = getattr(torch, device_type, None)
    if device_module is None or not device_module.is_available():
        return version, False, f"{module_name} is installed but no {device_type} device is visible"
    return version, True, f"{device_module.device_count()} {device_type} device(s)"

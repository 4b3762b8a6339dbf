"""graphmode: capture one LLM decode step per batch bucket as a device graph,
on any accelerator, through vendor plugins.

    import graphmode
    runner = graphmode.build_graph_runner(model, max_batches=256, max_blocks_per_seq=64, block_size=64)
    logits = runner(input_ids=..., position_ids=..., past_key_values=kv, attn_metadata=meta)

A vendor plugin imports ``graphmode.hookimpl`` and implements hooks from
``graphmode.hookspecs``.

The public names load on first use (PEP 562), and so do subpackages
(``graphmode.emulator``): ``import graphmode`` imports no torch. torch can fail
to import on a machine that is otherwise fine (it auto-loads installed device
backends such as torch_npu, which need their vendor's libraries), and the
``graphmode`` command must be able to start and say so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

import pluggy

hookimpl = pluggy.HookimplMarker("graphmode")


def _version() -> str:
    """The installed distribution's version; ``0+unknown`` when graphmode
    runs from a source tree that was never installed (PYTHONPATH)."""
    try:
        return importlib.metadata.version("graphmode")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

# Each public name and the module defining it.
_EXPORTS = {
    "RunnerConfig": "graphmode.config",
    "AttnMetadata": "graphmode.context",
    "StepInputs": "graphmode.context",
    "CaptureError": "graphmode.errors",
    "ConfigError": "graphmode.errors",
    "GraphModeError": "graphmode.errors",
    "InputError": "graphmode.errors",
    "ReplayError": "graphmode.errors",
    "VendorError": "graphmode.errors",
    "build_graph_runner": "graphmode.factory",
    "plan_graph_memory": "graphmode.factory",
    "DeviceGraph": "graphmode.graphs",
    "GraphMeta": "graphmode.meta",
    "Vendor": "graphmode.plugins",
    "VendorInfo": "graphmode.plugins",
    "load_vendor": "graphmode.plugins",
    "select_vendor": "graphmode.plugins",
    "GraphRunner": "graphmode.runner",
    "RunnerStats": "graphmode.runner",
}

if TYPE_CHECKING:
    from graphmode.config import RunnerConfig
    from graphmode.context import AttnMetadata, StepInputs
    from graphmode.errors import (
        CaptureError,
        ConfigError,
        GraphModeError,
        InputError,
        ReplayError,
        VendorError,
    )
    from graphmode.factory import build_graph_runner, plan_graph_memory
    from graphmode.graphs import DeviceGraph
    from graphmode.meta import GraphMeta
    from graphmode.plugins import Vendor, VendorInfo, load_vendor, select_vendor
    from graphmode.runner import GraphRunner, RunnerStats
else:

    def __getattr__(name: str) -> Any:
        """A public name or a subpackage, imported on first use and kept."""
        if name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(__all__)


__all__ = [
    "AttnMetadata",
    "CaptureError",
    "ConfigError",
    "DeviceGraph",
    "GraphMeta",
    "GraphModeError",
    "GraphRunner",
    "InputError",
    "ReplayError",
    "RunnerConfig",
    "RunnerStats",
    "StepInputs",
    "Vendor",
    "VendorError",
    "VendorInfo",
    "build_graph_runner",
    "hookimpl",
    "load_vendor",
    "plan_graph_memory",
    "select_vendor",
]

"""graphmode: capture one LLM decode step per batch bucket as a device graph,
on any accelerator, through vendor plugins.

    import graphmode
    runner = graphmode.build_graph_runner(model, max_batches=256, num_blocks=64, block_size=64)
    logits = runner(input_ids=..., position_ids=..., past_key_values=kv, attn_metadata=meta)

A vendor plugin imports ``graphmode.hookimpl`` and implements hooks from
``graphmode.hookspecs``.
"""

import pluggy

hookimpl = pluggy.HookimplMarker("graphmode")

from graphmode.config import RunnerConfig  # noqa: E402
from graphmode.context import AttnMetadata, StepInputs  # noqa: E402
from graphmode.errors import (  # noqa: E402
    CaptureError,
    ConfigError,
    GraphModeError,
    InputError,
    ReplayError,
    VendorError,
)
from graphmode.factory import build_graph_runner  # noqa: E402
from graphmode.graphs import DeviceGraph  # noqa: E402
from graphmode.meta import GraphMeta  # noqa: E402
from graphmode.plugins import Vendor, VendorInfo, load_vendor, select_vendor  # noqa: E402
from graphmode.runner import GraphRunner, RunnerStats  # noqa: E402

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
    "select_vendor",
]

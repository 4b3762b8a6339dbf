"""``compile=True``: the forward that warm-ups and captures run, compiled by
``torch.compile`` where its kernels can be captured, refused naming the
reason where they cannot; one for every family of the runner (piecewise
graphs run it split at the attention calls, ``graphmode.families.piecewise.compiled``).
Eager steps run the model uncompiled."""

from __future__ import annotations

from typing import Any

import torch

from graphmode.config import RunnerConfig
from graphmode.errors import ConfigError
from graphmode.families.piecewise.compiled import compiled_shapes
from graphmode.plugins import Vendor

__all__ = ["compiled_forward"]


def compiled_forward(model: Any, vendor: Vendor, config: RunnerConfig, capture_sizes: tuple[int, ...]) -> Any:
    """``torch.compile(model)`` for the graphs, where its kernels can be
    captured; refused, naming the reason, where they cannot."""
    name = vendor.name
    if "inductor_graphs" not in vendor.info.capabilities:
        raise ConfigError(
            f"compile=True: vendor {name!r} does not declare that Inductor's kernels run inside its "
            "graphs (VendorInfo capability 'inductor_graphs'); build the runner with compile=False "
            "(and compile the model with the vendor's own compiler, if it has one)"
        )
    if config.device.type == "cpu":
        # Seen with torch 2.13: under the emulator's capture modes the
        # compiled function runs its original Python, so the capture holds
        # the uncompiled aten operators; and Inductor's CPU kernels are
        # C++ calls the dispatcher (where the emulator records) never sees.
        raise ConfigError(
            "compile=True on the CPU graph emulator: the emulator records operators at PyTorch's "
            "dispatcher, where Inductor's kernels never pass (with its capture modes active, "
            "torch.compile runs the model's uncompiled code instead), so an emulated graph cannot "
            "hold compiled kernels. Use compile=True on a GPU, and compile=False on cpu"
        )
    options = config.torch_compile_options
    dynamo = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    limit = getattr(dynamo, limit_name)
    shapes = compiled_shapes(config, capture_sizes)  # full-graph and token buckets
    if options.get("dynamic") is False and shapes > limit:
        raise ConfigError(
            f"compile_options dynamic=False compiles each of the {shapes} buckets "
            f"anew, above torch._dynamo.config.{limit_name}={limit}: Dynamo would run the "
            f"buckets past the limit uncompiled. Raise the limit to >= {shapes}, "
            "pass fewer capture_batch_sizes (or capture_token_sizes), or leave dynamic=True"
        )
    return torch.compile(model, **options)

"""A runner's configuration checked against its vendor, once, before anything
is allocated: the declarations it runs on, the vendor's options, the
capture list. Everything that lists a vendor's buckets (the runner, the
``vendors`` command, the benchmark, the conformance header) goes through
here, so they all see what a runner would."""

from __future__ import annotations

import dataclasses

import torch

from graphmode.buckets import FixedSizes, largest_graph_declaration
from graphmode.config import RunnerConfig
from graphmode.errors import ConfigError, VendorError
from graphmode.plugins import Vendor
from graphmode.spec import GraphSpec

__all__ = ["capture_sizes", "configure", "default_capture_sizes"]


def configure(vendor: Vendor, config: RunnerConfig) -> GraphSpec:
    """The declarations a runner of ``vendor`` uses: the vendor's spec plus
    the engine's step inputs. Checks ``config`` against the vendor's
    constraints, replaces ``config.vendor_options`` by the vendor's checked
    options object, then runs its ``graphmode_check_config`` hooks."""
    spec = vendor.spec
    if spec.block_sizes is not None and config.block_size not in spec.block_sizes:
        raise ConfigError(
            f"block_size={config.block_size}: vendor {vendor.name!r} takes KV-cache blocks of "
            f"{' or '.join(map(str, spec.block_sizes))} tokens (GraphSpec.block_sizes); allocate the "
            f"KV cache with block_size={spec.block_sizes[0]}"
        )
    if spec.max_q_len is not None and config.max_q_len > spec.max_q_len:
        raise ConfigError(
            f"max_q_len={config.max_q_len}: vendor {vendor.name!r} graphs decode steps of at most "
            f"{spec.max_q_len} new token(s) per sequence (GraphSpec.max_q_len)"
            + (f": {spec.max_q_len_reason}" if spec.max_q_len_reason else "")
            + f". Build the runner with max_q_len <= {spec.max_q_len}; longer decode steps then run eagerly"
        )
    taken = [s.name for s in config.step_inputs if s.name in spec.names]
    if taken:
        raise ConfigError(
            f"step_inputs {taken}: vendor {vendor.name!r} already declares buffers of those names; "
            "name the engine's inputs after the model's keyword arguments"
        )
    fields = [s.name for s in config.step_inputs if not s.contexts[0].startswith("extras.")]
    if fields:
        raise ConfigError(
            f"step_inputs {fields} name fields of the step context, which the vendor's declarations "
            "cover; an engine declares its own model inputs (passed as extras)"
        )
    # An engine's step input is the model keyword of its name, copied in
    # whole every step: every family (piecewise too) keys it by that name.
    custom = [
        s.name for s in config.step_inputs
        if s.contexts != (f"extras.{s.name}",) or s.source != "default" or s.live is not None or s.host
    ]
    if custom:
        raise ConfigError(
            f"step_inputs {custom} set context, source, live or host: an engine's step input is the model "
            "keyword of its own name, copied in whole from that keyword every step, on the device. Declare "
            "BufferSpec(name, dtype, shape=..., padding=...) only (a vendor's buffers take the other fields)"
        )
    if not isinstance(config.vendor_options, spec.options):
        config.vendor_options = spec.make_options(config.vendor_options, vendor.name)
    asked = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "vendor_options"}
    vendor.hook.graphmode_check_config(config=config)
    changed = sorted(name for name, value in asked.items() if getattr(config, name) != value)
    if changed:  # the engine's settings are the engine's: a vendor refuses one, never rewrites it
        raise VendorError(
            f"vendor {vendor.name!r}: graphmode_check_config changed the runner's {', '.join(changed)} (now "
            f"{', '.join(f'{name}={getattr(config, name)!r}' for name in changed)}, asked "
            f"{', '.join(f'{name}={asked[name]!r}' for name in changed)}); a hook may replace vendor_options "
            "only. Raise ConfigError naming the value, the limit and the fix instead"
        )
    return spec.with_buffers(*config.step_inputs) if config.step_inputs else spec


def capture_sizes(vendor: Vendor, config: RunnerConfig, spec: GraphSpec) -> tuple[int, ...]:
    """The vendor's capture list for ``config``, checked: ascending, unique,
    within 1..max_batches, never adding to the user's list, and within the
    vendor's declared graphs (``max_capture_size``, ``FixedSizes``)."""
    sizes = vendor.hook.graphmode_capture_sizes(config=config, spec=spec)
    limit = config.max_batches
    fixed = spec.capture_policy.sizes if isinstance(spec.capture_policy, FixedSizes) else None
    problem = None
    if not sizes:
        problem = "is empty"
    elif list(sizes) != sorted(set(sizes)):
        problem = "is not ascending and unique"
    elif sizes[0] < 1 or sizes[-1] > limit:
        problem = f"leaves 1..max_batches={limit}"
    elif config.capture_batch_sizes is not None and not set(sizes) <= set(config.capture_batch_sizes):
        problem = f"adds sizes to the user's list {list(config.capture_batch_sizes)}"
    elif spec.max_capture_size is not None and sizes[-1] > spec.max_capture_size:
        declared = largest_graph_declaration(spec.capture_policy, spec.max_capture_size)
        problem = f"goes past the vendor's largest graph, {spec.max_capture_size} ({declared})"
    elif fixed is not None and not set(sizes) <= set(fixed):
        problem = f"has sizes {sorted(set(sizes) - set(fixed))} outside its fixed list {list(fixed)} (GraphSpec.capture_policy)"
    if problem:
        raise ConfigError(
            f"vendor {vendor.name!r}: graphmode_capture_sizes returned {list(sizes)}, which {problem}; fix the "
            "plugin's graphmode_capture_sizes (start from spec.capture_list(config.max_batches, "
            "config.capture_batch_sizes), which keeps to the declarations), or pass capture_batch_sizes explicitly"
        )
    return tuple(sizes)


def default_capture_sizes(vendor: Vendor, max_batches: int) -> tuple[int, ...]:
    """The capture list a runner of ``vendor`` takes at ``max_batches`` when
    the engine gives none (on the emulator, a block size the vendor accepts)."""
    block_size = (vendor.spec.block_sizes or (16,))[0]
    config = RunnerConfig(max_batches, 1, block_size, torch.device("cpu"))
    return capture_sizes(vendor, config, configure(vendor, config))

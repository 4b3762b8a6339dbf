"""Checks of a step's inputs against the runner's limits.

Only host-side facts are checked (shapes, dtypes, placement, host maxima):
reading device values would synchronise every step. Each error names the
value, the limit, and the fix.
"""

from __future__ import annotations

import torch

from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, StepInputs
from graphmode.emulator.host import is_host
from graphmode.errors import InputError

__all__ = ["check_inputs", "check_step"]

_INTEGER = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def check_step(inputs: StepInputs, config: RunnerConfig) -> int:
    """The step's batch size, after checking its inputs."""
    return check_inputs(inputs, config)[0]


def check_inputs(inputs: StepInputs, config: RunnerConfig) -> tuple[int, bool]:
    """The step's batch size and whether its per-step tensors are on the host,
    after checking its inputs.

    The per-step tensors (ids, positions, block table, lengths, slots) are
    either all on the runner's device or all host (CPU) tensors: an engine
    that builds its steps on the host passes them as they are (see host
    staging in docs/architecture.md). On the emulator (device "cpu"), host
    tensors are those marked as host memory (``graphmode.emulator.mark_host``).
    """
    attn = inputs.attn_metadata
    if not isinstance(attn, AttnMetadata):
        raise InputError(
            f"attn_metadata is a {type(attn).__name__}; pass a graphmode.AttnMetadata"
        )
    batch = attn.q_seqlens.shape[0]
    if batch == 0:
        raise InputError(
            "batch size 0: a step needs at least one sequence; do not call the "
            "runner when nothing is scheduled"
        )
    if batch > config.max_batches:
        raise InputError(
            f"batch size {batch} is above max_batches={config.max_batches}; build the "
            f"runner with max_batches >= {batch}, or schedule fewer sequences per step"
        )
    width = attn.block_offsets.shape[-1]
    if width > config.num_blocks:
        raise InputError(
            f"attn_metadata.block_offsets is {width} blocks wide, above "
            f"num_blocks={config.num_blocks}; build the runner with num_blocks >= {width}"
        )
    capacity = config.num_blocks * config.block_size
    if attn.max_kv_seq_len > capacity:
        raise InputError(
            f"max_kv_seq_len={attn.max_kv_seq_len} is above the {capacity} tokens a "
            f"block table can address (num_blocks={config.num_blocks} x "
            f"block_size={config.block_size}); raise num_blocks or shorten the sequence"
        )
    tokens = inputs.input_ids.shape[-1]
    device = config.device
    # is_cpu and get_device() (an int) are cheaper than building a device.
    emulated, index = device.type == "cpu", device.index
    first_side: tuple[str, bool] | None = None
    for name, tensor, shape in (
        ("input_ids", inputs.input_ids, (1, tokens)),
        ("position_ids", inputs.position_ids, (1, tokens)),
        ("attn_metadata.block_offsets", attn.block_offsets, (batch, width)),
        ("attn_metadata.q_start_loc", attn.q_start_loc, (batch,)),
        ("attn_metadata.q_seqlens", attn.q_seqlens, (batch,)),
        ("attn_metadata.kv_seqlens", attn.kv_seqlens, (batch,)),
        ("attn_metadata.kv_start_indices", attn.kv_start_indices, (tokens,)),
    ):
        if tensor.dtype not in _INTEGER:
            raise InputError(
                f"{name} has dtype {tensor.dtype}; it must be an integer tensor "
                "(int64 or int32): convert it with .long() or .int()"
            )
        if emulated:
            if not tensor.is_cpu:
                raise InputError(
                    f"{name} is on {tensor.device}, but the runner's device is {device}; "
                    "move it with .to('cpu')"
                )
            on_host = is_host(tensor)
        else:
            on_host = tensor.is_cpu
            if not on_host and tensor.get_device() != index:
                raise InputError(
                    f"{name} is on {tensor.device}, but the runner's device is {device}; "
                    f"move it with .to({str(device)!r}), or pass it as a host (CPU) tensor"
                )
        if first_side is None:
            first_side = (name, on_host)
        elif on_host != first_side[1]:
            where = {True: "the host", False: str(device)}
            raise InputError(
                f"{name} is on {where[on_host]} but {first_side[0]} is on {where[first_side[1]]}: "
                f"pass every per-step tensor on the host, or every one on {device}"
            )
        if tensor.shape != shape:
            raise InputError(
                f"{name} has shape {tuple(tensor.shape)}; a step of {batch} sequences "
                f"and {tokens} tokens needs {shape}"
            )
    host = attn.kv_seqlens_cpu
    if host is not None and (host.device.type != "cpu" or host.shape != (batch,)):
        raise InputError(
            f"attn_metadata.kv_seqlens_cpu has shape {tuple(host.shape)} on "
            f"{host.device}; it must be a ({batch},) host tensor or None"
        )
    return batch, bool(first_side and first_side[1])

"""Checks of a step's inputs against the runner's limits.

Only host-side facts are checked (shapes, dtypes, devices, host maxima):
reading device values would synchronise every step. Each error names the
value, the limit, and the fix.
"""

from __future__ import annotations

import torch

from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import InputError

__all__ = ["check_step"]

_INTEGER = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def check_step(inputs: StepInputs, config: RunnerConfig) -> int:
    """The step's batch size, after checking its inputs."""
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
    on_cpu, index = device.type == "cpu", device.index
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
        if (not tensor.is_cpu) if on_cpu else tensor.get_device() != index:
            raise InputError(
                f"{name} is on {tensor.device}, but the runner's device is {device}; "
                f"move it with .to({str(device)!r})"
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
    return batch

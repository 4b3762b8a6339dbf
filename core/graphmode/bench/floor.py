"""The HBM floor of a decode step: the fewest bytes a step must move through
device memory over the memory's bandwidth. No implementation runs a
memory-bound decode step faster; the bench prints each step time over it.

Bytes counted: every weight read once (of the embedding table, only the
rows of this step's tokens), every cached key and value of each sequence
read once, and this step's keys and values written once. Activations and
logits are left out (small next to the weights at the bench's sizes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from graphmode.context import StepInputs
from graphmode.model import LlamaModel

__all__ = ["Bandwidth", "bandwidth", "step_bytes"]

# Datasheet HBM bandwidth, bytes/s, by a substring of the device name.
NOMINAL = {"H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H200": 4.8e12}


@dataclass(frozen=True)
class Bandwidth:
    """The bandwidth the floor is taken at, and where it comes from."""

    bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bandwidth {self.bytes_per_s} B/s: must be positive")


def measured_copy(device: torch.device, size: int = 2**30, repeats: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and
    written (median of ``repeats`` copies of ``size`` bytes)."""
    source = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dest = torch.empty_like(source)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dest.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, dest
    return 2 * size / statistics.median(times[3:])


def bandwidth(device: torch.device, override_tbps: float | None = None) -> tuple[Bandwidth | None, float | None]:
    """The bandwidth for the floor (an override in TB/s, else the datasheet
    figure for a known device, else a measured copy; None off CUDA without
    an override) and the measured copy (None off CUDA)."""
    measured = measured_copy(device) if device.type == "cuda" else None
    if override_tbps is not None:
        return Bandwidth(override_tbps * 1e12, "--hbm-tbps"), measured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    for key, value in NOMINAL.items():
        if key in name:
            return Bandwidth(value, f"datasheet ({key})"), measured
    if measured is None:
        return None, None
    return Bandwidth(measured, "measured device-to-device copy"), measured


def step_bytes(model: LlamaModel, step: StepInputs) -> int:
    """Bytes one decode step must move (see the module docstring)."""
    batch = step.attn_metadata.batch_size
    weights = 0
    for name, param in model.named_parameters():
        if "embed_tokens" in name:
            weights += batch * param.shape[1] * param.element_size()
        else:
            weights += param.numel() * param.element_size()
    config = model.config
    cache = step.past_key_values[0][0]
    per_token = 2 * len(step.past_key_values) * (config.num_key_value_heads // model.tp_size) \
        * config.head_dim * cache.element_size()
    lengths = step.attn_metadata.kv_seqlens_cpu
    if lengths is None:
        lengths = step.attn_metadata.kv_seqlens.cpu()
    return weights + per_token * (int(lengths.clamp(min=0).sum()) + batch)

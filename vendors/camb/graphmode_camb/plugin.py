"""Cambricon MLU: ``torch.mlu.MLUGraph`` captured in relaxed mode (torch_mlu's
default), MLU buffers and the -1 maxima its kernels need in graphs.

Differences from the CUDA default:
- ``kv_start_indices`` is (max_batches,) int32, -1 for padding;
- ``max_q_seq_len`` and ``max_kv_seq_len`` are -1 in graph contexts (the
  kernel derives the maxima from the length tensors);
- KV cache [num_blocks, kv_heads, block_size, head_dim], block size 16.
On a CUDA device the same contract runs on CUDA graphs with the reference
kernels, which is how it is validated without an MLU. Padding is reset every
step (upstream Camb left stale rows from an earlier, larger batch).
"""

from __future__ import annotations

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.config import RunnerConfig
from graphmode.context import StepInputs
from graphmode.graphs import DeviceGraph, TorchGraph
from graphmode.meta import GraphMeta
from graphmode.plugins import probe_runtime
from graphmode_camb.ops import CambAttentionOps

BLOCK_SIZE = 16


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    version, detected, reason = probe_runtime("torch_mlu", "mlu")
    return VendorInfo(
        name="camb",
        device_types=("mlu", "cuda"),
        runtime="torch_mlu",
        runtime_version=version,
        detected=detected,
        reason=reason,
        capabilities=frozenset({"positive_max_len_limits"}),
    )


@hookimpl
def graphmode_check_config(config: RunnerConfig) -> None:
    if config.block_size != BLOCK_SIZE:
        raise ConfigError(
            f"block_size={config.block_size}: Cambricon's paged attention kernel takes "
            f"blocks of {BLOCK_SIZE} tokens; allocate the KV cache with block_size={BLOCK_SIZE}"
        )


@hookimpl(wrapper=True)
def graphmode_make_buffers(meta: GraphMeta):
    buffers = yield
    buffers["kv_start_indices"] = torch.full((meta.max_batchs,), -1, dtype=torch.int32, device=meta.device)
    return buffers


@hookimpl(wrapper=True)
def graphmode_update_context(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int):
    static = yield
    static.attn_metadata.max_q_seq_len = -1
    static.attn_metadata.max_kv_seq_len = -1
    return static


@hookimpl
def graphmode_make_graph(meta: GraphMeta) -> DeviceGraph | None:
    if meta.device.type == "mlu":
        return TorchGraph(meta.device, capture_error_mode="relaxed")
    return None


@hookimpl
def graphmode_attention_ops() -> CambAttentionOps:
    return CambAttentionOps()


@hookimpl
def graphmode_dist_backend(device: torch.device) -> str | None:
    return "cncl" if torch.device(device).type == "mlu" else None

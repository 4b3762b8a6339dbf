"""The built-in CUDA plugin: graphmode's default answer to every hook.

It implements the generic behaviour of a CUDA-style stack (lmdeploy's
reference), registered like any other plugin. Vendor plugins register after
it and override only what differs. Buffers, at maximum size:

    input_ids, position_ids   (1, max_tokens) int64    padding 0
    block_offsets             (max_batchs, num_blocks) int32, padding 0: the
                              reserved block, which no sequence owns
    q_start_loc               (max_batchs,) int32      arange, never changes
    q_seqlens                 (max_batchs,) int32      1 (decode), never changes
    kv_seqlens                (max_batchs,) int32      padding 1: one harmless
                              read of the reserved block
    kv_start_indices          (max_tokens,) int64      padding -1: no KV write
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from graphmode import hookimpl
from graphmode.buckets import graded_sizes, smallest_bucket
from graphmode.buffers import ROW_BUFFERS, TOKEN_BUFFERS, decode_rows, padding_rows, stage
from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, StepInputs
from graphmode.graphs import DeviceGraph, make_device_graph
from graphmode.meta import GraphMeta
from graphmode.plugins.info import VendorInfo


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    available = torch.cuda.is_available()
    if available:
        reason = f"{torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name(0)}"
    elif torch.version.cuda is None:
        reason = "this torch build has no CUDA support"
    else:
        reason = "no CUDA device is visible"
    return VendorInfo(
        name="cuda",
        device_types=("cuda",),
        runtime="torch CUDA",
        runtime_version=torch.version.cuda,
        detected=available,
        reason=reason,
        capabilities=frozenset({"inductor_graphs"}),
    )


@hookimpl
def graphmode_capture_sizes(config: RunnerConfig) -> list[int]:
    if config.capture_batch_sizes is not None:
        return list(config.capture_batch_sizes)
    return graded_sizes(config.max_batches)


@hookimpl
def graphmode_compatible_size(batch_size: int, capture_sizes: tuple[int, ...]) -> int | None:
    return smallest_bucket(batch_size, capture_sizes)


@hookimpl
def graphmode_make_buffers(meta: GraphMeta) -> dict[str, torch.Tensor]:
    rows, tokens, device = meta.max_batchs, meta.max_tokens, meta.device
    return {
        "input_ids": torch.zeros((1, tokens), dtype=torch.int64, device=device),
        "position_ids": torch.zeros((1, tokens), dtype=torch.int64, device=device),
        "block_offsets": torch.zeros((rows, meta.num_blocks), dtype=torch.int32, device=device),
        "q_start_loc": torch.arange(rows, dtype=torch.int32, device=device),
        "q_seqlens": torch.ones(rows, dtype=torch.int32, device=device),
        "kv_seqlens": torch.ones(rows, dtype=torch.int32, device=device),
        "kv_start_indices": torch.full((tokens,), -1, dtype=torch.int64, device=device),
    }


@hookimpl
def graphmode_fill_buffers(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int) -> bool:
    stage(
        decode_rows(meta, inputs, batch_size)
        + padding_rows(meta, TOKEN_BUFFERS, batch_size, bucket, dim=1)
        + padding_rows(meta, ROW_BUFFERS, batch_size, bucket)
    )
    return True


@hookimpl
def graphmode_update_context(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int) -> StepInputs:
    buffers = meta.input_buffers
    attn = AttnMetadata(
        is_decoding=True,
        block_offsets=buffers["block_offsets"][:bucket],
        q_start_loc=buffers["q_start_loc"][:bucket],
        q_seqlens=buffers["q_seqlens"][:bucket],
        kv_seqlens=buffers["kv_seqlens"][:bucket],
        kv_start_indices=buffers["kv_start_indices"][:bucket],
        max_q_seq_len=1,
        max_kv_seq_len=-1,
    )
    return StepInputs(
        input_ids=buffers["input_ids"][:, :bucket],
        position_ids=buffers["position_ids"][:, :bucket],
        past_key_values=inputs.past_key_values,
        attn_metadata=attn,
        extras=inputs.extras,
    )


@hookimpl
def graphmode_get_outputs(meta: GraphMeta, batch_size: int, num_tokens: int) -> Any:
    output = meta.output_buffers["output"]
    if isinstance(output, torch.Tensor):
        return output[:, :num_tokens]
    return tree_map(lambda t: t[:, :num_tokens] if isinstance(t, torch.Tensor) else t, output)


@hookimpl
def graphmode_make_graph(meta: GraphMeta) -> DeviceGraph:
    return make_device_graph(meta.device)


@hookimpl
def graphmode_attention_ops() -> Any:
    # Triton's paged decode kernel when Triton imports and a CUDA device is
    # visible; $GRAPHMODE_ATTENTION=reference forces the PyTorch kernels.
    from graphmode.kernels import cuda_attention_ops

    return cuda_attention_ops()


@hookimpl
def graphmode_dist_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "cpu": "gloo"}.get(torch.device(device).type, "gloo")

"""Cambricon MLU: ``torch.mlu.MLUGraph`` captured in relaxed mode (torch_mlu's
default), MLU buffers and the -1 maxima its kernels need in graphs.

Its declarations differ from the CUDA default in:
- ``kv_start_indices``: one int32 slot per token, -1 for padding: (max_batches,)
  as dlinfer's, since decode graphs take one token per sequence;
- ``max_q_len`` 1: the MLU decode kernel takes one query per sequence;
- ``max_q_seq_len`` and ``max_kv_seq_len`` are -1 in graph contexts (the
  kernel derives the maxima from the length tensors);
- block size 16 only; the KV cache (its ops' layout) is
  [num_blocks, kv_heads, block_size, head_dim].
On a CUDA device the same contract runs on CUDA graphs with the reference
kernels, which is how it is validated without an MLU. Padding is reset every
step (upstream Camb left stale rows from an earlier, larger batch).
"""

from __future__ import annotations

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.graphs import DeviceGraph, TorchGraph
from graphmode.meta import GraphMeta
from graphmode.plugins import probe_runtime
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec, GraphSpec
from graphmode_camb.ops import CambAttentionOps

BLOCK_SIZE = 16

CAMB_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_start_indices", torch.int32, shape=(TOKENS,), padding=-1),
).replace(
    block_sizes=(BLOCK_SIZE,),
    max_q_policy="dynamic",
    max_kv_policy="dynamic",
    # torch_mlu_ops' decode kernel takes one query per sequence; verify and
    # MTP steps run eagerly (a runner asking for more is refused at start-up).
    max_q_len=1,
    max_q_len_reason=(
        "the MLU decode kernel, torch_mlu_ops' single_query_cached_kv_attn, takes one query per sequence"
    ),
)


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
def graphmode_graph_spec() -> GraphSpec:
    return CAMB_SPEC


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

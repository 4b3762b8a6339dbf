"""The built-in CUDA plugin: graphmode's default answer to every hook.

It implements the generic behaviour of a CUDA-style stack (lmdeploy's
reference), registered like any other plugin. Vendor plugins register after
it and override only what differs. Its buffer hooks work from the declared
:class:`graphmode.spec.GraphSpec` (``meta.spec``): a vendor whose buffers
differ declares them (``graphmode_graph_spec``) and keeps these hooks. The
CUDA declarations are :data:`graphmode.spec.CUDA_VENDOR_SPEC`: the base
:data:`graphmode.spec.CUDA_SPEC` with multi-token decode graphs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from graphmode import buffers, hookimpl
from graphmode.buckets import smallest_bucket
from graphmode.config import RunnerConfig
from graphmode.context import StepInputs
from graphmode.graphs import DeviceGraph, make_device_graph
from graphmode.meta import GraphMeta
from graphmode.spec import CUDA_VENDOR_SPEC, GraphSpec
from graphmode.vendor_info import VendorInfo


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
def graphmode_graph_spec() -> GraphSpec:
    return CUDA_VENDOR_SPEC


@hookimpl
def graphmode_capture_sizes(config: RunnerConfig, spec: GraphSpec) -> list[int]:
    return spec.capture_list(config.max_batches, config.capture_batch_sizes)


@hookimpl
def graphmode_compatible_size(batch_size: int, capture_sizes: tuple[int, ...]) -> int | None:
    return smallest_bucket(batch_size, capture_sizes)


@hookimpl
def graphmode_make_buffers(meta: GraphMeta) -> dict[str, torch.Tensor]:
    return buffers.allocate(meta)


@hookimpl
def graphmode_fill_buffers(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int) -> bool:
    buffers.fill(meta, inputs, batch_size, bucket)
    return True


@hookimpl
def graphmode_update_context(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int) -> StepInputs:
    return buffers.graph_context(meta, inputs, batch_size, bucket)


@hookimpl
def graphmode_get_outputs(meta: GraphMeta, batch_size: int, num_tokens: int) -> Any:
    output = meta.output_buffers["output"]
    if isinstance(output, torch.Tensor) and output.dim() >= 2:
        return output[:, :num_tokens]
    # Tensors of two or more dimensions are cut to the live tokens; scalars and other 1-D ones come back whole.
    return tree_map(lambda t: t[:, :num_tokens] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t, output)


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
    # torch.distributed's own backend for the device type (what
    # init_process_group picks when given none: xccl on xpu, and what
    # runtimes such as torch_npu register), gloo where it names none.
    import torch.distributed

    known = getattr(torch.distributed.Backend, "default_device_backend_map", {})
    return {"cuda": "nccl", "cpu": "gloo", **known}.get(torch.device(device).type, "gloo")

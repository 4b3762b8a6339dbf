"""Huawei Ascend: NPU graphs, three-stage buckets, host kv lengths pushed into
the captured graph before every replay.

Buffers (at maximum size), as the Ascend kernels take them:

    input_ids, position_ids   (1, max_tokens) int32                 padding 0
    block_offsets             (max_batchs, num_blocks) int32        padding 0
    q_start_loc               (max_batchs,) int32, device arange
    q_seqlens                 (max_batchs,) int32, host, cumulative (1, 2, ...)
    kv_seqlens                (max_batchs,) int32, host             padding 1
    kv_start_indices          (max_tokens,) int32                   padding -1
    x_active_mask             (max_tokens,) bool                    padding False

Every padding region is reset every step. Vendor options (``vendor_options``
of ``build_graph_runner``): ``update_path`` ("auto", "graph_update",
"task_group"). Every capture size asked for is captured (no stream-budget
trimming, as vllm-ascend since PR 9962); running out of streams at capture
becomes advice.
"""

from __future__ import annotations

import os
import weakref

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.buckets import three_stage_sizes
from graphmode.buffers import ROW_BUFFERS, TOKEN_BUFFERS, decode_rows, host_zeros, padding_rows, stage
from graphmode.config import RunnerConfig
from graphmode.context import StepInputs
from graphmode.meta import GraphMeta
from graphmode.plugins import probe_runtime
from graphmode_ascend.advice import capture_advice
from graphmode_ascend.graph import AscendGraph, resolve_update_path
from graphmode_ascend.ops import AscendAttentionOps

OPTIONS = {"update_path": "auto"}
# Options of earlier releases, which fed the stream-budget trimming.
REMOVED_OPTIONS = ("stream_budget", "comm_groups")
# Kept in vendor_options by the plugin itself, for its capture advice.
DERIVED = "capture_sizes"


def torch_npu_version() -> tuple[str | None, bool, str]:
    """torch_npu's version, whether an NPU is usable, and why (not)."""
    return probe_runtime("torch_npu", "npu")


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    version, detected, reason = torch_npu_version()
    return VendorInfo(
        name="ascend",
        device_types=("npu",),
        runtime="torch_npu",
        runtime_version=version,
        detected=detected,
        reason=reason,
        capabilities=frozenset({"host_kv_lengths", "x_active_mask"}),
    )


@hookimpl
def graphmode_check_config(config: RunnerConfig) -> None:
    if config.execute_mode == "graph" and os.environ.get("ASCEND_LAUNCH_BLOCKING") == "1":
        raise ConfigError(
            "ASCEND_LAUNCH_BLOCKING=1 makes every NPU launch synchronous, which graph capture "
            "cannot record; unset it, or run with execute_mode='eager' to debug launches"
        )
    for name in REMOVED_OPTIONS:
        if name in config.vendor_options:
            raise ConfigError(
                f"Ascend vendor_options {name!r} was removed: graphmode no longer trims the capture sizes to a "
                "stream budget (vllm-ascend removed that heuristic in PR 9962); it captures the sizes asked for "
                "and explains a stream shortage when one occurs. Drop the option; pass capture_batch_sizes to "
                "capture fewer graphs"
            )
    sizes = _sizes(config)
    if config.vendor_options.get(DERIVED, sizes) != sizes:
        raise ConfigError(
            f"Ascend vendor_options {DERIVED!r} is graphmode's own record of the capture sizes; "
            "pass capture_batch_sizes to choose them"
        )
    unknown = set(config.vendor_options) - set(OPTIONS) - {DERIVED}
    if unknown:
        raise ConfigError(
            f"unknown Ascend vendor_options {sorted(unknown)}; the options are {sorted(OPTIONS)}"
        )
    options = {**OPTIONS, **config.vendor_options}
    options["update_path"] = resolve_update_path(options["update_path"], torch_npu_version()[0])
    options[DERIVED] = sizes
    config.vendor_options.update(options)


def _sizes(config: RunnerConfig) -> list[int]:
    """The user's capture sizes, else the three-stage list: all of them."""
    return list(config.capture_batch_sizes or three_stage_sizes(config.max_batches))


@hookimpl
def graphmode_capture_sizes(config: RunnerConfig) -> list[int]:
    return _sizes(config)


@hookimpl
def graphmode_make_buffers(meta: GraphMeta) -> dict[str, torch.Tensor]:
    rows, tokens, device, int32 = meta.max_batchs, meta.max_tokens, meta.device, torch.int32
    q_seqlens = host_zeros(meta, (rows,), int32)
    q_seqlens.copy_(torch.arange(1, rows + 1, dtype=int32))
    kv_seqlens = host_zeros(meta, (rows,), int32)
    kv_seqlens.fill_(1)
    return {
        "input_ids": torch.zeros((1, tokens), dtype=int32, device=device),
        "position_ids": torch.zeros((1, tokens), dtype=int32, device=device),
        "block_offsets": torch.zeros((rows, meta.num_blocks), dtype=int32, device=device),
        "q_start_loc": torch.arange(rows, dtype=int32, device=device),
        "q_seqlens": q_seqlens,
        "kv_seqlens": kv_seqlens,
        "kv_start_indices": torch.full((tokens,), -1, dtype=int32, device=device),
        "x_active_mask": torch.zeros(tokens, dtype=torch.bool, device=device),
    }


@hookimpl
def graphmode_fill_buffers(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int) -> bool:
    attn = inputs.attn_metadata
    # Engines know the lengths on the host; without that copy, reading them
    # back from the device costs a synchronisation every step.
    host_lengths = attn.kv_seqlens_cpu if attn.kv_seqlens_cpu is not None else attn.kv_seqlens
    stage(
        decode_rows(meta, inputs, batch_size, kv_seqlens=host_lengths)
        + padding_rows(meta, TOKEN_BUFFERS, batch_size, bucket, dim=1)
        + padding_rows(meta, (*ROW_BUFFERS, "x_active_mask"), batch_size, bucket)
    )
    meta.input_buffers["x_active_mask"][:batch_size].fill_(True)
    return True


@hookimpl(wrapper=True)
def graphmode_update_context(meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int):
    static = yield
    buffers = meta.input_buffers
    static.attn_metadata = static.attn_metadata.replace(
        q_seqlens=buffers["q_seqlens"][:bucket],
        kv_seqlens_cpu=buffers["kv_seqlens"][:bucket],
        x_active_mask=buffers["x_active_mask"][:bucket],
    )
    return static


@hookimpl
def graphmode_make_graph(meta: GraphMeta) -> AscendGraph | None:
    if meta.device.type not in ("npu", "cpu"):
        return None
    # The graphs captured and alive, for the advice on stream exhaustion; in
    # vendor_flags, which every graph's GraphMeta shares.
    captured = meta.vendor_flags.setdefault("captured_graphs", weakref.WeakSet())
    return AscendGraph(meta.device, meta.vendor_flags["update_path"], captured)


@hookimpl
def graphmode_update_graph_params(graph: AscendGraph, meta: GraphMeta, batch_size: int, bucket: int) -> None:
    graph.push_kv_lengths(meta.input_buffers["kv_seqlens"][:bucket].tolist())


@hookimpl
def graphmode_capture_error(error: BaseException, meta: GraphMeta, bucket: int):
    flags = meta.vendor_flags
    return capture_advice(error, bucket, len(flags["captured_graphs"]), flags[DERIVED])


@hookimpl
def graphmode_attention_ops() -> AscendAttentionOps:
    return AscendAttentionOps()


@hookimpl
def graphmode_dist_backend(device: torch.device) -> str | None:
    return "hccl" if torch.device(device).type == "npu" else None

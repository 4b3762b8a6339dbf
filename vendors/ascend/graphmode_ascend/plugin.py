"""Huawei Ascend: NPU graphs, three-stage buckets, host kv lengths pushed into
the captured graph before every replay.

Buffers (declared in ``ASCEND_SPEC``; at maximum size), as the Ascend
kernels take them:

    input_ids, position_ids   (1, max_tokens) int32                 padding 0
    block_offsets             (max_batchs, num_blocks) int32        padding 0
    q_start_loc               (max_batchs,) int32, device, 0, 1, 2, ... (constant;
                              x q_len in a graph of q_len tokens per sequence)
    q_seqlens                 (max_batchs,) int32, host, cumulative 1, 2, 3, ...
                              (constant; x q_len, as dlinfer's multi-token buffers)
    kv_seqlens                (max_batchs,) int32, host             padding 1
                              (also the context's kv_seqlens_cpu)
    kv_start_indices          (max_tokens,) int32                   padding -1
    x_active_mask             (max_tokens,) bool, True for live rows, padding False

The core fills them and resets every padding row every step. Options
(``vendor_options`` of ``build_graph_runner``, :class:`AscendOptions`):
``update_path`` ("auto", "graph_update", "task_group"). Decode graphs of
several tokens per sequence (``max_q_len > 1``) need the "graph_update"
path, as upstream dlinfer allows them only there. Every capture size
asked for is captured (no stream-budget trimming, as vllm-ascend since PR
9962); running out of streams at capture becomes advice.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.buckets import three_stage_sizes
from graphmode.config import RunnerConfig
from graphmode.meta import GraphMeta
from graphmode.plugins import probe_runtime
from graphmode.spec import BLOCKS, ROW_INDEX, ROW_NUMBER, SEQUENCES, TOKENS, BufferSpec, GraphSpec
from graphmode_ascend.advice import capture_advice
from graphmode_ascend.graph import UPDATE_PATHS, AscendGraph, resolve_update_path
from graphmode_ascend.ops import AscendAttentionOps, tnd_limit_violations


@dataclass(frozen=True)
class AscendOptions:
    """update_path: how kv lengths reach a captured graph: "graph_update"
    (torch_npu 2.8.0.post1, 2.7.1.post1, 2.6.0.post3 or later in its line),
    "task_group", or "auto" (by the installed
    torch_npu; ``$GRAPHMODE_ASCEND_UPDATE_PATH`` overrides). The runner holds
    the resolved path."""

    update_path: str = "auto"

    def __post_init__(self) -> None:
        if self.update_path not in UPDATE_PATHS:
            raise ConfigError(
                f"Ascend update_path={self.update_path!r} is not one of {', '.join(UPDATE_PATHS)}; set "
                "vendor_options={'update_path': ...} to one of them"
            )


# Lengths are host values for FIA (the engine's host copy when it passes one,
# else the device lengths); q_seqlens is FIA's cumulative actual_seq_lengths.
ASCEND_SPEC = GraphSpec(
    buffers=(
        BufferSpec("input_ids", torch.int32, shape=(1, TOKENS)),
        BufferSpec("position_ids", torch.int32, shape=(1, TOKENS)),
        BufferSpec("block_offsets", torch.int32, shape=(SEQUENCES, BLOCKS)),
        BufferSpec("q_start_loc", torch.int32, padding=ROW_INDEX, source=None, q_len_scaled=True),
        BufferSpec("q_seqlens", torch.int32, padding=ROW_NUMBER, source=None, host=True, q_len_scaled=True),
        BufferSpec(
            "kv_seqlens", torch.int32, padding=1, host=True,
            source=("attn_metadata.kv_seqlens_cpu", "attn_metadata.kv_seqlens"),
            context=("attn_metadata.kv_seqlens", "attn_metadata.kv_seqlens_cpu"),
        ),
        BufferSpec("kv_start_indices", torch.int32, shape=(TOKENS,), padding=-1),
        BufferSpec("x_active_mask", torch.bool, shape=(TOKENS,), padding=False, live=True),
    ),
    capture_policy=three_stage_sizes,
    max_q_len=None,  # FIA in TND layout on the graph_update path; check_config refuses task_group
    options=AscendOptions,
    # Both paths run in the field (torch_npu before and since the .default fix):
    # the conformance suite runs every test under each.
    option_variants=({"update_path": "graph_update"}, {"update_path": "task_group"}),
)


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
def graphmode_graph_spec() -> GraphSpec:
    return ASCEND_SPEC


@hookimpl
def graphmode_check_config(config: RunnerConfig) -> None:
    if config.execute_mode != "eager" and os.environ.get("ASCEND_LAUNCH_BLOCKING") == "1":  # every graph mode
        raise ConfigError(
            "ASCEND_LAUNCH_BLOCKING=1 makes every NPU launch synchronous, which graph capture "
            "cannot record; unset it, or run with execute_mode='eager' to debug launches"
        )
    options = config.vendor_options
    path = resolve_update_path(options.update_path, torch_npu_version()[0])
    if config.max_q_len > 1 and path != "graph_update":
        raise ConfigError(
            f"max_q_len={config.max_q_len} with Ascend update_path={path!r}: decode graphs of several tokens "
            "per sequence run only on the 'graph_update' path (torch_npu 2.8.0.post1, 2.7.1.post1, 2.6.0.post3 or "
            "later in its line), as upstream dlinfer "
            "allows them (its task-group path re-issues a one-query-per-sequence kernel). Set "
            "vendor_options={'update_path': 'graph_update'} with such a torch_npu, or build the "
            "runner with max_q_len=1 (longer decode steps then run eagerly)"
        )
    if config.max_q_len > 1:
        # The emulator's FIA stand-in takes any head size (the tiny CPU models
        # have 16); the other limits hold everywhere.
        head_dim = config.head_dim if config.device.type == "npu" else None
        problems = tnd_limit_violations(
            max_q_len=config.max_q_len, block_size=config.block_size, max_batches=config.max_batches,
            head_dim=head_dim,
        )
        if problems:
            raise ConfigError(
                f"max_q_len={config.max_q_len} with Ascend: decode graphs of several tokens per sequence call "
                f"FIA in TND layout, whose limits this runner exceeds: {'; '.join(problems)}"
            )
    config.vendor_options = dataclasses.replace(options, update_path=path)


@hookimpl
def graphmode_make_graph(meta: GraphMeta) -> AscendGraph | None:
    if meta.device.type not in ("npu", "cpu"):
        return None
    # The graphs captured and alive, for the advice on stream exhaustion; in
    # vendor_state, which every graph's GraphMeta shares.
    captured = meta.vendor_state.setdefault("captured_graphs", weakref.WeakSet())
    graph = AscendGraph(meta.device, meta.vendor_options.update_path, captured)
    graph.piece = meta.family == "piecewise"  # a piece of a piecewise graph
    return graph


@hookimpl
def graphmode_update_graph_params(graph: AscendGraph, meta: GraphMeta, batch_size: int, bucket: int) -> None:
    graph.push_kv_lengths(meta.input_buffers["kv_seqlens"][:bucket].tolist())


@hookimpl
def graphmode_capture_error(error: BaseException, meta: GraphMeta, bucket: int):
    captured = list(meta.vendor_state.get("captured_graphs", ()))
    # Piecewise graphs come with family "piecewise" and their token sizes.
    pieces = None if meta.family != "piecewise" else sum(graph.piece for graph in captured)
    return capture_advice(error, bucket, len(captured), list(meta.capture_sizes), pieces)


@hookimpl
def graphmode_attention_ops() -> AscendAttentionOps:
    return AscendAttentionOps()


@hookimpl
def graphmode_dist_backend(device: torch.device) -> str | None:
    return "hccl" if torch.device(device).type == "npu" else None

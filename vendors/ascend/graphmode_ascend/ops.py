"""Ascend's attention contract: fused infer attention with host kv lengths.

On an NPU the decode step calls ``torch_npu.npu_fused_infer_attention_score``
(FIA). Elsewhere a pure-PyTorch custom operator with the same contract stands
in for it: query in BSH layout, a paged cache of [num_blocks, block_size,
kv_heads * head_dim], and ``actual_seq_lengths_kv`` as a host list. The
emulator freezes that list at capture, exactly like an NPU graph, unless the
graph's parameters are updated before the replay; so a missing update gives
wrong output on the CPU too.
"""

from __future__ import annotations

import torch

from graphmode.context import AttnMetadata
from graphmode.model.ops import ReferenceAttentionOps, attend, owned_positions
from graphmode_ascend.emulated_npu import register_updatable

__all__ = ["AscendAttentionOps", "fused_infer_attention_score", "fused_infer_attention_score_out"]


def _reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, block_size):
    batch = query.shape[0]
    head_dim = query.shape[-1] // num_heads
    lengths = torch.tensor(actual_seq_lengths_kv, dtype=torch.long, device=query.device)
    blocks = block_table.long()
    keys = key.view(key.shape[0], block_size, num_key_value_heads, head_dim)[blocks].flatten(1, 2)
    values = value.view(value.shape[0], block_size, num_key_value_heads, head_dim)[blocks].flatten(1, 2)
    visible = torch.arange(keys.shape[1], device=query.device)[None, :] < lengths[:, None]
    visible &= owned_positions(blocks, keys.shape[1])  # the reserved block is never read
    out = attend(query.view(batch, num_heads, head_dim), keys, values, visible, scale)
    return out.reshape(batch, 1, num_heads * head_dim)


# The schemas are written out (as torch 2.13 infers them): torch 2.5 infers
# none from ``list[int]``.
_FIA_ARGS = (
    "Tensor query, Tensor key, Tensor value, Tensor block_table, SymInt[] actual_seq_lengths_kv, "
    "SymInt num_heads, SymInt num_key_value_heads, float scale, SymInt block_size"
)


@torch.library.custom_op(
    "graphmode_ascend::fused_infer_attention_score", mutates_args=(), schema=f"({_FIA_ARGS}) -> Tensor"
)
def fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
    actual_seq_lengths_kv: list[int], num_heads: int, num_key_value_heads: int, scale: float, block_size: int,
) -> torch.Tensor:
    """FIA's decode contract in PyTorch: query (B, 1, H*D), key/value caches
    (num_blocks, block_size, K*D), kv lengths as host values."""
    return _reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, block_size)


@torch.library.custom_op(
    "graphmode_ascend::fused_infer_attention_score_out", mutates_args=("out",), schema=f"({_FIA_ARGS}, Tensor(a!) out) -> ()"
)
def fused_infer_attention_score_out(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
    actual_seq_lengths_kv: list[int], num_heads: int, num_key_value_heads: int, scale: float, block_size: int,
    out: torch.Tensor,
) -> None:
    """The same, writing into ``out``: the form an ACL task update re-issues."""
    out.copy_(_reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, block_size))


@torch.library.custom_op(
    "graphmode_ascend::fused_infer_attention_score_v2", mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor block_table, SymInt[] actual_seq_kvlen, "
    "SymInt num_query_heads, SymInt num_key_value_heads, float softmax_scale, SymInt block_size) -> Tensor",
)
def fused_infer_attention_score_v2(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
    actual_seq_kvlen: list[int], num_query_heads: int, num_key_value_heads: int, softmax_scale: float,
    block_size: int,
) -> torch.Tensor:
    """Stands for ``npu_fused_infer_attention_score_v2``, whose kv lengths are
    named ``actual_seq_kvlen`` (op-plugin's op_plugin_functions.yaml)."""
    return _reference(query, key, value, block_table, actual_seq_kvlen, num_query_heads, num_key_value_heads,
                      softmax_scale, block_size)


@torch.library.custom_op("graphmode_ascend::paged_attention", mutates_args=("out",))
def paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, num_heads: int,
    scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
) -> None:
    """Stands for ``torch_npu._npu_paged_attention`` (op-plugin's
    ops/atb/PagedAttentionAtb.cpp): query (T, heads, D), kv lengths as a host
    tensor ``context_lens``, result written into ``out``."""
    bsh = query.reshape(query.shape[0], 1, -1)
    result = _reference(bsh, key_cache, value_cache, block_table, context_lens.tolist(), num_heads, num_kv_heads,
                        scale_value, key_cache.shape[1])
    out.copy_(result.view_as(out))


# On the emulator, graphs captured with auto_dispatch_capture can update this
# operator's host arguments, as torch_npu's NPUGraph.update does for FIA. The
# other stand-ins are not registered: the emulated torch_npu leaves them alone.
register_updatable(torch.ops.graphmode_ascend.fused_infer_attention_score)


class AscendAttentionOps(ReferenceAttentionOps):
    layout = "[num_blocks, block_size, kv_heads * head_dim]"
    contract = "ascend"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_kv_heads * head_dim)

    def block_view(self, cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        return cache.view(cache.shape[0], cache.shape[1], -1, head_dim)

    def paged_decode_attention(self, query, k_cache, v_cache, attn: AttnMetadata, scale):
        batch, heads, head_dim = query.shape
        host = attn.kv_seqlens_cpu if attn.kv_seqlens_cpu is not None else attn.kv_seqlens
        lengths = host.tolist()  # host values: frozen by a graph until updated
        kv_heads = k_cache.shape[-1] // head_dim
        block_size = k_cache.shape[1]
        bsh = query.reshape(batch, 1, heads * head_dim)
        if query.device.type == "npu":
            import torch_npu

            out, _ = torch_npu.npu_fused_infer_attention_score(
                bsh, k_cache, v_cache, actual_seq_lengths_kv=lengths, block_table=attn.block_offsets,
                num_heads=heads, num_key_value_heads=kv_heads, input_layout="BSH", scale=scale,
                block_size=block_size,
            )
        else:
            out = torch.ops.graphmode_ascend.fused_infer_attention_score(
                bsh, k_cache, v_cache, attn.block_offsets, lengths, heads, kv_heads, scale, block_size
            )
        return out.view(batch, heads, head_dim)

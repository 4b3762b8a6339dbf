"""Ascend's attention contract: fused infer attention with host kv lengths.

On an NPU the decode step calls ``torch_npu.npu_fused_infer_attention_score``
(FIA). Elsewhere a pure-PyTorch custom operator with the same contract stands
in for it: query in BSH layout, a paged cache of [num_blocks, block_size,
kv_heads * head_dim], and ``actual_seq_lengths_kv`` as a host list. The
emulator freezes that list at capture, exactly like an NPU graph, unless the
graph's parameters are updated before the replay; so a missing update gives
wrong output on the CPU too.

A decode step of several new tokens per sequence (speculative verify, MTP)
calls FIA in TND layout with the cumulative query lengths
``actual_seq_lengths`` (host values too), a causal ``atten_mask`` and
``sparse_mode=3``, as dlinfer's ``paged_prefill_attention`` does
(DeepLink-org/dlinfer, ``dlinfer/vendor/ascend/torch_npu_ops.py``). In a graph
every sequence carries the graph's q_len, so those lengths are the same at
every replay of the graph (``q_len, 2 q_len, ...``, from shapes and
``max_q_seq_len``); only the kv lengths are pushed in before each replay.
"""

from __future__ import annotations

import torch

from graphmode.attention import ReferenceAttentionOps, attend, owned_positions
from graphmode.context import AttnMetadata
from graphmode_ascend.emulated_npu import register_updatable

__all__ = [
    "AscendAttentionOps",
    "fused_infer_attention_score",
    "fused_infer_attention_score_out",
    "tnd_limit_violations",
]

# FIA in TND layout, as op-plugin documents its constraints (head size 128,
# or 192 for query and key with 128 for value, without rope; paged blocks a
# multiple of 16 tokens, at most 1024; at most 4096 sequences), and
# vllm-ascend's "TND layout's limit of 16" query tokens per sequence
# (vllm_ascend/attention/attention_v1.py).
TND_HEAD_DIMS = (128,)
TND_BLOCK_MULTIPLE = 16
TND_MAX_BLOCK_SIZE = 1024
TND_MAX_BATCH = 4096
TND_MAX_Q_LEN = 16


def tnd_limit_violations(*, max_q_len: int, block_size: int, max_batches: int, head_dim: int | None) -> list[str]:
    """What keeps FIA in TND layout from running decode steps of up to
    ``max_q_len`` tokens per sequence, each with its value, the limit and
    the fix; empty when nothing does. ``head_dim`` None: not checked (unknown,
    or the emulator's stand-in, which takes any head size)."""
    problems = []
    if max_q_len > TND_MAX_Q_LEN:
        problems.append(
            f"max_q_len={max_q_len}: FIA in TND layout takes at most {TND_MAX_Q_LEN} new tokens per sequence "
            f"(vllm-ascend's TND limit); build the runner with max_q_len <= {TND_MAX_Q_LEN}"
        )
    if block_size % TND_BLOCK_MULTIPLE or block_size > TND_MAX_BLOCK_SIZE:
        problems.append(
            f"block_size={block_size}: FIA in TND layout takes paged KV blocks of a multiple of "
            f"{TND_BLOCK_MULTIPLE} tokens, at most {TND_MAX_BLOCK_SIZE}; allocate the KV cache with such a "
            "block size (128, say)"
        )
    if max_batches > TND_MAX_BATCH:
        problems.append(
            f"max_batches={max_batches}: FIA in TND layout takes at most {TND_MAX_BATCH} sequences; build the "
            f"runner with max_batches <= {TND_MAX_BATCH}"
        )
    if head_dim is not None and head_dim not in TND_HEAD_DIMS:
        problems.append(
            f"head_dim={head_dim}: FIA in TND layout takes heads of 128 (or 192 for query and key with 128 "
            "for value) without rope; this model's decode steps of several tokens per sequence cannot run "
            "on FIA: build the runner with max_q_len=1"
        )
    return problems


def _reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, block_size,
               actual_seq_lengths=None):
    """BSH decode (one query per sequence) without ``actual_seq_lengths``;
    TND with them: query (T, N, D), sequence ``b``'s queries ending at
    ``actual_seq_lengths[b]`` (cumulative), causal over its cache (sparse
    mode 3: the queries are the sequence's last tokens)."""
    head_dim = query.shape[-1] // num_heads if actual_seq_lengths is None else query.shape[-1]
    lengths = torch.tensor(actual_seq_lengths_kv, dtype=torch.long, device=query.device)
    blocks = block_table.long()
    keys = key.view(key.shape[0], block_size, num_key_value_heads, head_dim)[blocks].flatten(1, 2)
    values = value.view(value.shape[0], block_size, num_key_value_heads, head_dim)[blocks].flatten(1, 2)
    positions = torch.arange(keys.shape[1], device=query.device)
    owned = owned_positions(blocks, keys.shape[1])  # the reserved block is never read
    if actual_seq_lengths is None:
        batch = query.shape[0]
        visible = (positions[None, :] < lengths[:, None]) & owned
        out = attend(query.view(batch, num_heads, head_dim), keys, values, visible, scale)
        return out.reshape(batch, 1, num_heads * head_dim)
    longest = max(end - start for start, end in zip([0, *actual_seq_lengths], actual_seq_lengths))
    if longest > TND_MAX_Q_LEN:
        # As FIA does on the device: the stand-in keeps the real kernel's limit.
        raise RuntimeError(
            f"npu_fused_infer_attention_score in TND layout: a sequence of {longest} query tokens (the layout "
            f"takes at most {TND_MAX_Q_LEN} per sequence)"
        )
    ends = torch.tensor(actual_seq_lengths, dtype=torch.long, device=query.device)
    token = torch.arange(query.shape[0], device=query.device)
    row = torch.searchsorted(ends, token, right=True)
    ahead = ends[row] - 1 - token
    visible = (positions[None, :] < (lengths[row] - ahead)[:, None]) & owned[row]
    return attend(query, keys[row], values[row], visible, scale)


# The schemas are written out (as torch 2.13 infers them): torch 2.5 infers
# none from ``list[int]``.
_FIA_ARGS = (
    "Tensor query, Tensor key, Tensor value, Tensor block_table, SymInt[] actual_seq_lengths_kv, "
    "SymInt num_heads, SymInt num_key_value_heads, float scale, SymInt block_size"
)
_Q_LENGTHS = "SymInt[]? actual_seq_lengths=None"


@torch.library.custom_op(
    "graphmode_ascend::fused_infer_attention_score", mutates_args=(),
    schema=f"({_FIA_ARGS}, {_Q_LENGTHS}) -> Tensor",
)
def fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
    actual_seq_lengths_kv: list[int], num_heads: int, num_key_value_heads: int, scale: float, block_size: int,
    actual_seq_lengths: list[int] | None = None,
) -> torch.Tensor:
    """FIA's decode contract in PyTorch: query (B, 1, H*D), key/value caches
    (num_blocks, block_size, K*D), kv lengths as host values; with the
    cumulative query lengths ``actual_seq_lengths`` (host values), TND
    layout, query (T, H, D), causal (FIA's sparse_mode 3)."""
    return _reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                      block_size, actual_seq_lengths)


@torch.library.custom_op(
    "graphmode_ascend::fused_infer_attention_score_out", mutates_args=("out",),
    schema=f"({_FIA_ARGS}, Tensor(a!) out, {_Q_LENGTHS}) -> ()",
)
def fused_infer_attention_score_out(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor,
    actual_seq_lengths_kv: list[int], num_heads: int, num_key_value_heads: int, scale: float, block_size: int,
    out: torch.Tensor, actual_seq_lengths: list[int] | None = None,
) -> None:
    """The same, writing into ``out``: the form an ACL task update re-issues."""
    out.copy_(_reference(query, key, value, block_table, actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                         block_size, actual_seq_lengths))


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

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}

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
        if batch != attn.block_offsets.shape[0]:  # several new tokens per sequence
            return self._multi_token(query, k_cache, v_cache, attn, scale, lengths)
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

    def _multi_token(self, query, k_cache, v_cache, attn: AttnMetadata, scale, lengths: list[int]):
        """FIA in TND layout, causal among each sequence's new tokens."""
        tokens, heads, head_dim = query.shape
        kv_heads = k_cache.shape[-1] // head_dim
        block_size = k_cache.shape[1]
        q_ends = _cumulative_q_lengths(attn, tokens)
        if query.device.type == "npu":
            import torch_npu

            out, _ = torch_npu.npu_fused_infer_attention_score(
                query.contiguous(), k_cache, v_cache, atten_mask=self._causal_mask(query.device),
                block_table=attn.block_offsets, input_layout="TND", block_size=block_size,
                actual_seq_lengths=q_ends, actual_seq_lengths_kv=lengths, num_key_value_heads=kv_heads,
                num_heads=heads, scale=scale, sparse_mode=3,
            )
            return out.view(tokens, heads, head_dim)
        return torch.ops.graphmode_ascend.fused_infer_attention_score(
            query.contiguous(), k_cache, v_cache, attn.block_offsets, lengths, heads, kv_heads, scale, block_size,
            q_ends,
        )

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """FIA's sparse_mode 3 mask: a 2048 x 2048 upper triangle (True =
        masked), as dlinfer passes it; made once per device, outside any
        capture (the warm-up forward runs first)."""
        if device not in self._masks:
            self._masks[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
        return self._masks[device]


def _cumulative_q_lengths(attn: AttnMetadata, tokens: int) -> list[int]:
    """FIA's ``actual_seq_lengths``: where each sequence's queries end. When
    host facts prove every sequence carries ``max_q_seq_len`` tokens (always
    so in a graph, whose contexts pass the graph's q_len), from those facts
    alone; otherwise (an eager step of unequal lengths) read from the step's
    ``q_seqlens``, which an eager step may do."""
    batch, q_len = attn.block_offsets.shape[0], attn.max_q_seq_len
    if q_len >= 1 and tokens == batch * q_len:
        return [q_len * (row + 1) for row in range(batch)]
    return attn.q_seqlens.long().cumsum(0).tolist()

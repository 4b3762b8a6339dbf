"""The example vendor plugin of docs/writing-a-plugin.md: "acme", a made-up
accelerator whose kernels differ from the CUDA default the way real vendors'
do. In its own distribution this module would be ``graphmode_acme/plugin.py``.

- KV cache: [num_blocks, kv_heads, block_size, head_dim], blocks of 32 or
  64 tokens.
- Its fill-cache kernel takes each new token's (block, offset) pair, a
  per-token input of its own (``slot_pairs``), rather than flat slots.
- Capture sizes 1, 3, 6, 12, 24, ... (doubling), capped at max_batches; an
  option limits how many graphs it keeps.
- Its decode kernel holds a block table of at most 256 blocks.

The docs' code blocks are the regions between ``--8<-- [start:NAME]`` and
``--8<-- [end:NAME]`` below, word for word (tests/test_writing_a_plugin.py
checks it). No other code in the repository imports this module except tests.
"""

from __future__ import annotations

# --8<-- [start:imports]
from dataclasses import dataclass

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.attention import attend, owned_positions, write_slots
from graphmode.buffers import stage
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec, GraphSpec

__version__ = "0.1.0"
# --8<-- [end:imports]


# --8<-- [start:vendor_info]
@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    try:
        import torch_acme  # noqa: F401  (the runtime: imported here, never at module level)
    except ImportError as error:
        version, detected, reason = None, False, f"torch_acme is not installed ({error})"
    else:
        version = torch_acme.__version__
        detected = torch_acme.is_available()
        reason = f"{torch_acme.device_count()} Acme device(s)" if detected else "no Acme device is visible"
    return VendorInfo(
        name="acme",                        # the entry-point name
        device_types=("acme",),             # torch device types its graphs run on (cpu: the emulator, always)
        runtime="torch_acme",
        runtime_version=version,
        detected=detected,
        reason=reason,
    )
# --8<-- [end:vendor_info]


# --8<-- [start:options]
@dataclass(frozen=True)
class AcmeOptions:
    """max_graphs: the most decode graphs to keep (Acme's runtime holds few);
    None keeps every capture size."""

    max_graphs: int | None = None

    def __post_init__(self) -> None:
        if self.max_graphs is not None and (not isinstance(self.max_graphs, int) or self.max_graphs < 1):
            raise ConfigError(
                f"acme vendor_options max_graphs={self.max_graphs!r}: give an int >= 1, or None for no limit"
            )
# --8<-- [end:options]


# --8<-- [start:spec]
def acme_capture_sizes(max_batches: int) -> list[int]:
    """1, 3, 6, 12, 24, ... capped at max_batches, which is always the last."""
    sizes, size = [1], 3
    while size < max_batches:
        sizes.append(size)
        size *= 2
    return sorted(set(sizes) | {max_batches})


ACME_SPEC = CUDA_SPEC.with_buffers(
    # Slots are int32 here; padding -1 writes nothing.
    BufferSpec("kv_start_indices", torch.int32, shape=(TOKENS,), padding=-1),
    # Padding rows pass kv length 1: they read one token of the reserved block 0.
    BufferSpec("kv_seqlens", torch.int32, padding=1),
    # The fill kernel's own input: each new token's (block, offset). Its live
    # rows depend on the block size, which a step does not carry, so no
    # source: graphmode_fill_buffers below writes them.
    BufferSpec("slot_pairs", torch.int32, shape=(TOKENS, 2), padding=-1, source=None),
).replace(
    block_sizes=(32, 64),
    capture_policy=acme_capture_sizes,
    max_q_policy="bound",        # graphs pass max_q_seq_len=1 (decode)
    max_kv_policy="dynamic",     # graphs pass -1: the kernel reads kv_seqlens on the device
    options=AcmeOptions,
)


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return ACME_SPEC
# --8<-- [end:spec]


# --8<-- [start:check_config]
MAX_TABLE_BLOCKS = 256  # the decode kernel stages a sequence's block table on chip


@hookimpl
def graphmode_check_config(config) -> None:
    if config.max_blocks_per_seq > MAX_TABLE_BLOCKS:
        raise ConfigError(
            f"max_blocks_per_seq={config.max_blocks_per_seq}: Acme's decode kernel reads block tables of "
            f"at most {MAX_TABLE_BLOCKS} blocks ({MAX_TABLE_BLOCKS * config.block_size} tokens at "
            f"block_size={config.block_size}); build the runner with max_blocks_per_seq <= {MAX_TABLE_BLOCKS}"
        )
# --8<-- [end:check_config]


# --8<-- [start:capture_sizes]
@hookimpl
def graphmode_capture_sizes(config, spec) -> list[int]:
    sizes = spec.capture_list(config.max_batches, config.capture_batch_sizes)  # the default's answer
    limit = config.vendor_options.max_graphs
    if limit is None or len(sizes) <= limit:
        return sizes
    return sizes[-limit:]  # the largest: every batch still fits a graph, small ones pad more
# --8<-- [end:capture_sizes]


# --8<-- [start:fill]
def slot_pairs(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """(T, 2) int32 (block, offset) of each slot; (-1, -1) for slot -1. On
    the device: no host read."""
    slots = slots.reshape(-1).long()
    pairs = torch.stack((slots // block_size, slots % block_size), dim=-1)
    return torch.where(slots[:, None] >= 0, pairs, -1).to(torch.int32)


@hookimpl(wrapper=True)
def graphmode_fill_buffers(meta, inputs, batch_size, bucket):
    done = yield  # the default fills every buffer with a source, and resets their padding
    tokens = inputs.num_tokens
    rows = bucket * (tokens // batch_size)  # the bucket's token rows
    target, padding = meta.input_buffers["slot_pairs"], meta.padding_buffers["slot_pairs"]
    live = slot_pairs(inputs.attn_metadata.kv_start_indices, meta.block_size)
    stage(meta, [(target[:tokens], live), (target[tokens:rows], padding[tokens:rows])])
    return done
# --8<-- [end:fill]


# --8<-- [start:ops]
class AcmeAttentionOps:
    """Acme's kernels behind graphmode's AttentionOps contract (here in
    PyTorch; on the device, calls into torch_acme)."""

    layout = "[num_blocks, kv_heads, block_size, head_dim]"
    contract = "acme"  # a runner of another vendor refuses a model built on these ops

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def make_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = self.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    def block_view(self, cache, head_dim):
        # (num_blocks, block_size, kv_heads, head_dim), sharing the cache's memory.
        return cache.transpose(1, 2)

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        block_size = k_cache.shape[2]
        pairs = attn.vendor_fields.get("slot_pairs")  # a graph step: the declared buffer
        if pairs is None:  # an eager step: the engine passed slots only
            pairs = slot_pairs(attn.kv_start_indices, block_size)
        block, offset = pairs.long().unbind(-1)
        slots = torch.where(block >= 0, block * block_size + offset, -1)  # -1: write nothing
        write_slots(self.block_view(k_cache, key.shape[-1]), slots, key)
        write_slots(self.block_view(v_cache, value.shape[-1]), slots, value)

    def _gather(self, cache, block_offsets, head_dim):
        blocks = self.block_view(cache, head_dim)[block_offsets.long()]  # (B, W, bs, K, D)
        return blocks.flatten(1, 2)  # (B, W * bs, K, D)

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        keys = self._gather(k_cache, attn.block_offsets, head_dim)
        values = self._gather(v_cache, attn.block_offsets, head_dim)
        positions = torch.arange(keys.shape[1], device=query.device)
        visible = positions[None, :] < attn.kv_seqlens[:, None].long()
        visible &= owned_positions(attn.block_offsets, keys.shape[1])  # never the reserved block 0
        return attend(query, keys, values, visible, scale)

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        # Eager only (prefill never runs inside a full graph): host reads are fine here.
        head_dim = query.shape[-1]
        keys_all = self._gather(k_cache, attn.block_offsets, head_dim)
        values_all = self._gather(v_cache, attn.block_offsets, head_dim)
        out = torch.empty_like(query)
        rows = zip(attn.q_start_loc.tolist(), attn.q_seqlens.tolist(), attn.kv_seqlens.tolist())
        for seq, (start, q_len, kv_len) in enumerate(rows):
            keys, values = keys_all[seq, :kv_len], values_all[seq, :kv_len]
            positions = torch.arange(kv_len - q_len, kv_len, device=query.device)  # this step's tokens
            visible = torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None]  # causal
            out[start : start + q_len] = attend(
                query[start : start + q_len], keys.expand(q_len, -1, -1, -1),
                values.expand(q_len, -1, -1, -1), visible, scale,
            )
        return out


@hookimpl
def graphmode_attention_ops() -> AcmeAttentionOps:
    return AcmeAttentionOps()
# --8<-- [end:ops]

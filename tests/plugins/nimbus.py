"""An outsider's plugin for the imaginary Nimbus accelerator, written from the
docs alone by the fifth outsider probe (2026-11-26), kept as a test plugin:
the suite passes it (tests/test_conformance_suite.py), and its planted slips
below are caught, each named by its mechanism.

Nimbus differs from CUDA (and from acme, zeta, quill and vexa):
- its decode kernel takes the kv lengths as a **host list of int64** (a
  launch argument, as Ascend's FIA takes ``actual_seq_lengths_kv``); a graph
  freezes it, so Nimbus's runtime graph has an explicit ``update(seq_lens=)``
  that re-issues every captured decode call with new lengths, called before
  every replay (``graphmode_update_graph_params``);
- its fill-cache kernel takes slot indices shaped ``(tokens, 1)``, int64;
- its block table marks "no block" with -1 (its own buffer, padded -1), and
  the kernel skips the sentinel;
- its own bucket policy: 1, 2, 4, then multiples of 8, capped at max_batches;
- typed options: ``max_graphs`` (its runtime holds few graphs).
On the CPU the decode kernel is a torch custom operator that Nimbus's
emulated graph records as an updatable call (docs/emulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.attention import attend, write_slots
from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord
from graphmode.spec import BLOCKS, CUDA_SPEC, SEQUENCES, TOKENS, BufferSpec, GraphSpec

__version__ = "0.1.0"


# ---------------------------------------------------------------- kernels (PyTorch stand-ins)

@torch.library.custom_op("nimbus::paged_decode", mutates_args=())
def paged_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: list[int], scale: float,
) -> torch.Tensor:
    """One query per sequence. Row b attends over its first seq_lens[b] cached
    tokens (a host value, trusted as given); table entries < 0 are skipped."""
    batch, width = block_table.shape
    block_size = k_cache.shape[1]
    table = block_table.long()
    owned = table >= 0
    safe = torch.where(owned, table, 0)  # never index with the sentinel
    keys = k_cache[safe].flatten(1, 2)  # (B, W * bs, K, D)
    values = v_cache[safe].flatten(1, 2)
    lens = torch.tensor(seq_lens, dtype=torch.long)
    positions = torch.arange(width * block_size)
    visible = positions[None, :] < lens[:, None]
    visible &= owned.repeat_interleave(block_size, dim=1)
    return attend(query, keys, values, visible, scale)


@paged_decode.register_fake
def _(query, k_cache, v_cache, block_table, seq_lens, scale):
    return torch.empty_like(query)


def nimbus_table(block_offsets: torch.Tensor) -> torch.Tensor:
    """Nimbus's table: -1 where the engine's table points at the reserved block 0."""
    return torch.where(block_offsets == 0, -1, block_offsets).to(torch.int32)


class NimbusAttentionOps:
    """Nimbus's kernels behind graphmode's AttentionOps (CUDA's cache layout)."""

    layout = "[num_blocks, block_size, kv_heads, head_dim]"
    contract = "nimbus"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def make_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = self.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]

    def block_view(self, cache, head_dim):
        return cache

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.kv_start_indices.reshape(-1)  # (T, 1) in graphs, (T,) eagerly
        write_slots(k_cache, slots, key)
        write_slots(v_cache, slots, value)

    def _host_lengths(self, attn) -> list[int]:
        lens = attn.vendor_fields.get("seq_lens_host")
        if lens is not None:  # a graph step: the host buffer (read on the host: frozen, then updated)
            return lens.tolist()
        if attn.kv_seqlens_cpu is not None:
            return attn.kv_seqlens_cpu.tolist()
        return attn.kv_seqlens.tolist()  # eager only

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        batch = attn.block_offsets.shape[0]
        if query.shape[0] != batch:
            raise ValueError(f"Nimbus's decode kernel takes one query per sequence: got {query.shape[0]} "
                             f"queries for {batch} sequences")
        table = attn.vendor_fields.get("nimbus_table")
        if table is None:
            table = nimbus_table(attn.block_offsets)
        return paged_decode(query, k_cache, v_cache, table, self._host_lengths(attn), float(scale))

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        # Eager only: host reads are fine.
        out = torch.empty_like(query)
        tables = attn.block_offsets.long()
        rows = zip(attn.q_start_loc.tolist(), attn.q_seqlens.tolist(), attn.kv_seqlens.tolist())
        for seq, (start, q_len, kv_len) in enumerate(rows):
            keys = k_cache[tables[seq]].flatten(0, 1)[:kv_len]
            values = v_cache[tables[seq]].flatten(0, 1)[:kv_len]
            positions = torch.arange(kv_len - q_len, kv_len)
            visible = torch.arange(kv_len)[None, :] <= positions[:, None]
            out[start:start + q_len] = attend(query[start:start + q_len], keys.expand(q_len, -1, -1, -1),
                                              values.expand(q_len, -1, -1, -1), visible, scale)
        return out


# ---------------------------------------------------------------- the emulated runtime graph

class UpdatableDecode:
    """One captured decode call whose seq_lens an update re-issues."""

    def __init__(self):
        self.steps: list = []

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes):
        record = self.steps[0]
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)


class NimbusGraph(EmulatedGraph):
    """Nimbus's runtime graph on the CPU: decode calls are updatable,
    ``update(seq_lens=...)`` re-issues every one of them."""

    def __init__(self):
        super().__init__()
        self.decode_calls: list[UpdatableDecode] = []

    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.nimbus.paged_decode.default:
            return session.record(func, args, kwargs)
        call = UpdatableDecode()
        session.append(call)
        with session.nested(call.steps):
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        self.decode_calls.append(call)
        return outputs

    def update(self, seq_lens: list[int]) -> None:
        for call in self.decode_calls:
            call.update(seq_lens=list(seq_lens))

    def reset(self):
        self.decode_calls = []
        super().reset()


# ---------------------------------------------------------------- declarations

@dataclass(frozen=True)
class NimbusOptions:
    """max_graphs: the most decode graphs to keep; None keeps every capture size."""

    max_graphs: int | None = None

    def __post_init__(self) -> None:
        if self.max_graphs is not None and (not isinstance(self.max_graphs, int) or self.max_graphs < 1):
            raise ConfigError(f"nimbus vendor_options max_graphs={self.max_graphs!r}: give an int >= 1, or None")


def nimbus_capture_sizes(max_batches: int) -> list[int]:
    """1, 2, 4, then multiples of 8, capped at max_batches (always the last)."""
    sizes = [s for s in (1, 2, 4) if s < max_batches] + list(range(8, max_batches, 8))
    return sorted(set(sizes) | {max_batches})


NIMBUS_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS, 1), padding=-1),
    BufferSpec("seq_lens_host", torch.int64, host=True, padding=1, source="attn_metadata.kv_seqlens_cpu"),
    BufferSpec("nimbus_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=-1,
               source=lambda step: nimbus_table(step.attn_metadata.block_offsets)),
).replace(
    block_sizes=(16, 32),
    capture_policy=nimbus_capture_sizes,
    max_q_policy="bound",
    max_kv_policy="dynamic",
    options=NimbusOptions,
)


class Nimbus:
    """The plugin as an object (a slip below overrides one method)."""

    spec: GraphSpec = NIMBUS_SPEC

    @hookimpl
    def graphmode_vendor_info(self) -> VendorInfo:
        return VendorInfo(name="nimbus", device_types=("nimbus",), runtime="torch_nimbus", runtime_version=None,
                          detected=False, reason="torch_nimbus is not installed",
                          capabilities=("host_kv_lengths",))

    @hookimpl
    def graphmode_graph_spec(self) -> GraphSpec:
        return self.spec

    @hookimpl
    def graphmode_attention_ops(self) -> NimbusAttentionOps:
        return NimbusAttentionOps()

    @hookimpl
    def graphmode_capture_sizes(self, config, spec) -> list[int]:
        sizes = spec.capture_list(config.max_batches, config.capture_batch_sizes)
        limit = config.vendor_options.max_graphs
        return sizes if limit is None or len(sizes) <= limit else sizes[-limit:]

    @hookimpl
    def graphmode_make_graph(self, meta):
        return NimbusGraph() if meta.device.type == "cpu" else None  # torch_nimbus's graph on the device

    @hookimpl
    def graphmode_update_graph_params(self, graph, meta, batch_size, bucket) -> None:
        # Every row of the bucket, padding included, from the host buffer the fill wrote.
        graph.update(seq_lens=meta.input_buffers["seq_lens_host"][:bucket].tolist())


plugin = Nimbus()  # for --plugin plugins.nimbus:plugin


# ---------------------------------------------------------------- planted slips (each caught by the suite)

class LengthsNotPushed(Nimbus):
    """The update hook returns before pushing: every replay keeps the
    capture step's kv lengths."""

    @hookimpl
    def graphmode_update_graph_params(self, graph, meta, batch_size, bucket) -> None:
        return None


class LivePushOnly(Nimbus):
    """The update pushes the batch's live lengths only, not the bucket's rows."""

    @hookimpl
    def graphmode_update_graph_params(self, graph, meta, batch_size, bucket) -> None:
        graph.update(seq_lens=meta.input_buffers["seq_lens_host"][:batch_size].tolist())


class TablePaddedWithZero(Nimbus):
    """Nimbus's own table padded 0 (CUDA's value) where its kernel's "no
    block" is -1: padding rows read block 0 as a real block."""

    spec = NIMBUS_SPEC.with_buffers(
        BufferSpec("nimbus_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=0,
                   source=lambda step: nimbus_table(step.attn_metadata.block_offsets)),
    )


class LengthsPaddedLikeSlots(Nimbus):
    """The host lengths padded -1, the slot buffer's padding."""

    spec = NIMBUS_SPEC.with_buffers(
        BufferSpec("seq_lens_host", torch.int64, host=True, padding=-1, source="attn_metadata.kv_seqlens_cpu"),
    )


def _table_on_the_host(step):
    rows = step.attn_metadata.block_offsets.tolist()  # a host read of device memory, every step
    return torch.tensor([[block if block else -1 for block in row] for row in rows], dtype=torch.int32)


class TableBuiltOnTheHost(Nimbus):
    """The table's source function builds it in Python from the step's
    device table: a host read before every replay."""

    spec = NIMBUS_SPEC.with_buffers(
        BufferSpec("nimbus_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=-1, source=_table_on_the_host),
    )


lengths_not_pushed = LengthsNotPushed()
live_push_only = LivePushOnly()
table_padded_with_zero = TablePaddedWithZero()
lengths_padded_like_slots = LengthsPaddedLikeSlots()
table_built_on_the_host = TableBuiltOnTheHost()

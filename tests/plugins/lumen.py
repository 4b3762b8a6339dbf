"""Lumen: a made-up accelerator's plugin, written by a fourth outsider probe from
docs/ alone (README, writing-a-plugin, hooks, emulator, conformance).

Lumen's traits, each one a real vendor's:

- its decode kernel (one opaque operator, ``lumen::paged_decode``) takes the
  kv lengths as a **host** list and a host ``max_seqlen`` bound, and its graph
  runtime re-issues captured calls only through an explicit
  ``LumenRuntimeGraph.update(task_args=[{...}, ...])``, one dict per captured
  call, before **every** replay (Ascend's ``graph.update(cpu_update_input=...)``):
  a replay with no update since the last one is refused by the runtime;
- the host lengths are int64 of shape ``(batch, 1)``, the slots int64
  ``(tokens, 1)`` (MACA's);
- the block table handed to the kernel marks "no block" with -1, not block 0;
- the KV cache is heads first, ``[kv_heads, num_blocks, block_size, head_dim]``;
- capture sizes 1, 2, 4, 8, then multiples of 8 up to 64, then of 32;
- typed options: a graph budget and which update path to use.

``plugin`` is the module itself; the slips below are copies with one thing
changed, each a mistake a vendor engineer makes in such a plugin.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from graphmode import ConfigError, VendorInfo, hookimpl
from graphmode.attention import attend, write_slots
from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord
from graphmode.graphs import DeviceGraph
from graphmode.spec import BLOCKS, CUDA_SPEC, SEQUENCES, TOKENS, BufferSpec, GraphSpec

__version__ = "0.1.0"

UPDATE_MODES = ("all_calls", "per_call")


@dataclass(frozen=True)
class LumenOptions:
    """max_graphs: the most decode graphs to keep, None for every capture size.
    update_mode: "all_calls" pushes one update naming every captured call,
    "per_call" updates each call alone (older Lumen runtimes)."""

    max_graphs: int | None = None
    update_mode: str = "all_calls"

    def __post_init__(self) -> None:
        if self.max_graphs is not None and (not isinstance(self.max_graphs, int) or self.max_graphs < 1):
            raise ConfigError(f"lumen vendor_options max_graphs={self.max_graphs!r}: give an int >= 1, or None")
        if self.update_mode not in UPDATE_MODES:
            raise ConfigError(f"lumen vendor_options update_mode={self.update_mode!r}: give one of {UPDATE_MODES}")


def lumen_capture_sizes(max_batches: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 64, then of 32; capped at
    max_batches, which is always the last."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_batches + 1, 32)]
    return sorted({size for size in sizes if size < max_batches} | {max_batches})


def lumen_table(step) -> torch.Tensor:
    """The kernel's block table: the engine's, with -1 where it points at the
    reserved block 0 (unused columns). On the device: no host read."""
    table = step.attn_metadata.block_offsets
    return torch.where(table == 0, -1, table).to(torch.int32)


LUMEN_SPEC = CUDA_SPEC.with_buffers(
    # (tokens, 1) int64 slots, -1 writes nothing.
    BufferSpec("lumen_slots", torch.int64, shape=(TOKENS, 1), padding=-1, source="attn_metadata.kv_start_indices"),
    # The kernel's table, -1 for "no block": padding rows hold no block at all.
    BufferSpec("lumen_table", torch.int32, shape=(SEQUENCES, BLOCKS),
               padding=-1, source=lumen_table),
    # Host kv lengths, (batch, 1) int64, pushed into the graph before every replay.
    BufferSpec("lumen_kv_lens", torch.int64, shape=(SEQUENCES, 1), padding=1,
               source="attn_metadata.kv_seqlens_cpu", host=True),
).replace(
    block_sizes=(16, 32),
    capture_policy=lumen_capture_sizes,
    max_kv_policy="capacity",
    options=LumenOptions,
    option_variants=({"update_mode": "all_calls"}, {"update_mode": "per_call"}),
)


# -- the kernel: one opaque operator taking host lengths ----------------------

@torch.library.custom_op("lumen::paged_decode", mutates_args=())
def lumen_paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                       kv_lens: list[int], max_seqlen: int, scale: float) -> torch.Tensor:
    """Row b attends over its first kv_lens[b] tokens (host values, trusted),
    never more than max_seqlen; table entries -1 are no block."""
    blocks_needed = -(-max_seqlen // k_cache.shape[2])
    table = table[:, :blocks_needed].long()
    keys = k_cache.permute(1, 2, 0, 3)[table.clamp(min=0)].flatten(1, 2)  # (B, W*bs, K, D)
    values = v_cache.permute(1, 2, 0, 3)[table.clamp(min=0)].flatten(1, 2)
    positions = torch.arange(keys.shape[1])
    lengths = torch.tensor(kv_lens, dtype=torch.long).clamp(max=max_seqlen)
    owned = (table >= 0).repeat_interleave(k_cache.shape[2], dim=1)
    visible = (positions[None, :] < lengths[:, None]) & owned
    return attend(query, keys, values, visible, scale)


@lumen_paged_decode.register_fake
def _(query, k_cache, v_cache, table, kv_lens, max_seqlen, scale):
    return torch.empty_like(query)


class LumenAttentionOps:
    """Lumen's kernels (in PyTorch here; torch_lumen's on the device)."""

    layout = "[kv_heads, num_blocks, block_size, head_dim]"
    contract = "lumen"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def make_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = self.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]

    def block_view(self, cache, head_dim):
        return cache.permute(1, 2, 0, 3)

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.vendor_fields.get("lumen_slots")
        if slots is None:
            slots = attn.kv_start_indices
        slots = slots.reshape(-1)
        write_slots(self.block_view(k_cache, key.shape[-1]), slots, key)
        write_slots(self.block_view(v_cache, value.shape[-1]), slots, value)

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] != attn.block_offsets.shape[0]:
            raise ValueError(f"lumen's decode kernel takes one query per sequence: {query.shape[0]} queries for "
                             f"{attn.block_offsets.shape[0]} sequences")
        lens = attn.vendor_fields.get("lumen_kv_lens")
        if lens is not None:  # a graph step: the host buffer (read at capture, pushed at every replay)
            kv_lens = lens.reshape(-1).tolist()
            table = attn.vendor_fields["lumen_table"]
        else:  # eager: host reads are fine
            source = attn.kv_seqlens_cpu if attn.kv_seqlens_cpu is not None else attn.kv_seqlens
            kv_lens = source.tolist()
            table = torch.where(attn.block_offsets == 0, -1, attn.block_offsets)
        return torch.ops.lumen.paged_decode(query, k_cache, v_cache, table, kv_lens, max(kv_lens), scale)

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        table = attn.block_offsets.long()
        keys_all = self.block_view(k_cache, head_dim)[table].flatten(1, 2)
        values_all = self.block_view(v_cache, head_dim)[table].flatten(1, 2)
        out = torch.empty_like(query)
        rows = zip(attn.q_start_loc.tolist(), attn.q_seqlens.tolist(), attn.kv_seqlens.tolist())
        for seq, (start, q_len, kv_len) in enumerate(rows):
            keys, values = keys_all[seq, :kv_len], values_all[seq, :kv_len]
            positions = torch.arange(kv_len - q_len, kv_len, device=query.device)
            visible = torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None]
            out[start:start + q_len] = attend(query[start:start + q_len], keys.expand(q_len, -1, -1, -1),
                                              values.expand(q_len, -1, -1, -1), visible, scale)
        return out


# -- the emulated runtime: a graph whose decode calls need an update per replay --

class LumenTask:
    """One captured ``lumen::paged_decode`` call, re-issued with new host
    arguments by an update."""

    def __init__(self):
        self.steps: list = []

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes):
        record = self.steps[0]
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)


class LumenRuntimeGraph(EmulatedGraph):
    """torch_lumen's graph, emulated: decode calls are tasks; ``update`` must
    run before every replay (the device waits for it)."""

    def __init__(self):
        super().__init__()
        self.tasks: list[LumenTask] = []
        self.updated = False

    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.lumen.paged_decode.default:
            return session.record(func, args, kwargs)
        task = LumenTask()
        session.append(task)
        with session.nested(task.steps):
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        self.tasks.append(task)
        return outputs

    def update(self, task_args: list[dict]) -> None:
        if len(task_args) != len(self.tasks):
            raise RuntimeError(f"LUMEN_ERR_TASK_COUNT: {len(task_args)} argument sets for {len(self.tasks)} tasks")
        for task, changes in zip(self.tasks, task_args):
            task.update(**changes)
        self.updated = True

    def update_task(self, index: int, **changes) -> None:
        self.tasks[index].update(**changes)
        self.updated = True

    def replay(self):
        if self.tasks and not self.updated:
            raise RuntimeError("LUMEN_ERR_TASK_NOT_UPDATED: replay without an update of its decode tasks "
                               "(the device would wait forever)")
        self.updated = False
        super().replay()

    def reset(self):
        super().reset()
        self.tasks = []
        self.updated = False


class LumenGraph(DeviceGraph):
    """graphmode's interface over the runtime graph (emulated on cpu)."""

    def __init__(self):
        self.graph = LumenRuntimeGraph()

    def capture_begin(self, pool=None):
        self.graph.capture_begin(pool)

    def capture_end(self):
        self.graph.capture_end()

    def replay(self):
        self.graph.replay()

    def reset(self):
        self.graph.reset()

    def pool(self):
        return self.graph.pool()


def push(graph: LumenGraph, kv_lens: list[int], max_seqlen: int, mode: str) -> None:
    args = {"kv_lens": kv_lens, "max_seqlen": max_seqlen}
    if mode == "all_calls":
        graph.graph.update([args] * len(graph.graph.tasks))
    else:
        for index in range(len(graph.graph.tasks)):
            graph.graph.update_task(index, **args)


# -- hooks ------------------------------------------------------------------

@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    return VendorInfo(name="lumen", device_types=("lumen",), runtime="torch_lumen", runtime_version=None,
                      detected=False, reason="torch_lumen is not installed",
                      capabilities=("host_kv_lengths",))


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return LUMEN_SPEC


@hookimpl
def graphmode_attention_ops() -> LumenAttentionOps:
    return LumenAttentionOps()


@hookimpl
def graphmode_capture_sizes(config, spec) -> list[int]:
    sizes = spec.capture_list(config.max_batches, config.capture_batch_sizes)
    limit = config.vendor_options.max_graphs
    return sizes if limit is None or len(sizes) <= limit else sizes[-limit:]


@hookimpl
def graphmode_make_graph(meta):
    if meta.device.type != "cpu":
        return None  # torch_lumen's graph on the device
    return LumenGraph()


@hookimpl
def graphmode_update_graph_params(graph, meta, batch_size, bucket):
    lens = meta.input_buffers["lumen_kv_lens"][:bucket].reshape(-1).tolist()
    push(graph, lens, max(lens), meta.vendor_options.update_mode)


plugin = sys.modules[__name__]


def _slip(**hooks) -> SimpleNamespace:
    """A copy of the plugin with some hooks replaced."""
    names = ("graphmode_vendor_info", "graphmode_graph_spec", "graphmode_attention_ops", "graphmode_capture_sizes",
             "graphmode_make_graph", "graphmode_update_graph_params")
    return SimpleNamespace(**{name: hooks.get(name, getattr(plugin, name)) for name in names})


# -- slips a vendor engineer makes in such a plugin ---------------------------

@hookimpl
def _push_lengths_only(graph, meta, batch_size, bucket):
    """Pushes the kv lengths but not the max_seqlen bound: every replay keeps
    the capture step's longest length."""
    lens = meta.input_buffers["lumen_kv_lens"][:bucket].reshape(-1).tolist()
    mode = meta.vendor_options.update_mode
    if mode == "all_calls":
        graph.graph.update([{"kv_lens": lens}] * len(graph.graph.tasks))
    else:
        for index in range(len(graph.graph.tasks)):
            graph.graph.update_task(index, kv_lens=lens)


max_seqlen_never_pushed = _slip(graphmode_update_graph_params=_push_lengths_only)


def _spec_with(*buffers: BufferSpec, **fields):
    spec = LUMEN_SPEC.with_buffers(*buffers).replace(**fields)
    return hookimpl(lambda: spec)


# The host lengths padded like the slots, -1: a device kernel takes -1 as a
# length (a huge unsigned one, or a loop bound).
host_lengths_padded_minus_one = _slip(graphmode_graph_spec=_spec_with(
    BufferSpec("lumen_kv_lens", torch.int64, shape=(SEQUENCES, 1), padding=-1,
               source="attn_metadata.kv_seqlens_cpu", host=True)))


@hookimpl
def _push_whole_buffer(graph, meta, batch_size, bucket):
    """Pushes every row of the host buffer (max_batches values), not the
    bucket's: a list sized for the largest graph."""
    lens = meta.input_buffers["lumen_kv_lens"].reshape(-1).tolist()
    push(graph, lens, max(lens), meta.vendor_options.update_mode)


pushed_for_the_largest_bucket = _slip(graphmode_update_graph_params=_push_whole_buffer)


# The engine's block table taken as is, padded -1: its unused columns still
# point at block 0, which the kernel takes for an owned block.
table_copied_padded_minus_one = _slip(graphmode_graph_spec=_spec_with(
    BufferSpec("lumen_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=-1,
               source="attn_metadata.block_offsets")))


_LAST_PUSHED: dict = {}


@hookimpl
def _push_when_changed(graph, meta, batch_size, bucket):
    """Skips the update when the lengths look unchanged (same batch size in
    the same graph): the runtime needs one before every replay."""
    if _LAST_PUSHED.get(id(graph)) == batch_size:
        return
    _LAST_PUSHED[id(graph)] = batch_size
    lens = meta.input_buffers["lumen_kv_lens"][:bucket].reshape(-1).tolist()
    push(graph, lens, max(lens), meta.vendor_options.update_mode)


update_skipped_when_batch_unchanged = _slip(graphmode_update_graph_params=_push_when_changed)


# The host lengths declared without host=True: a device buffer.
lengths_not_on_the_host = _slip(graphmode_graph_spec=_spec_with(
    BufferSpec("lumen_kv_lens", torch.int64, shape=(SEQUENCES, 1), padding=1,
               source="attn_metadata.kv_seqlens_cpu")))

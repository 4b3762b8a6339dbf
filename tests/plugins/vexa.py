"""graphmode plugin for the (made-up, Gaudi/XPU-like) Vexa accelerator.

What differs from CUDA:
- graphs: ``torch_vexa.VexaGraph`` with begin_record/end_record/launch/discard/mempool,
  wrapped as a graphmode DeviceGraph (``VexaDeviceGraph``);
- capture sizes in two stages: 1, 2, 4, 8, then steps of 12 (12, 24, 36); largest graph 36;
- the decode kernel takes kv lengths as a host list (``int[]``: its loop bounds), pushed into
  the captured graph before every launch (graphmode_update_graph_params);
- the decode kernel's block table marks "no block" with the sentinel -1 (never block 0);
- the fill-cache kernel takes slots as a (batch, 1) tensor.

Written from docs/ and README.md alone by the second outsider probe
(2026-11-26; findings in the probe's report), kept as a test plugin: the
suite passes it, and ``sentinel_indexed`` (its kernel indexing the cache with
the sentinel) fails the unowned-block check. On the CPU the runtime's graph
is ``EmulatedVexaGraph``, the same API on graphmode's emulator.
"""

from __future__ import annotations

import math
import sys
import types

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.attention import ReferenceAttentionOps, attend, write_slots
from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord
from graphmode.graphs import DeviceGraph
from graphmode.spec import BLOCKS, CUDA_SPEC, SEQUENCES, BufferSpec, GraphSpec

__version__ = "0.1.0"
plugin = sys.modules[__name__]  # for --plugin plugins.vexa:plugin

NO_BLOCK = -1  # the decode kernel's block-table sentinel
LINEAR_STEP = 12
LARGEST_GRAPH = 36


# --- the kernels -------------------------------------------------------------------------------

@torch.library.custom_op("vexa::paged_decode", mutates_args=())
def paged_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    kv_lens: list[int], scale: float, skip_sentinel: bool = True,
) -> torch.Tensor:
    """query (B, H, D); caches (N, bs, K, D); block_table (B, W) with -1 for no block; kv_lens: host ints,
    the loop bound of each row (the kernel trusts them)."""
    block_size = k_cache.shape[1]
    out = torch.zeros_like(query)
    for b, n in enumerate(kv_lens):
        if n <= 0:
            continue
        nblocks = math.ceil(n / block_size)
        blocks = block_table[b, :nblocks].long()
        valid = blocks != NO_BLOCK
        safe = torch.where(valid, blocks, 0)
        if not skip_sentinel:  # the slip below: the sentinel used as an index (PyTorch: the last block)
            valid, safe = torch.ones_like(valid), blocks
        keys = k_cache[safe].flatten(0, 1)[:n]  # (n, K, D)
        values = v_cache[safe].flatten(0, 1)[:n]
        visible = valid.repeat_interleave(block_size)[:n][None, :]
        out[b : b + 1] = attend(query[b : b + 1], keys[None], values[None], visible, scale)
    return out


@paged_decode.register_fake
def _(query, k_cache, v_cache, block_table, kv_lens, scale, skip_sentinel=True):
    return torch.empty_like(query)


def vexa_block_table(block_offsets: torch.Tensor) -> torch.Tensor:
    """The engine's table (block 0 = no block) in Vexa's form (-1 = no block). On the device."""
    return torch.where(block_offsets == 0, NO_BLOCK, block_offsets).to(torch.int32)


class VexaAttentionOps(ReferenceAttentionOps):
    """Vexa's kernels. Cache layout as CUDA's; prefill as the reference (eager)."""

    layout = "[num_blocks, block_size, kv_heads, head_dim]"
    contract = "vexa"
    skip_sentinel = True

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.vendor_fields.get("vexa_slot_mapping")  # (B, 1) in graph steps
        if slots is None:
            slots = attn.kv_start_indices.reshape(-1, 1)
        slots = slots.reshape(-1)
        write_slots(k_cache, slots, key)
        write_slots(v_cache, slots, value)

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] != attn.block_offsets.shape[0]:
            raise NotImplementedError(
                f"Vexa's decode kernel takes one query token per sequence: {query.shape[0]} tokens for "
                f"{attn.block_offsets.shape[0]} sequences"
            )
        table = attn.vendor_fields.get("vexa_block_table")
        if table is None:
            table = vexa_block_table(attn.block_offsets)
        host = attn.kv_seqlens_cpu
        lens = host.tolist() if host is not None else attn.kv_seqlens.tolist()  # eager without host lengths
        return torch.ops.vexa.paged_decode(query, k_cache, v_cache, table, lens, scale, self.skip_sentinel)


# --- the runtime's graph, emulated ---

class UpdatableDecode:
    """One recorded ``vexa::paged_decode`` call whose ``kv_lens`` an update replaces."""

    def __init__(self) -> None:
        self.steps: list = []
        self.fresh = True  # host args not yet consumed by a launch

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes) -> None:
        record = self.steps[0]
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)
        self.fresh = True


class EmulatedVexaGraph(EmulatedGraph):
    """The emulated ``torch_vexa.VexaGraph``: the vendor API on the emulator."""

    def __init__(self) -> None:
        super().__init__()
        self.decodes: list[UpdatableDecode] = []

    # the vendor's API -------------------------------------------------------
    def begin_record(self, mempool=None) -> None:
        self.capture_begin(mempool)

    def end_record(self) -> None:
        self.capture_end()

    def set_host_args(self, op_index: int, **args) -> None:
        self.decodes[op_index].update(**args)

    def launch(self) -> None:
        stale = [i for i, call in enumerate(self.decodes) if not call.fresh]
        if stale:
            raise RuntimeError(
                f"VexaGraph.launch: decode ops {stale} hold host args already consumed by the previous launch; "
                "call set_host_args before every launch"
            )
        for call in self.decodes:
            call.fresh = False
        self.replay()

    def discard(self) -> None:
        self.reset()

    @property
    def mempool(self):
        return self.pool()

    # the emulator's extension point -------------------------------------------
    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.vexa.paged_decode.default:
            return session.record(func, args, kwargs)
        call = UpdatableDecode()
        session.append(call)
        with session.nested(call.steps):
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        call.fresh = False  # the capture consumed them
        self.decodes.append(call)
        return outputs

    def reset(self) -> None:
        super().reset()
        self.decodes = []


# --- the graph -------------------------------------------------------------------------------------

class VexaDeviceGraph(DeviceGraph):
    """graphmode's DeviceGraph over a VexaGraph (real or emulated)."""

    def __init__(self, graph) -> None:
        self.graph = graph

    def capture_begin(self, pool=None) -> None:
        self.graph.begin_record(mempool=pool)

    def capture_end(self) -> None:
        self.graph.end_record()

    def replay(self) -> None:
        self.graph.launch()

    def reset(self) -> None:
        self.graph.discard()

    def pool(self):
        return self.graph.mempool

    def push_kv_lens(self, kv_lens: list[int]) -> None:
        for index in range(len(self.graph.decodes)):
            self.graph.set_host_args(index, kv_lens=kv_lens)


# --- the hooks -------------------------------------------------------------------------------------

def vexa_capture_sizes(max_batches: int) -> list[int]:
    """Two stages: 1, 2, 4, 8, then steps of 12, up to the largest graph (36) or max_batches."""
    top = min(max_batches, LARGEST_GRAPH)
    sizes = [s for s in (1, 2, 4, 8) if s < top]
    sizes += list(range(LINEAR_STEP, top, LINEAR_STEP))
    return sorted(set(sizes) | {top})


VEXA_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_seqlens_cpu", torch.int32, padding=1, host=True, source="attn_metadata.kv_seqlens_cpu"),
    BufferSpec(
        "vexa_block_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=NO_BLOCK,
        source=lambda step: vexa_block_table(step.attn_metadata.block_offsets),
    ),
    BufferSpec(
        "vexa_slot_mapping", torch.int64, shape=(SEQUENCES, 1), padding=-1,
        source="attn_metadata.kv_start_indices",
    ),
).replace(
    block_sizes=(16, 32, 64, 128),
    capture_policy=vexa_capture_sizes,
    max_capture_size=LARGEST_GRAPH,
    max_q_policy="bound",
    max_kv_policy="dynamic",
)


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    try:
        import torch_vexa  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as error:
        version, detected, reason = None, False, f"torch_vexa is not installed ({error})"
    else:
        version = torch_vexa.__version__
        detected = torch_vexa.is_available()
        reason = "a Vexa device" if detected else "no Vexa device is visible"
    return VendorInfo(
        name="vexa", device_types=("vexa",), runtime="torch_vexa", runtime_version=version,
        detected=detected, reason=reason, capabilities=("host_kv_lengths",),
    )


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return VEXA_SPEC


@hookimpl
def graphmode_attention_ops() -> VexaAttentionOps:
    return VexaAttentionOps()


@hookimpl
def graphmode_make_graph(meta):
    if meta.device.type == "cpu":
        return VexaDeviceGraph(EmulatedVexaGraph())
    if meta.device.type == "vexa":
        import torch_vexa  # type: ignore[import-not-found]

        return VexaDeviceGraph(torch_vexa.VexaGraph())
    return None


@hookimpl
def graphmode_update_graph_params(graph, meta, batch_size, bucket):
    # Every row of the bucket, padding rows included, from the filled host buffer.
    graph.push_kv_lens(meta.input_buffers["kv_seqlens_cpu"][:bucket].tolist())


# --- its slip ----------------------------------------------------------------------------------------
class SentinelIndexedOps(VexaAttentionOps):
    skip_sentinel = False


@hookimpl
def _sentinel_indexed_ops():
    return SentinelIndexedOps()


sentinel_indexed = types.SimpleNamespace(
    __name__="vexa_sentinel_indexed", __version__=__version__,
    **{name: getattr(plugin, name) for name in dir(plugin) if name.startswith("graphmode_")},
)
sentinel_indexed.graphmode_attention_ops = _sentinel_indexed_ops

# The same slip with a table sentinel of -3 (an outsider's zeta plugin, 2026-12-02): as an index it reads
# the third block from the end, which a test poisoning only the last block (-1's) passed.
THIRD_FROM_LAST = -3


def _table_of_minus_three(step) -> torch.Tensor:
    return torch.where(step.attn_metadata.block_offsets == 0, THIRD_FROM_LAST, step.attn_metadata.block_offsets).to(
        torch.int32)


@hookimpl
def _spec_of_minus_three() -> GraphSpec:
    return VEXA_SPEC.with_buffers(BufferSpec(
        "vexa_block_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=THIRD_FROM_LAST, source=_table_of_minus_three,
    ))


minus_three_indexed = types.SimpleNamespace(
    __name__="vexa_minus_three_indexed", __version__=__version__,
    **{name: getattr(sentinel_indexed, name) for name in dir(sentinel_indexed) if name.startswith("graphmode_")},
)
minus_three_indexed.graphmode_graph_spec = _spec_of_minus_three

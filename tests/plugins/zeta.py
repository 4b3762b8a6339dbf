"""An outsider's plugin for the imaginary Zeta accelerator, written from the
docs alone (trial 22), with the default capture policy: the suite must pass
on it (tests/test_conformance_suite.py). Kept as written, but for its
``capture_sizes=power_of_two_sizes``, a workaround for the suite's replay
count that the fix made unnecessary.

Zeta's decode kernel takes the kv lengths as a *host* list (like Ascend's FIA),
so graphs freeze them: the plugin declares a host buffer, declares the
host_kv_lengths capability, and pushes the bucket's lengths into every captured
decode call before each replay (graphmode_update_graph_params). On the CPU the
kernel is a torch custom operator that a Zeta emulated graph records as an
updatable call (docs/emulator.md, "An updatable operator").
"""
from __future__ import annotations

import sys
import types
from typing import List  # noqa: UP035 (torch 2.5 infers custom-op schemas from typing.List only)

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.attention import ReferenceAttentionOps, attend, owned_positions
from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord
from graphmode.graphs import DeviceGraph
from graphmode.spec import CUDA_SPEC, BufferSpec

__version__ = "0.1.0"
plugin = sys.modules[__name__]  # for --plugin plugins.zeta:plugin

HOST_LENS = "zeta_kv_lens"  # the host buffer of kv lengths the decode kernel takes


# ---------------------------------------------------------------- the kernel
@torch.library.custom_op("zeta::paged_decode", mutates_args=())
def zeta_paged_decode(
    query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
    block_offsets: torch.Tensor, kv_lens: List[int], scale: float,  # noqa: UP006 (torch 2.5's custom_op takes typing.List only)
) -> torch.Tensor:
    """query (B, H, D); k/v_blocks (num_blocks, block_size, K, D); kv_lens a host list of B ints."""
    B = query.shape[0]
    keys = k_blocks[block_offsets.long()].flatten(1, 2)  # (B, W*bs, K, D)
    values = v_blocks[block_offsets.long()].flatten(1, 2)
    # A row past the end of the list sees nothing here; a device kernel would read past the host array
    # (the conformance suite names a list shorter than the bucket).
    lens = torch.tensor((kv_lens + [0] * B)[:B], dtype=torch.long)
    positions = torch.arange(keys.shape[1])
    visible = positions[None, :] < lens[:, None]
    visible &= owned_positions(block_offsets, keys.shape[1])
    return attend(query, keys, values, visible, scale)


@zeta_paged_decode.register_fake
def _(query, k_blocks, v_blocks, block_offsets, kv_lens, scale):
    return torch.empty_like(query)


class ZetaAttentionOps(ReferenceAttentionOps):
    """The CUDA layout, with Zeta's decode kernel taking host kv lengths."""

    contract = "zeta"

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] != attn.block_offsets.shape[0]:
            raise NotImplementedError(
                f"Zeta's decode kernel takes one query per sequence: got {query.shape[0]} tokens for "
                f"{attn.block_offsets.shape[0]} sequences"
            )
        host = attn.vendor_fields.get(HOST_LENS) if attn.vendor_fields else None
        if host is None:  # eager step: the engine's host lengths, else read them back (eager only)
            host = attn.kv_seqlens_cpu if attn.kv_seqlens_cpu is not None else attn.kv_seqlens.cpu()
        lens = [int(x) for x in host.tolist()]  # a host tensor: frozen at capture, updated before replays
        head_dim = query.shape[-1]
        return zeta_paged_decode(
            query, self.block_view(k_cache, head_dim), self.block_view(v_cache, head_dim),
            attn.block_offsets, lens, float(scale),
        )


# ---------------------------------------------------------------- the graph
class UpdatableCall:
    def __init__(self):
        self.steps = []

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes):
        record = self.steps[0]
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)


class ZetaEmulatedGraph(EmulatedGraph):
    """Zeta's runtime on the CPU: decode calls are updatable with new host kv lengths."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def reset(self):
        self.calls = []
        return super().reset()

    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.zeta.paged_decode.default:
            return session.record(func, args, kwargs)
        call = UpdatableCall()
        session.append(call)
        with session.nested(call.steps):
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        self.calls.append(call)
        return outputs

    def update_kv_lens(self, lens: list[int]):
        for call in self.calls:
            call.update(kv_lens=lens)


# ---------------------------------------------------------------- hooks
@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    try:
        import torch_zeta  # noqa: F401
    except ImportError as error:
        version, detected, reason = None, False, f"torch_zeta is not installed ({error})"
    else:
        version = torch_zeta.__version__
        detected = torch_zeta.is_available()
        reason = f"{torch_zeta.device_count()} Zeta device(s)" if detected else "no Zeta device is visible"
    return VendorInfo(
        name="zeta", device_types=("zeta",), runtime="torch_zeta", runtime_version=version,
        detected=detected, reason=reason, capabilities=("host_kv_lengths",),
    )


ZETA_SPEC = CUDA_SPEC.with_buffers(
    # Host kv lengths for the decode kernel; padding 1: one token of the reserved block 0.
    BufferSpec(HOST_LENS, torch.int32, padding=1, host=True, source="attn_metadata.kv_seqlens_cpu"),
).replace(block_sizes=(16, 32))


@hookimpl
def graphmode_graph_spec():
    return ZETA_SPEC


@hookimpl
def graphmode_attention_ops():
    return ZetaAttentionOps()


@hookimpl
def graphmode_make_graph(meta):
    if meta.device.type == "cpu":
        return ZetaEmulatedGraph()
    return None  # on a Zeta device: torch_zeta's graph (not modelled here)


@hookimpl
def graphmode_update_graph_params(graph, meta, batch_size, bucket):
    # Every row of the bucket, padding rows included (their declared padding, 1).
    lens = meta.input_buffers[HOST_LENS][:bucket].tolist()  # host buffer: no device sync
    graph.update_kv_lens([int(x) for x in lens])


# ---------------------------------------------------------------- its slips
# The outsider's planted slips (trial 22), each the plugin with one hook
# changed, for the checks that catch them.
def _with(name: str, **changes):
    slipped = types.SimpleNamespace(__name__=name, __version__=__version__)
    for attr in dir(plugin):
        if attr.startswith("graphmode_"):
            setattr(slipped, attr, getattr(plugin, attr))
    for attr, function in changes.items():
        setattr(slipped, attr, function)
    return slipped


@hookimpl
def _push_live_rows_only(graph, meta, batch_size, bucket):
    live = [int(x) for x in meta.input_buffers[HOST_LENS][:batch_size].tolist()]
    for call in graph.calls:  # only the live rows change; keep the rest of the call's list
        previous = call.steps[0].kwargs["kv_lens"]
        call.update(kv_lens=live + list(previous[batch_size:]))


@hookimpl
def _push_batch_rows_only(graph, meta, batch_size, bucket):
    graph.update_kv_lens([int(x) for x in meta.input_buffers[HOST_LENS][:batch_size].tolist()])  # not [:bucket]


@hookimpl
def _push_first_call_only(graph, meta, batch_size, bucket):
    graph.calls[0].update(kv_lens=[int(x) for x in meta.input_buffers[HOST_LENS][:bucket].tolist()])  # layer 0 alone


@hookimpl
def _host_lengths_padded_with_minus_one():
    # "-1 writes nothing" copied from the slot buffer onto a length buffer.
    return ZETA_SPEC.with_buffers(
        BufferSpec(HOST_LENS, torch.int32, padding=-1, host=True, source="attn_metadata.kv_seqlens_cpu"),
    )


class _Handle:
    """A runtime's handle between a DeviceGraph wrapper and its graph."""

    def __init__(self, graph):
        self.graph = graph


class _ListHandle:
    """A handle keeping its graph in a list, where no attribute names it."""

    def __init__(self, graph):
        self.graphs = [graph]

    @property
    def graph(self):
        return self.graphs[0]


class WrappedZetaGraph(DeviceGraph):
    """Zeta's emulated graph behind a DeviceGraph wrapper of a runtime of
    another interface, two objects down (wrapper -> handle -> graph)."""

    def __init__(self, handle):
        self.handle = handle

    def capture_begin(self, pool=None):
        self.handle.graph.capture_begin(pool)

    def capture_end(self):
        self.handle.graph.capture_end()

    def replay(self):
        self.handle.graph.replay()

    def reset(self):
        self.handle.graph.reset()

    def pool(self):
        return self.handle.graph.pool()

    def update_kv_lens(self, lens):
        self.handle.graph.update_kv_lens(lens)


def _wrapped(handle):
    @hookimpl
    def graphmode_make_graph(meta):
        return WrappedZetaGraph(handle(ZetaEmulatedGraph())) if meta.device.type == "cpu" else None

    return graphmode_make_graph


pushed_first_call_only = _with("zeta_pushed_first_call_only", graphmode_update_graph_params=_push_first_call_only)
pushed_batch_rows_only = _with("zeta_pushed_batch_rows_only", graphmode_update_graph_params=_push_batch_rows_only)
pushed_live_rows_only = _with("zeta_pushed_live_rows_only", graphmode_update_graph_params=_push_live_rows_only)
lengths_padded_with_minus_one = _with("zeta_lengths_padded_with_minus_one",
                                      graphmode_graph_spec=_host_lengths_padded_with_minus_one)
wrapped_pushed_batch_rows_only = _with("zeta_wrapped_pushed_batch_rows_only",
                                       graphmode_update_graph_params=_push_batch_rows_only,
                                       graphmode_make_graph=_wrapped(_Handle))
graph_out_of_sight = _with("zeta_graph_out_of_sight", graphmode_make_graph=_wrapped(_ListHandle))

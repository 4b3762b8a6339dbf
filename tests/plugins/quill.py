"""An outsider's plugin for the imaginary Quill accelerator, written from the
docs alone by the third outsider probe (2026-11-26), kept as a test plugin:
the suite passes it (tests/test_conformance_suite.py), and its planted slips
below are caught, each named by its mechanism.

Quill differs from CUDA (and from acme, zeta and vexa):
- one fused KV tensor per layer, head-major, (num_blocks, 2, kv_heads,
  block_size, head_dim): the (key, value) pair graphmode passes are its two
  halves, and the cache kernel writes both in one call into the fused tensor;
- the decode kernel takes cumulative kv starts (``cu_seqlens_k``, batch + 1
  rows, computed on the device from ``kv_seqlens``) and a *tight* host bound
  ``max_seqlen_k``: it reads at most that many tokens per sequence (its split
  plan is sized by it). Graph contexts pass the block table's capacity
  (``max_kv_policy="capacity"``), and the plugin pushes the bucket's longest
  host kv length into every captured decode call before each replay.
On the CPU the decode kernel is a torch custom operator that Quill's emulated
graph records as an updatable call (docs/emulator.md, "An updatable operator").
"""


from __future__ import annotations

import sys
import types

import torch

from graphmode import VendorInfo, hookimpl
from graphmode.attention import attend, owned_positions
from graphmode.emulator import EmulatedGraph
from graphmode.emulator.capture import named_arguments
from graphmode.emulator.recording import OpRecord
from graphmode.spec import CUDA_SPEC, TOKENS, BufferSpec, GraphSpec

__version__ = "0.1.0"
plugin = sys.modules[__name__]  # for --plugin plugins.quill:plugin


# ---------------------------------------------------------------- kernels (PyTorch stand-ins)

@torch.library.custom_op("quill::reshape_and_cache", mutates_args=("kv",))
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """kv: (num_blocks, 2, H, bs, D). slot < 0 writes nothing."""
    block_size = kv.shape[3]
    slots = slots.reshape(-1).long()
    live = slots >= 0
    safe = torch.where(live, slots, 0)
    blocks, offsets = safe // block_size, safe % block_size
    for half, new in ((0, key), (1, value)):
        old = kv[blocks, half, :, offsets]  # (T, H, D)
        kv[blocks, half, :, offsets] = torch.where(live[:, None, None], new.to(kv.dtype), old)


@torch.library.custom_op("quill::paged_decode", mutates_args=())
def paged_decode(
    query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int, scale: float,
) -> torch.Tensor:
    """One query per sequence. Sequence b's kv length is cu_seqlens_k[b+1] - cu_seqlens_k[b];
    reads at most max_seqlen_k tokens (must be > 0)."""
    if max_seqlen_k <= 0:
        raise RuntimeError(f"quill paged_decode: max_seqlen_k={max_seqlen_k} must be positive")
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    blocks = kv[block_table.long()]  # (B, W, 2, H, bs, D)
    keys = blocks[:, :, 0].transpose(2, 3).flatten(1, 2)  # (B, W*bs, H, D)
    values = blocks[:, :, 1].transpose(2, 3).flatten(1, 2)
    positions = torch.arange(keys.shape[1], device=query.device)
    visible = (positions[None, :] < lengths[:, None]) & (positions[None, :] < max_seqlen_k)
    visible &= owned_positions(block_table, keys.shape[1])
    return attend(query, keys, values, visible, scale)


@paged_decode.register_fake
def _(query, kv, block_table, cu_seqlens_k, max_seqlen_k, scale):
    return torch.empty_like(query)


def fused_of(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The layer's fused (num_blocks, 2, H, bs, D) tensor the two halves are views of."""
    half = v_cache.storage_offset() - k_cache.storage_offset()
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr() or half <= 0:
        raise RuntimeError("quill: key and value caches are not the halves of one fused tensor")
    nb, h, bs, d = k_cache.shape
    s = k_cache.stride()
    return k_cache.as_strided((nb, 2, h, bs, d), (s[0], half, s[1], s[2], s[3]), k_cache.storage_offset())


class QuillAttentionOps:
    layout = "[num_blocks, kv_heads, block_size, head_dim] (key and value halves of one fused tensor)"
    contract = "quill"

    def cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def make_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        caches = []
        for _ in range(num_layers):
            fused = torch.zeros(num_blocks, 2, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
            caches.append((fused[:, 0], fused[:, 1]))
        return caches

    def block_view(self, cache, head_dim):
        return cache.transpose(1, 2)

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        torch.ops.quill.reshape_and_cache(key, value, fused_of(k_cache, v_cache), attn.kv_start_indices)

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] != attn.block_offsets.shape[0]:
            raise RuntimeError(
                f"quill paged_decode takes one query per sequence: {query.shape[0]} tokens for "
                f"{attn.block_offsets.shape[0]} sequences"
            )
        cu_seqlens_k = torch.nn.functional.pad(attn.kv_seqlens.cumsum(0), (1, 0)).to(torch.int32)
        return torch.ops.quill.paged_decode(
            query, fused_of(k_cache, v_cache), attn.block_offsets, cu_seqlens_k, int(attn.max_kv_seq_len), scale
        )

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        kb = self.block_view(k_cache, head_dim)[attn.block_offsets.long()].flatten(1, 2)
        vb = self.block_view(v_cache, head_dim)[attn.block_offsets.long()].flatten(1, 2)
        out = torch.empty_like(query)
        rows = zip(attn.q_start_loc.tolist(), attn.q_seqlens.tolist(), attn.kv_seqlens.tolist())
        for seq, (start, q_len, kv_len) in enumerate(rows):
            keys, values = kb[seq, :kv_len], vb[seq, :kv_len]
            positions = torch.arange(kv_len - q_len, kv_len, device=query.device)
            visible = torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None]
            out[start : start + q_len] = attend(
                query[start : start + q_len], keys.expand(q_len, -1, -1, -1),
                values.expand(q_len, -1, -1, -1), visible, scale,
            )
        return out


# ---------------------------------------------------------------- the runtime's graph (emulated)

class DecodeCall:
    """One captured paged_decode call whose max_seqlen_k an update may change."""

    def __init__(self):
        self.steps = []

    def replay_step(self):
        return lambda: self.steps[0].replay_step()()

    def update(self, **changes):
        record = self.steps[0]
        self.steps[0] = OpRecord(record.func, (), {**record.kwargs, **changes}, record.outputs, record.targets)


class QuillGraph(EmulatedGraph):
    """Quill's runtime graph on the emulator: paged_decode calls are updatable."""

    def __init__(self):
        super().__init__()
        self.decode_calls = []

    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.quill.paged_decode.default:
            return session.record(func, args, kwargs)
        call = DecodeCall()
        session.append(call)
        with session.nested(call.steps):
            outputs = session.record(func, (), named_arguments(func, args, kwargs))
        self.decode_calls.append(call)
        return outputs

    def reset(self):
        super().reset()
        self.decode_calls = []


# ---------------------------------------------------------------- hooks

QUILL_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("kv_start_indices", torch.int64, shape=(TOKENS,), padding=-1),
    # host copy of the kv lengths: the source of the tight bound pushed before each replay
    BufferSpec("kv_seqlens_cpu", torch.int32, padding=1, host=True, source="attn_metadata.kv_seqlens_cpu"),
).replace(
    block_sizes=(16, 32),
    max_kv_policy="capacity",  # positive at capture; the update hook tightens it per replay
)


@hookimpl
def graphmode_vendor_info() -> VendorInfo:
    return VendorInfo(
        name="quill", device_types=("quill",), runtime="torch_quill", runtime_version=None,
        detected=False, reason="torch_quill is not installed",
    )


@hookimpl
def graphmode_graph_spec() -> GraphSpec:
    return QUILL_SPEC


@hookimpl
def graphmode_attention_ops() -> QuillAttentionOps:
    return QuillAttentionOps()


@hookimpl
def graphmode_make_graph(meta):
    if meta.device.type == "cpu":
        return QuillGraph()
    return None


@hookimpl
def graphmode_update_graph_params(graph, meta, batch_size, bucket):
    bound = int(meta.input_buffers["kv_seqlens_cpu"][:bucket].max())
    for call in graph.decode_calls:
        call.update(max_seqlen_k=bound)


# ---------------------------------------------------------------- its slips
# The probe's planted slips, each the plugin with one hook changed, for the
# checks that catch them.
def _with(name: str, **changes):
    slipped = types.SimpleNamespace(__name__=name, __version__=__version__)
    for attr in dir(plugin):
        if attr.startswith("graphmode_"):
            setattr(slipped, attr, getattr(plugin, attr))
    for attr, function in changes.items():
        setattr(slipped, attr, function)
    return slipped


class _HostCuSeqlensOps(QuillAttentionOps):
    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        # The slip: cumulative starts from the host lengths, "already on the host, no kernel": a
        # host-to-device copy of pageable memory, which a capture refuses (CUDA) or freezes.
        cu_seqlens_k = torch.nn.functional.pad(attn.kv_seqlens_cpu.cumsum(0), (1, 0)).to(query.device, torch.int32)
        return torch.ops.quill.paged_decode(
            query, fused_of(k_cache, v_cache), attn.block_offsets, cu_seqlens_k, int(attn.max_kv_seq_len), scale
        )


@hookimpl
def _host_cu_seqlens_ops() -> QuillAttentionOps:
    return _HostCuSeqlensOps()


class _FusedByCopyOps(QuillAttentionOps):
    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        # The slip: the fused tensor "viewed" by stacking its halves, a new tensor: the write goes nowhere.
        torch.ops.quill.reshape_and_cache(key, value, torch.stack((k_cache, v_cache), dim=1), attn.kv_start_indices)


@hookimpl
def _fused_by_copy_ops() -> QuillAttentionOps:
    return _FusedByCopyOps()


class _ShiftedCuSeqlensOps(QuillAttentionOps):
    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        # The slip: the cumulative starts padded at the end, not the front: sequence b gets b + 1's length.
        cu_seqlens_k = torch.nn.functional.pad(attn.kv_seqlens.cumsum(0), (0, 1)).to(torch.int32)
        return torch.ops.quill.paged_decode(
            query, fused_of(k_cache, v_cache), attn.block_offsets, cu_seqlens_k, int(attn.max_kv_seq_len), scale
        )


@hookimpl
def _shifted_cu_seqlens_ops() -> QuillAttentionOps:
    return _ShiftedCuSeqlensOps()


@hookimpl(wrapper=True)
def _bound_at_capture(meta, inputs, batch_size, bucket):
    # The slip: the bound computed where the context is made, which runs before each capture only.
    meta.vendor_state["max_seqlen_k"] = int(inputs.attn_metadata.kv_seqlens_cpu[:batch_size].max())
    return (yield)


@hookimpl
def _push_bound_kept_at_capture(graph, meta, batch_size, bucket):
    for call in graph.decode_calls:
        call.update(max_seqlen_k=meta.vendor_state["max_seqlen_k"])


@hookimpl
def _push_bound_off_by_one(graph, meta, batch_size, bucket):
    bound = int(meta.input_buffers["kv_seqlens_cpu"][:bucket].max()) - 1  # the slip: the last position, not a length
    for call in graph.decode_calls:
        call.update(max_seqlen_k=bound)


cu_seqlens_from_host_lengths = _with("quill_cu_seqlens_from_host_lengths", graphmode_attention_ops=_host_cu_seqlens_ops)
bound_kept_at_capture = _with("quill_bound_kept_at_capture", graphmode_update_context=_bound_at_capture,
                              graphmode_update_graph_params=_push_bound_kept_at_capture)
bound_off_by_one = _with("quill_bound_off_by_one", graphmode_update_graph_params=_push_bound_off_by_one)
fused_rebuilt_by_copy = _with("quill_fused_rebuilt_by_copy", graphmode_attention_ops=_fused_by_copy_ops)
cu_seqlens_padded_at_the_end = _with("quill_cu_seqlens_padded_at_the_end", graphmode_attention_ops=_shifted_cu_seqlens_ops)

"""Deliberately broken vendor plugins, one per bug class.

Each is a copy of a real plugin with one hook changed, the way real vendor
bugs look. The suite must fail on every one, its first failure naming the
hook and the mechanism, and pass on the unchanged originals
(``tests/test_conformance_suite.py``). Point the suite at one, from tests/,
with ``graphmode conformance --device cpu --plugin broken_plugins:NAME``
(plus the options in ``OPTIONS`` where it has some).

They live here, not in the conformance package, which imports no vendor
package.
"""

from __future__ import annotations

import bisect
import dataclasses
import types
import weakref
from typing import Any
from weakref import WeakSet

import acme_vendor as acme
import plugins.zeta as zeta
import torch

import graphmode.default as cuda
import graphmode_ascend.plugin as ascend
import graphmode_camb.plugin as camb
import graphmode_maca.plugin as maca
import graphmode_ppu.plugin as ppu
from graphmode import buffers, hookimpl
from graphmode.attention import ReferenceAttentionOps, attend, owned_positions, token_rows
from graphmode.buckets import next_power_of_2, smallest_bucket
from graphmode.emulator import stream_order
from graphmode.emulator.capture import named_arguments
from graphmode.graphs import DeviceGraph, make_device_graph
from graphmode.spec import BLOCKS, CUDA_VENDOR_SPEC, SEQUENCES, TOKENS, BufferSpec
from graphmode.vendor_info import probe_runtime
from graphmode_ascend.advice import capture_advice
from graphmode_ascend.graph import AscendGraph, resolve_update_path
from graphmode_camb.ops import CambAttentionOps

__all__ = ["BROKEN", "OPTIONS", "ORIGINALS", "variant"]


def variant(base: Any, name: str, **changes: Any) -> types.SimpleNamespace:
    """A plugin object with every hook implementation of ``base``, the given
    ones replaced (None: left out)."""
    plugin = types.SimpleNamespace(__name__=name, __version__="broken")
    for attr in dir(base):
        if attr.startswith("graphmode_"):
            setattr(plugin, attr, getattr(base, attr))
    for attr, function in changes.items():
        if function is None:
            delattr(plugin, attr)  # the hook not implemented at all
        else:
            setattr(plugin, attr, function)
    return plugin


# 1. Padding slots index 0 instead of -1: padding rows write into slot 0,
#    the reserved block.
@hookimpl(wrapper=True)
def _slot_zero(meta):
    buffers = yield
    buffers["kv_start_indices"].zero_()
    return buffers


# 2. Padding not reset after a larger batch (upstream Camb and MACA): stale
#    slots of the earlier batch's sequences stay in the padding rows.
@hookimpl
def _live_rows_only(meta, inputs, batch_size, bucket):
    buffers.fill(meta, inputs, batch_size, batch_size)  # the batch as the bucket: no padding rows reset
    return True


# 3. The step context not pointed at a buffer: the graph reads a copy made at
#    capture, never refilled.
@hookimpl(wrapper=True)
def _context_copy(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.kv_seqlens = static.attn_metadata.kv_seqlens.clone()
    return static


# 4. A max length frozen at capture (upstream PPU's .item()): the kernel keeps
#    reading only the capture step's longest sequence.
@hookimpl(wrapper=True)
def _frozen_max_len(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_kv_seq_len = inputs.attn_metadata.max_kv_seq_len
    return static


# 5. Host kv lengths never pushed into the graph.
@hookimpl
def _no_update(graph, meta, batch_size, bucket):
    return None


# 6. A compatible size smaller than the batch.
@hookimpl
def _bucket_below_batch(batch_size, capture_sizes):
    fitting = [size for size in capture_sizes if size <= batch_size]
    return fitting[-1] if fitting else smallest_bucket(batch_size, capture_sizes)


# 7. Capture at a size other than the bucket: the context holds the batch's
#    rows, so the graph computes only as many rows as its capture step had.
@hookimpl
def _capture_at_batch_size(meta, inputs, batch_size, bucket):
    return cuda.graphmode_update_context(meta, inputs, batch_size, batch_size)


# 7b. A context field narrowed at capture (a red-team slip, 2026-12-06): the block table cut to the
#     capture step's width ("the kernel reads only the columns in use"), which the graph then replays for
#     every later step, whose longer sequences' further blocks it never reads.
@hookimpl(wrapper=True)
def _table_narrowed_at_capture(meta, inputs, batch_size, bucket):
    static = yield
    width = inputs.attn_metadata.block_offsets.shape[-1]
    static.attn_metadata.block_offsets = static.attn_metadata.block_offsets[:, :width]
    return static


# 8. Outputs not cut to the live batch.
@hookimpl
def _unsliced_outputs(meta, batch_size, num_tokens):
    return meta.output_buffers["output"]


# 9. A -1 ("derive it") max length given to a kernel without that rule: PPU's
#    FlashAttention varlen kernel returns zeros for max_seqlen_k <= 0.
@hookimpl(wrapper=True)
def _minus_one_max_len(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_kv_seq_len = -1
    return static


# 10. Padding reset only over the rows this bucket's own previous step used
#     (each bucket remembers its last batch): right while one bucket runs,
#     stale once a larger bucket has written those rows in between.
@hookimpl
def _reset_own_rows_only(meta, inputs, batch_size, bucket):
    last = meta.vendor_state.setdefault("last_batch", {})
    previous = last.get(bucket, batch_size)
    buffers.fill(meta, inputs, batch_size, batch_size)  # live rows only
    _reset_rows(meta, batch_size, max(previous, batch_size))
    last[bucket] = batch_size
    return True


# 11. Padding reset only when the bucket changes (a step in the same bucket
#     as the last one "has clean padding already"): stale after a shrink.
@hookimpl
def _reset_on_bucket_change(meta, inputs, batch_size, bucket):
    changed = meta.vendor_state.get("last_bucket") != bucket
    buffers.fill(meta, inputs, batch_size, bucket if changed else batch_size)
    meta.vendor_state["last_bucket"] = bucket
    return True


def _reset_rows(meta, start: int, stop: int) -> None:
    """Padding for rows start..stop-1 of every written buffer (decode: one token per row)."""
    for spec in meta.spec.buffers:
        if spec.written and stop > start:
            buffer, padding = meta.input_buffers[spec.name], meta.padding_buffers[spec.name]
            buffer.narrow(spec.row_dim, start, stop - start).copy_(padding.narrow(spec.row_dim, start, stop - start))


# 12. Padding reset up to the next power of two above the batch, not the
#     bucket: right for power-of-two capture lists only.
@hookimpl
def _reset_to_power_of_two(meta, inputs, batch_size, bucket):
    buffers.fill(meta, inputs, batch_size, min(next_power_of_2(batch_size), meta.max_batchs))
    return True


# 13. MACA's kernels need padding kv length 0 (declared); the fill writes
#     CUDA's 1 into the padding rows.
@hookimpl(wrapper=True)
def _cuda_padding_kv_length(meta, inputs, batch_size, bucket):
    result = yield
    meta.input_buffers["kv_seqlens"][batch_size:bucket] = 1
    return result


# 14. A device-to-host read in the fill (upstream PPU's .item() of the max length).
@hookimpl
def _fill_reading_max_len(meta, inputs, batch_size, bucket):
    meta.vendor_state["max_kv_seq_len"] = int(inputs.attn_metadata.kv_seqlens.max().item())
    buffers.fill(meta, inputs, batch_size, bucket)
    return True


# 15. A device-to-host read in the parameter update: skip the push when no
#     row is live, asked of the device mask.
@hookimpl
def _update_asking_the_device(graph, meta, batch_size, bucket):
    if bool(meta.input_buffers["x_active_mask"][:bucket].any()):
        graph.push_kv_lengths(meta.input_buffers["kv_seqlens"][:bucket].tolist())


# 16. A device-to-host read in the outputs: the token count summed from the
#     device's q_seqlens.
@hookimpl
def _outputs_counting_on_the_device(meta, batch_size, num_tokens):
    tokens = int(meta.input_buffers["q_seqlens"][:batch_size].sum())
    return meta.output_buffers["output"][:, :tokens]


# 17. A parameter update that does not wait for the replay still reading the
#     previous values (Ascend's push without its stream wait).
class _SkipsTheWait(AscendGraph):
    def push_kv_lengths(self, lengths: list[int]) -> None:
        assert self._capture is not None
        if self.update_path == "graph_update":
            self.npu_graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])
        else:
            self._capture.update(lengths)


@hookimpl
def _graph_skipping_the_wait(meta):
    return _SkipsTheWait(meta.device, meta.vendor_options.update_path)


# 18. Outputs cut from the wrong rows: the last num_tokens rows, as if
#     padding came first.
@hookimpl
def _last_rows_as_outputs(meta, batch_size, num_tokens):
    return meta.output_buffers["output"][:, -num_tokens:]


# 19. The engine's input tensors modified: FIA's cumulative query lengths
#     computed in place, in the step's own q_seqlens.
@hookimpl(wrapper=True)
def _cumulative_lengths_in_place(meta, inputs, batch_size, bucket):
    q_seqlens = inputs.attn_metadata.q_seqlens
    torch.cumsum(q_seqlens, 0, out=q_seqlens)
    return (yield)


class _HotSoftmaxOps(ReferenceAttentionOps):
    """Decode attention at 1.5 times the softmax scale (a kernel that folds
    the scale in twice, say): wrong in graphs and eagerly alike."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        return super().paged_decode_attention(query, k_cache, v_cache, attn, scale * 1.5)


# 20. A kernel computing something else than its contract, in graphs and eagerly.
@hookimpl
def _hot_softmax_ops():
    return _HotSoftmaxOps()


class _OutOps(ReferenceAttentionOps):
    """The reference kernels with prefill attention taking ``out=`` (written
    and returned), as the CUDA plugin's Triton prefill does."""

    rows_written = 1.0  # the share of out's rows the out= path writes

    def prefill_attention(self, query, k_cache, v_cache, attn, scale, out=None):
        result = super().prefill_attention(query, k_cache, v_cache, attn, scale)
        if out is None:
            return result
        rows = int(out.shape[0] * self.rows_written)
        out[:rows].copy_(result[:rows])
        return out


class _HalfOutOps(_OutOps):
    """An ``out=`` path that writes only the first half of the rows (a kernel
    launched over too few blocks, say); without ``out`` it is right, so only
    piecewise graphs, which pass ``out``, would see it."""

    rows_written = 0.5


@hookimpl
def _out_ops():
    return _OutOps()


# 21. An out= kernel path that writes part of the rows.
@hookimpl
def _half_out_ops():
    return _HalfOutOps()


# -- Classes that passed the suite before issue 22 (realistic one-slip bugs) --


# 22. Outputs of a model returning several tensors: only the first is cut to
#     the live tokens; the others keep the bucket's padding rows.
@hookimpl
def _first_output_cut_only(meta, batch_size, num_tokens):
    output = meta.output_buffers["output"]
    if isinstance(output, torch.Tensor):
        return output[:, :num_tokens]
    if isinstance(output, (tuple, list)):
        return (output[0][:, :num_tokens], *output[1:])
    return output


class _PoolDroppingGraph(DeviceGraph):
    """The default device graph, captured without the pool the runner passes
    (``capture_begin()`` instead of ``capture_begin(pool)``): every graph
    gets a pool of its own. Outputs are right; graph memory grows with every
    bucket."""

    def __init__(self, device: torch.device) -> None:
        self.inner = make_device_graph(device)

    def capture_begin(self, pool: Any = None) -> None:
        self.inner.capture_begin()

    def capture_end(self) -> None:
        self.inner.capture_end()

    def replay(self) -> None:
        self.inner.replay()

    def reset(self) -> None:
        self.inner.reset()

    def pool(self) -> Any:
        return self.inner.pool()


# 23. Graphs captured outside the runner's shared memory pool.
@hookimpl
def _pool_dropping_graph(meta):
    return _PoolDroppingGraph(meta.device)


# 24. Detection from the probe's wording: "torch_mlu is not installed"
#     contains "installed", so the vendor says it is detected on any machine.
@hookimpl
def _detected_from_reason():
    version, _, reason = probe_runtime("torch_mlu", "mlu")
    info = camb.graphmode_vendor_info()
    return dataclasses.replace(info, runtime_version=version, detected="installed" in reason, reason=reason)


class _PlanCachingOps(ReferenceAttentionOps):
    """Prefill attention planned once per shape: the longest kv length (which
    bounds the keys it reads) is taken at the first call of each (tokens,
    sequences) and reused, as a kernel caching its split plan by shape does.
    Right while every shape comes with its own lengths; stale when chunked
    prefill repeats a chunk size with a longer context."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], int] = {}

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        key = (query.shape[0], attn.q_seqlens.shape[0])
        longest = self._plans.setdefault(key, int(attn.kv_seqlens.max()))
        planned = dataclasses.replace(attn, kv_seqlens=attn.kv_seqlens.clamp(max=longest))
        return super().prefill_attention(query, k_cache, v_cache, planned, scale)


# 25. A kernel's per-call plan cached under a key (the shapes) that repeats
#     while the lengths it was computed from change.
@hookimpl
def _plan_caching_ops():
    return _PlanCachingOps()


# -- More classes that passed the suite before issue 22: what outputs on the emulator do not show --


# 26. A device-to-host copy in the fill on every replay, the value landing in
#     a host buffer: Ascend's host kv lengths taken from the device's lengths
#     rather than the engine's host copy (results correct; a host
#     synchronisation per step on a device).
@hookimpl(wrapper=True)
def _device_lengths_into_host_buffer(meta, inputs, batch_size, bucket):
    result = yield
    meta.input_buffers["kv_seqlens"][:batch_size] = inputs.attn_metadata.kv_seqlens
    return result


# 27. The distributed backend answered from the device's string form:
#     "cuda" -> nccl, but "cuda:0" (an indexed device, as every rank passes
#     its own) -> gloo.
@hookimpl
def _dist_backend_from_string(device):
    return "nccl" if str(device) == "cuda" else "gloo"


# 28. Host kv lengths pushed into the graph for the live rows only, the
#     padding rows left as an earlier step pushed them (a host list kept
#     between steps): harmless on the emulator, whose kernel masks the
#     reserved block; on a device whose kernel trusts the lengths, padding
#     rows read that many tokens.
@hookimpl
def _push_live_rows_only(graph, meta, batch_size, bucket):
    pushed = meta.vendor_state.setdefault("pushed_lengths", [1] * meta.max_batchs)
    pushed[:batch_size] = meta.input_buffers["kv_seqlens"][:batch_size].tolist()
    graph.push_kv_lengths(pushed[:bucket])


# 29. Every graph graphmode_make_graph returned kept in a module-level
#     registry ("so the runtime's update stream can find every graph", trial
#     22): the graphs, and the memory they captured, outlive runner.reset()
#     and the runner itself; device memory grows with every reload while
#     every output is right.
_ALL_GRAPHS: list = []


@hookimpl
def _graphs_kept_in_a_registry(meta):
    graph = ascend.graphmode_make_graph(meta)
    _ALL_GRAPHS.append(graph)
    return graph


# -- Classes that passed the suite before 2026-11-26's probe (or failed it naming no hook) --


class _SplitMergeOps(ReferenceAttentionOps):
    """Decode attention whose split-KV merge keeps only the last four
    partitions of 64 tokens: right up to 256 cached tokens, wrong above (the
    harness's graphs hold at most 128)."""

    window = 256

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] != attn.block_offsets.shape[0]:
            return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)
        keys = self._gather(k_cache, attn.block_offsets, query.shape[-1])
        values = self._gather(v_cache, attn.block_offsets, query.shape[-1])
        positions = torch.arange(keys.shape[1], device=query.device)[None, :]
        limit = self._decode_limit(attn)
        visible = (positions < limit) & (positions >= limit - self.window)
        return attend(query, keys, values, visible & owned_positions(attn.block_offsets, keys.shape[1]), scale)


# 30. A kernel path taken for long contexts only.
@hookimpl
def _split_merge_ops():
    return _SplitMergeOps()


class _UniformOffsetOps(ReferenceAttentionOps):
    """Prefill attention with one causal offset for the whole batch, the
    first sequence's kv_len - q_len: right for fresh prefills (offset 0
    everywhere) and for one sequence, wrong in a mixed step of decodes and a
    chunk. Graphs and eager alike, so only the reference kernels see it."""

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        q_lens, kv_lens = attn.q_seqlens.tolist(), attn.kv_seqlens.tolist()
        offset = kv_lens[0] - q_lens[0]
        lengths = torch.tensor([min(offset + q, kv) for q, kv in zip(q_lens, kv_lens)], dtype=attn.kv_seqlens.dtype)
        planned = dataclasses.replace(attn, kv_seqlens=lengths.to(attn.kv_seqlens.device))
        return super().prefill_attention(query, k_cache, v_cache, planned, scale)


# 31. One causal offset for a mixed step's every sequence.
@hookimpl
def _uniform_offset_ops():
    return _UniformOffsetOps()


class _LaunchesOf32Ops(ReferenceAttentionOps):
    """Decode attention in launches of 32 sequences ("the kernel takes at
    most 32 per launch"), each later launch given the first rows' lengths:
    right up to 32 sequences, wrong above (a red-team slip, 2026-12-06; the
    kernel test decoded 5 sequences before)."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        batch = query.shape[0]
        if batch <= 32 or batch != attn.block_offsets.shape[0]:
            return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)
        parts = []
        for start in range(0, batch, 32):
            n = min(32, batch - start)
            part = attn.replace(block_offsets=attn.block_offsets[start:start + n], kv_seqlens=attn.kv_seqlens[:n])
            parts.append(super().paged_decode_attention(query[start:start + n], k_cache, v_cache, part, scale))
        return torch.cat(parts)


# 31b. A decode kernel path taken above 32 sequences only.
@hookimpl
def _launches_of_32_ops():
    return _LaunchesOf32Ops()


class _ConsecutiveSlotsOps(ReferenceAttentionOps):
    """A cache write whose bulk path (steps of more than 512 tokens) writes
    each sequence's tokens at consecutive slots from its first one: right
    while a sequence's blocks are consecutive, wrong where they are not
    (a red-team slip, 2026-12-06; no kernel-test step had 512 tokens)."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.kv_start_indices.reshape(-1).long()
        if slots.shape[0] > 512:
            starts = attn.q_start_loc.long()
            token = torch.arange(slots.shape[0], device=slots.device)
            row = torch.searchsorted(starts, token, right=True) - 1
            slots = slots[starts][row] + token - starts[row]
        super().fill_kv_cache(key, value, k_cache, v_cache, attn.replace(kv_start_indices=slots))


# 31c. A cache-write path taken above 512 tokens only.
@hookimpl
def _consecutive_slots_ops():
    return _ConsecutiveSlotsOps()


class _OwnScaleOps(ReferenceAttentionOps):
    """Decode attention that takes head_dim**-0.5 for the scale it is given
    (a vendor kernel's softmax_scale default): right for the reference
    model, which always passes it, wrong for any model with its own scale
    (a red-team slip, 2026-12-06)."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        return super().paged_decode_attention(query, k_cache, v_cache, attn, query.shape[-1] ** -0.5)


# 31d. The scale a kernel is given, ignored.
@hookimpl
def _own_scale_ops():
    return _OwnScaleOps()


# 32. x_active_mask declared per sequence ("one flag per request"): in a
#     graph of q_len 2 it has a flag for the first bucket tokens only.
@hookimpl
def _mask_per_sequence_spec():
    return ascend.ASCEND_SPEC.replace(buffers=tuple(
        dataclasses.replace(b, shape=(SEQUENCES,)) if b.name == "x_active_mask" else b
        for b in ascend.ASCEND_SPEC.buffers
    ))


# 33. Logits returned as float16 ("for the sampler"): at float32 they differ
#     from eager's by less than float16's precision, and torch.allclose
#     refuses to compare them ("Half did not match Float", naming nothing).
@hookimpl
def _outputs_as_half(meta, batch_size, num_tokens):
    return meta.output_buffers["output"][:, :num_tokens].to(torch.float16)


class _ClampedSlotOps(ReferenceAttentionOps):
    """A fill-cache kernel clamping slots to 0 ("negative slots are invalid
    indices"): every padding token writes slot 0 of the reserved block."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = self._slots(attn).clamp(min=0).long()
        for cache, values in ((k_cache, key), (v_cache, value)):
            blocks = self.block_view(cache, values.shape[-1])
            blocks[slots // blocks.shape[1], slots % blocks.shape[1]] = values.to(blocks.dtype)


# 34. Padding slots clamped to slot 0 in the fill-cache kernel.
@hookimpl
def _clamped_slot_ops():
    return _ClampedSlotOps()


# 35. A vendor declaring the host_staging capability whose own fill writes
#     the device buffers directly (its copies, not graphmode.buffers.stage):
#     right with device inputs; with host staging the pinned mirror's copy
#     overwrites every write before the replay.
@hookimpl
def _direct_fill(meta, inputs, batch_size, bucket):
    tokens = inputs.num_tokens
    for spec in meta.spec.buffers:
        if not spec.written:
            continue
        buffer, padding, row = meta.input_buffers[spec.name], meta.padding_buffers[spec.name], spec.row_dim
        live, full = (tokens, bucket * tokens // batch_size) if spec.per_token else (batch_size, bucket)
        buffer.narrow(row, 0, full).copy_(padding.narrow(row, 0, full))
        target = buffer.narrow(row, 0, live)
        if spec.live is not None:
            target.fill_(spec.live)
            continue
        if callable(spec.source):
            value = spec.source(inputs)
        else:
            value = next(v for v in (buffers.step_value(inputs, path) for path in spec.sources) if v is not None)
        if BLOCKS in spec.shape:
            target = target.narrow(spec.shape.index(BLOCKS), 0, value.shape[spec.shape.index(BLOCKS)])
        target.copy_(value.reshape(target.shape))
    return True


@hookimpl
def _info_with_host_staging():
    info = camb.graphmode_vendor_info()
    return dataclasses.replace(info, capabilities=info.capabilities | {"host_staging"})


# 36. The block table copied as a flat run of numel() elements from the step
#     tensor's first one (a copy by data_ptr and numel, as a C++ helper
#     does): right for a contiguous table, wrong for the first columns of an
#     engine's persistent wider table.
@hookimpl(wrapper=True)
def _flat_table_copy(meta, inputs, batch_size, bucket):
    result = yield
    table = inputs.attn_metadata.block_offsets
    flat = torch.as_strided(table, (table.numel(),), (1,), table.storage_offset())
    meta.input_buffers["block_offsets"][:batch_size, : table.shape[1]].copy_(flat.view(table.shape))
    return result


# 37. Host kv lengths double-buffered (two host lists taken in turn, so the
#     host never writes a list a replay may still read), the index slipped:
#     every replay in a bucket reads the previous step's lengths.
@hookimpl
def _push_previous(graph, meta, batch_size, bucket):
    lists = meta.vendor_state.setdefault("lengths", [None, None])
    turn = meta.vendor_state["turn"] = 1 - meta.vendor_state.get("turn", 0)
    lists[turn] = meta.input_buffers["kv_seqlens"][:bucket].tolist()
    previous = lists[1 - turn]
    graph.push_kv_lengths(previous if previous is not None and len(previous) == bucket else lists[turn])


# 38. The buffer slice to push from cached at module level per bucket ("no
#     slicing on the replay path"): a second runner pushes the first
#     runner's lengths.
_SLICES: dict[int, torch.Tensor] = {}


@hookimpl
def _push_from_a_cached_slice(graph, meta, batch_size, bucket):
    graph.push_kv_lengths(_SLICES.setdefault(bucket, meta.input_buffers["kv_seqlens"][:bucket]).tolist())


# -- Classes that passed the suite before the second probe of 2026-11-26:
#    integers the harness's small caches never reach --


# 39. The block table staged through int16 ("block ids fit in 16 bits"): right
#     for a cache of at most 32767 blocks; on a card holding more, block ids
#     wrap and a sequence reads another's blocks.
@hookimpl(wrapper=True)
def _table_through_int16(meta, inputs, batch_size, bucket):
    result = yield
    table = inputs.attn_metadata.block_offsets
    meta.input_buffers["block_offsets"][:batch_size, : table.shape[1]].copy_(table.to(torch.int16))
    return result


# 40. MACA's (max_batches, 1) slot column built with torch.where(slots >= 0,
#     slots, -1.0): the float scalar makes it float32, exact only below 2**24
#     slots, so on a large cache tokens write a neighbouring slot.
@hookimpl(wrapper=True)
def _slots_through_float(meta, inputs, batch_size, bucket):
    result = yield
    slots = inputs.attn_metadata.kv_start_indices
    column = torch.where(slots >= 0, slots, -1.0)
    meta.input_buffers["kv_start_indices"][: slots.shape[0]].copy_(column.view(-1, 1))
    return result


# 41. Ascend's host kv lengths passed through a host staging buffer of
#     int16: a context above 32767 tokens wraps, and FIA reads a short (or
#     negative) length.
@hookimpl(wrapper=True)
def _lengths_through_int16(meta, inputs, batch_size, bucket):
    result = yield
    lengths = inputs.attn_metadata.kv_seqlens_cpu
    if lengths is not None:
        staging = meta.vendor_state.get("lengths_int16")
        if staging is None:
            staging = meta.vendor_state["lengths_int16"] = buffers.host_zeros(meta, (meta.max_batchs,), torch.int16)
        staging[:batch_size].copy_(lengths)
        meta.input_buffers["kv_seqlens"][:batch_size].copy_(staging[:batch_size])
    return result


# 42. A per-token block buffer of the vendor's own declared int16 ("block
#     ids per token, keep it small"): the declaration checks accept any
#     integer dtype for a buffer that is not a required one.
@hookimpl
def _slot_blocks_int16_spec():
    return acme.ACME_SPEC.replace(buffers=tuple(
        dataclasses.replace(b, dtype=torch.int16) if b.name == "slot_blocks" else b for b in acme.ACME_SPEC.buffers
    ))


# 43. q_start_loc (written by no step) padded with 0, as the lengths' padding
#     is a number: every sequence of a graph starts at token 0. Decode of one
#     token per sequence never reads it; a graph of q_len 2 does.
@hookimpl
def _query_starts_zero_spec():
    return CUDA_VENDOR_SPEC.replace(buffers=tuple(
        dataclasses.replace(b, padding=0) if b.name == "q_start_loc" else b for b in CUDA_VENDOR_SPEC.buffers
    ))


# 44. A fill copying only the block-table entries that changed since the
#     last step (a decode step adds a block now and then), the last step's
#     table kept by reference: right while the engine passes a fresh tensor
#     every step; an engine writing one persistent table in place makes the
#     kept table this step's, so nothing "changed" and nothing is copied.
@hookimpl
def _changed_entries_only(meta, inputs, batch_size, bucket):
    table = inputs.attn_metadata.block_offsets
    rows = meta.input_buffers["block_offsets"][:batch_size, : table.shape[1]]
    before = rows.clone()
    buffers.fill(meta, inputs, batch_size, bucket)
    last = meta.vendor_state.get("last_table")
    if last is not None and last.shape == table.shape:
        rows.copy_(torch.where(table != last, table, before))
    meta.vendor_state["last_table"] = table
    return True



# -- Classes that passed the suite before the third probe of 2026-11-26 (or
#    failed it naming no hook): the recent features --


class _ContiguousCacheOps(CambAttentionOps):
    """Camb's decode kernel gathering from a contiguous copy of the whole
    cache ("the kernel wants [blocks, block, heads, dim]"): Camb's layout is
    [blocks, heads, block, dim], its block view a transpose. Outputs are right;
    each graph holds a copy of the cache in its pool."""

    def _gather(self, cache, block_offsets, head_dim):
        blocks = self.block_view(cache, head_dim).contiguous()[block_offsets.long()]
        batch, width, block_size, kv_heads, dim = blocks.shape
        return blocks.reshape(batch, width * block_size, kv_heads, dim)


# 45. Graph memory that grows with the KV cache: plan_memory() on a probe
#     cache of a few blocks says too little, and an engine sizing its cache
#     from the plan runs out of memory at warm-up.
@hookimpl
def _contiguous_cache_ops():
    return _ContiguousCacheOps()


class _NotCausalVerifyOps(ReferenceAttentionOps):
    """MACA's decode of several tokens per sequence through
    flash_attn_with_kvcache without causal=True (its default is False): each
    new token sees all of its sequence's new tokens. One-token decode is right."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if query.shape[0] == attn.block_offsets.shape[0]:
            return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)
        keys = self._gather(k_cache, attn.block_offsets, query.shape[-1])
        values = self._gather(v_cache, attn.block_offsets, query.shape[-1])
        positions = torch.arange(keys.shape[1], device=query.device)
        owned = owned_positions(attn.block_offsets, keys.shape[1])
        row, _ = token_rows(attn, query.shape[0])
        visible = (positions[None, :] < self._decode_limit(attn)[row]) & owned[row]
        return attend(query, keys[row], values[row], visible, scale)


# 46. Verify (multi-token decode) attention not causal among the new tokens:
#     graphs equal eager (the same kernel), both wrong.
@hookimpl
def _not_causal_verify_ops():
    return _NotCausalVerifyOps()


# 47. The distributed backend answered for every device: "hccl" on cpu too,
#     where the emulator's tensor-parallel runs need gloo.
@hookimpl
def _hccl_for_every_device(device):
    return "hccl"


# 48. Ascend's capture advice matched on the word "stream": PyTorch's own
#     "operation not permitted when stream is capturing" (a host sync in the
#     forward) becomes advice to capture fewer sizes.
@hookimpl
def _advice_on_any_stream_error(error, meta, bucket):
    if "stream" in str(error).lower():
        error = RuntimeError(f"{error} (error 207008: Stream resources are insufficient)")
    captured = list(meta.vendor_state.get("captured_graphs", ()))
    pieces = None if meta.family != "piecewise" else sum(graph.piece for graph in captured)
    return capture_advice(error, bucket, len(captured), list(meta.capture_sizes), pieces)


class _AccumulatingOutOps(_OutOps):
    """A prefill kernel whose out= path adds its result to out (a split-KV
    merge written for a zeroed out)."""

    def prefill_attention(self, query, k_cache, v_cache, attn, scale, out=None):
        result = ReferenceAttentionOps.prefill_attention(self, query, k_cache, v_cache, attn, scale)
        if out is None:
            return result
        out += result
        return out


# 49. An out= path accumulating into out: piecewise graphs pass rows of a
#     buffer holding the previous step's attention.
@hookimpl
def _accumulating_out_ops():
    return _AccumulatingOutOps()


# 50. A fill of the vendor's own declarations (its module's GraphSpec, not
#     meta.spec): the engine's declared step inputs (LoRA ids, sampling
#     parameters) are never copied, their buffers hold padding.
@hookimpl
def _fill_of_the_vendors_own_spec(meta, inputs, batch_size, bucket):
    buffers.fill(dataclasses.replace(meta, spec=camb.CAMB_SPEC), inputs, batch_size, bucket)
    return True


# 51. Acme's block input computed from the slot buffer the default fill has
#     just written ("the slots are in the buffer already"), with host
#     staging declared: with host inputs the fill stages a device tensor (on
#     a device, the arena holds the previous step's slots until the copy).
_ACME_SPEC_OWN_BLOCKS = acme.ACME_SPEC.with_buffers(
    dataclasses.replace(next(b for b in acme.ACME_SPEC.buffers if b.name == "slot_blocks"), source=None))


@hookimpl
def _acme_spec_own_blocks():
    return _ACME_SPEC_OWN_BLOCKS


@hookimpl(wrapper=True)
def _blocks_from_the_slot_buffer(meta, inputs, batch_size, bucket):
    done = yield
    tokens = inputs.num_tokens
    rows = bucket * (tokens // batch_size)
    slots = meta.input_buffers["kv_start_indices"][:tokens]
    target, padding = meta.input_buffers["slot_blocks"], meta.padding_buffers["slot_blocks"]
    live = torch.where(slots >= 0, slots // acme.BLOCK_SIZE, 0).to(torch.int32)
    buffers.stage(meta, [(target[:tokens], live), (target[tokens:rows], padding[tokens:rows])])
    return done


@hookimpl
def _acme_info_with_host_staging():
    info = acme.graphmode_vendor_info()
    return dataclasses.replace(info, capabilities=info.capabilities | {"host_staging"})


# -- Classes the suite missed or misnamed before the fourth probe of 2026-11-26 --


# 52. The three length buffers made as columns of one (max_batchs, 3) tensor
#     (lmdeploy's (3, max_batchs) transposed): each is strided, and a device
#     kernel reading one by its pointer reads the others' values in between.
@hookimpl(wrapper=True)
def _length_columns(meta):
    made = yield
    names = ("q_start_loc", "q_seqlens", "kv_seqlens")
    columns = torch.stack([made[name] for name in names], dim=1)
    for index, name in enumerate(names):
        made[name] = columns[:, index]
    return made


# 53. One graph object for the whole runner, kept in meta.vendor_state ("the
#     runner's graph"): the second bucket's capture recaptures the first's.
@hookimpl
def _one_graph_per_runner(meta):
    return meta.vendor_state.setdefault("graph", make_device_graph(meta.device))


# 54. kv lengths padded into a new tensor each step, stored back into
#     meta.input_buffers: graphs keep reading the tensor they were captured
#     with, which later steps never write.
@hookimpl(wrapper=True)
def _lengths_replaced(meta, inputs, batch_size, bucket):
    result = yield
    lengths = meta.padding_buffers["kv_seqlens"].clone()
    lengths[:batch_size] = inputs.attn_metadata.kv_seqlens
    meta.input_buffers["kv_seqlens"] = lengths
    return result


# 55. Per-token padding reset up to the bucket, not bucket x q_len: right for
#     one-token decode; in a graph of q_len 2 the token rows past the bucket
#     keep an earlier step's slots, which its padding tokens write.
@hookimpl(wrapper=True)
def _token_padding_to_the_bucket(meta, inputs, batch_size, bucket):
    tokens = inputs.num_tokens
    rows, start = bucket * (tokens // batch_size), max(tokens, bucket)
    kept = {b.name: meta.input_buffers[b.name].clone() for b in meta.spec.buffers if b.per_token and b.written}
    result = yield
    for spec in meta.spec.buffers:
        if spec.name in kept and rows > start:
            meta.input_buffers[spec.name].narrow(spec.row_dim, start, rows - start).copy_(
                kept[spec.name].narrow(spec.row_dim, start, rows - start))
    return result


# 56. PPU's bound as the last position of a full table, not its length
#     (capacity - 1): a sequence filling its table reads one key too few.
@hookimpl(wrapper=True)
def _max_len_one_below_capacity(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_kv_seq_len = meta.num_blocks * meta.block_size - 1
    return static

BROKEN = {
    "slot_zero_padding": variant(cuda, "slot_zero_padding", graphmode_make_buffers=_slot_zero),
    "stale_padding": variant(camb, "stale_padding", graphmode_fill_buffers=_live_rows_only),
    "context_not_on_buffer": variant(cuda, "context_not_on_buffer", graphmode_update_context=_context_copy),
    "frozen_max_len": variant(camb, "frozen_max_len", graphmode_update_context=_frozen_max_len),
    "kv_lengths_never_pushed": variant(ascend, "kv_lengths_never_pushed", graphmode_update_graph_params=_no_update),
    # An outsider's slip: kernels declared to take host kv lengths, and no update hook at all.
    "no_update_hook": variant(ascend, "no_update_hook", graphmode_update_graph_params=None),
    "bucket_below_batch": variant(cuda, "bucket_below_batch", graphmode_compatible_size=_bucket_below_batch),
    "captured_at_batch_size": variant(cuda, "captured_at_batch_size", graphmode_update_context=_capture_at_batch_size),
    "table_narrowed_at_capture": variant(maca, "table_narrowed_at_capture",
                                         graphmode_update_context=_table_narrowed_at_capture),
    "unsliced_outputs": variant(cuda, "unsliced_outputs", graphmode_get_outputs=_unsliced_outputs),
    "minus_one_max_len": variant(ppu, "minus_one_max_len", graphmode_update_context=_minus_one_max_len),
    "stale_after_larger_bucket": variant(camb, "stale_after_larger_bucket", graphmode_fill_buffers=_reset_own_rows_only),
    "stale_after_shrink": variant(maca, "stale_after_shrink", graphmode_fill_buffers=_reset_on_bucket_change),
    "padding_to_power_of_two": variant(camb, "padding_to_power_of_two", graphmode_fill_buffers=_reset_to_power_of_two),
    "wrong_padding_kv_length": variant(maca, "wrong_padding_kv_length", graphmode_fill_buffers=_cuda_padding_kv_length),
    "host_read_in_fill": variant(ppu, "host_read_in_fill", graphmode_fill_buffers=_fill_reading_max_len),
    "host_read_in_update": variant(ascend, "host_read_in_update", graphmode_update_graph_params=_update_asking_the_device),
    "host_read_in_outputs": variant(cuda, "host_read_in_outputs", graphmode_get_outputs=_outputs_counting_on_the_device),
    "update_without_wait": variant(ascend, "update_without_wait", graphmode_make_graph=_graph_skipping_the_wait),
    "outputs_from_wrong_rows": variant(cuda, "outputs_from_wrong_rows", graphmode_get_outputs=_last_rows_as_outputs),
    "mutates_engine_inputs": variant(ascend, "mutates_engine_inputs", graphmode_fill_buffers=_cumulative_lengths_in_place),
    "kernel_off_contract": variant(cuda, "kernel_off_contract", graphmode_attention_ops=_hot_softmax_ops),
    "out_rows_half_written": variant(cuda, "out_rows_half_written", graphmode_attention_ops=_half_out_ops),
    # Issue 22's classes.
    "first_output_cut_only": variant(cuda, "first_output_cut_only", graphmode_get_outputs=_first_output_cut_only),
    "graphs_outside_the_pool": variant(cuda, "graphs_outside_the_pool", graphmode_make_graph=_pool_dropping_graph),
    "detected_without_runtime": variant(camb, "detected_without_runtime", graphmode_vendor_info=_detected_from_reason),
    "plan_cached_by_shape": variant(cuda, "plan_cached_by_shape", graphmode_attention_ops=_plan_caching_ops),
    "host_copy_in_fill": variant(ascend, "host_copy_in_fill", graphmode_fill_buffers=_device_lengths_into_host_buffer),
    "dist_backend_from_string": variant(maca, "dist_backend_from_string", graphmode_dist_backend=_dist_backend_from_string),
    "pushed_padding_stale": variant(ascend, "pushed_padding_stale", graphmode_update_graph_params=_push_live_rows_only),
    "graphs_kept_in_a_registry": variant(
        ascend, "graphs_kept_in_a_registry", graphmode_make_graph=_graphs_kept_in_a_registry),
    # The probe of 2026-11-26.
    "long_context_path": variant(cuda, "long_context_path", graphmode_attention_ops=_split_merge_ops),
    "one_offset_for_a_mixed_step": variant(cuda, "one_offset_for_a_mixed_step", graphmode_attention_ops=_uniform_offset_ops),
    "decode_in_launches_of_32": variant(cuda, "decode_in_launches_of_32", graphmode_attention_ops=_launches_of_32_ops),
    "bulk_write_at_consecutive_slots": variant(cuda, "bulk_write_at_consecutive_slots",
                                               graphmode_attention_ops=_consecutive_slots_ops),
    "scale_ignored": variant(cuda, "scale_ignored", graphmode_attention_ops=_own_scale_ops),
    "active_mask_per_sequence": variant(ascend, "active_mask_per_sequence", graphmode_graph_spec=_mask_per_sequence_spec),
    "outputs_as_half": variant(cuda, "outputs_as_half", graphmode_get_outputs=_outputs_as_half),
    "padding_slot_clamped_to_zero": variant(maca, "padding_slot_clamped_to_zero", graphmode_attention_ops=_clamped_slot_ops),
    "direct_writes_with_host_staging": variant(
        camb, "direct_writes_with_host_staging", graphmode_fill_buffers=_direct_fill,
        graphmode_vendor_info=_info_with_host_staging),
    "table_copied_as_contiguous": variant(camb, "table_copied_as_contiguous", graphmode_fill_buffers=_flat_table_copy),
    "pushes_the_previous_step": variant(ascend, "pushes_the_previous_step", graphmode_update_graph_params=_push_previous),
    "pushes_another_runners_lengths": variant(
        ascend, "pushes_another_runners_lengths", graphmode_update_graph_params=_push_from_a_cached_slice),
    # The second probe of 2026-11-26.
    "block_table_through_int16": variant(camb, "block_table_through_int16", graphmode_fill_buffers=_table_through_int16),
    "slots_through_float32": variant(maca, "slots_through_float32", graphmode_fill_buffers=_slots_through_float),
    "host_lengths_through_int16": variant(
        ascend, "host_lengths_through_int16", graphmode_fill_buffers=_lengths_through_int16),
    "slot_blocks_declared_int16": variant(
        acme.plugin, "slot_blocks_declared_int16", graphmode_graph_spec=_slot_blocks_int16_spec),
    "query_starts_padded_with_zero": variant(
        cuda, "query_starts_padded_with_zero", graphmode_graph_spec=_query_starts_zero_spec),
    "table_kept_by_reference": variant(camb, "table_kept_by_reference", graphmode_fill_buffers=_changed_entries_only),
    # The third probe of 2026-11-26.
    "cache_copied_contiguous": variant(camb, "cache_copied_contiguous", graphmode_attention_ops=_contiguous_cache_ops),
    "verify_not_causal": variant(maca, "verify_not_causal", graphmode_attention_ops=_not_causal_verify_ops),
    "hccl_for_every_device": variant(ascend, "hccl_for_every_device", graphmode_dist_backend=_hccl_for_every_device),
    "advice_on_any_stream_error": variant(
        ascend, "advice_on_any_stream_error", graphmode_capture_error=_advice_on_any_stream_error),
    "out_accumulates": variant(cuda, "out_accumulates", graphmode_attention_ops=_accumulating_out_ops),
    "fill_of_the_vendors_own_spec": variant(
        camb, "fill_of_the_vendors_own_spec", graphmode_fill_buffers=_fill_of_the_vendors_own_spec),
    "staged_from_the_device_buffer": variant(
        acme.plugin, "staged_from_the_device_buffer", graphmode_graph_spec=_acme_spec_own_blocks,
        graphmode_fill_buffers=_blocks_from_the_slot_buffer, graphmode_vendor_info=_acme_info_with_host_staging),
    # The fourth probe of 2026-11-26.
    "length_columns_of_one_tensor": variant(cuda, "length_columns_of_one_tensor", graphmode_make_buffers=_length_columns),
    "one_graph_for_every_bucket": variant(cuda, "one_graph_for_every_bucket", graphmode_make_graph=_one_graph_per_runner),
    "lengths_buffer_replaced": variant(camb, "lengths_buffer_replaced", graphmode_fill_buffers=_lengths_replaced),
    "token_padding_to_the_bucket": variant(
        cuda, "token_padding_to_the_bucket", graphmode_fill_buffers=_token_padding_to_the_bucket),
    "max_len_one_below_capacity": variant(
        ppu, "max_len_one_below_capacity", graphmode_update_context=_max_len_one_below_capacity),
}

# Options a broken plugin runs with: a capture list that is not powers of two.
# An Ascend bug the same under both update paths, caught late in the suite:
# one path only, or every test before the one that catches it runs twice.
ONE_UPDATE_PATH = ["--variant", "update_path=graph_update"]
# A plugin whose bug only a test late in the suite catches runs that test
# alone (-k): every test before it passes the plugin (checked when the plugin
# was added), and running them again took 25 to 45 s of CI a plugin. The
# others run the whole suite up to their first failure (-x), so that an
# earlier test misnaming their bug shows.
CAUGHT_LATE = {
    "plan_cached_by_shape": "planning_boundaries or equal_chunks",
    "first_output_cut_only": "returning_several",
    "graphs_outside_the_pool": "runners_pool",
    "active_mask_per_sequence": "x_active_mask",
    "direct_writes_with_host_staging": "host_staging",
    "table_copied_as_contiguous": "sliced_from_a_wider_table",
    "table_kept_by_reference": "sliced_from_a_wider_table",
    "cache_copied_contiguous": "memory_plan",
    "fill_of_the_vendors_own_spec": "engine_input",
    "staged_from_the_device_buffer": "host_staging",
    "token_padding_to_the_bucket": "every_q_len_with_batch_churn",
}
OPTIONS = {
    "padding_to_power_of_two": ["--capture-sizes", "1,3,6,12,24,48"],
    "host_lengths_through_int16": ONE_UPDATE_PATH,
    "hccl_for_every_device": ONE_UPDATE_PATH,
    "advice_on_any_stream_error": ONE_UPDATE_PATH,
    **{name: ["-k", keyword] for name, keyword in CAUGHT_LATE.items()},
}
OPTIONS["active_mask_per_sequence"] += ONE_UPDATE_PATH

# The correct plugins the broken ones vary, loaded the same way.
ORIGINALS = {
    "cuda_original": variant(cuda, "cuda_original"),
    "camb_original": variant(camb, "camb_original"),
    "ascend_original": variant(ascend, "ascend_original"),
    "maca_original": variant(maca, "maca_original"),
    "ppu_original": variant(ppu, "ppu_original"),
    "cuda_out_original": variant(cuda, "cuda_out_original", graphmode_attention_ops=_out_ops),
}

globals().update(BROKEN)
globals().update(ORIGINALS)


# -- Issue 40's classes (the suite's checks of declarations against what runs;
#    each caught by a check that runs after every other, so run alone: -k) --


class _GraphChoosingItsUpdatePath(AscendGraph):
    """Ascend's graph taking the update path the installed torch_npu supports
    ("auto"), not the one the runner resolved from the options: every
    declared variant runs the same path, and the other is never what runs."""

    def __init__(self, device: torch.device, update_path: str, captured: Any = None) -> None:
        super().__init__(device, resolve_update_path("auto", ascend.torch_npu_version()[0]), captured)


def _ascend_graphs_of(graph_class: type[AscendGraph]) -> Any:
    """Ascend's graphmode_make_graph, making ``graph_class`` graphs."""

    @hookimpl
    def make_graph(meta):
        if meta.device.type not in ("npu", "cpu"):
            return None
        graph = graph_class(
            meta.device, meta.vendor_options.update_path, meta.vendor_state.setdefault("captured_graphs", WeakSet()))
        graph.piece = meta.family == "piecewise"
        return graph

    return make_graph


# 57. A graph class choosing its own update path instead of the declared option.
_graph_choosing_its_update_path = _ascend_graphs_of(_GraphChoosingItsUpdatePath)


# 58. The vendor's collective library named for every accelerator ("cpu is
#     gloo, anything else is ours"): Camb drives CUDA devices too, where a
#     tensor-parallel run fails at start-up in init_process_group("cncl").
@hookimpl
def _cncl_for_every_accelerator(device):
    return None if torch.device(device).type == "cpu" else "cncl"


# 59. Odd batch sizes dropped from the capture list ("odd batches are slow on
#     our kernels"): the list still ends at max_batches where that is even,
#     so batches of 3, 5, 7 pad into the next graph, and at an odd
#     max_batches the largest batches run eagerly, unreported.
@hookimpl
def _capture_sizes_without_odd_ones(config, spec):
    sizes = spec.capture_list(config.max_batches, config.capture_batch_sizes)
    return [size for size in sizes if size == 1 or size % 2 == 0]


class _WaitsOnTheHost(AscendGraph):
    """Ascend's graph making sure the last replay is done before an update
    by waiting for its event on the host (vllm-ascend's synchronise before
    every update) rather than ordering the update stream after it: right
    results, a host stall every step."""

    def _after_last_replay(self, update_stream: Any) -> None:
        if self._replayed is not None:
            self._replayed.synchronize()


# 60. A parameter update that waits on the host where it should wait on an event.
_graph_waiting_on_the_host = _ascend_graphs_of(_WaitsOnTheHost)


# 61. FIA's limit of 16 query tokens per sequence checked against the draft
#     tokens ("16 speculative tokens"), max_q_len - 1: a runner of 17 tokens
#     per sequence (16 drafts and the bonus token) is accepted, and FIA
#     refuses its verify steps.
@hookimpl
def _limit_on_the_draft_tokens(config):
    drafts = dataclasses.replace(config, max_q_len=max(1, config.max_q_len - 1))
    ascend.graphmode_check_config(drafts)
    config.vendor_options = drafts.vendor_options


ISSUE_40 = {
    "update_path_chosen_by_the_graph": variant(
        ascend, "update_path_chosen_by_the_graph", graphmode_make_graph=_graph_choosing_its_update_path),
    "cncl_for_every_accelerator": variant(camb, "cncl_for_every_accelerator",
                                          graphmode_dist_backend=_cncl_for_every_accelerator),
    "capture_list_drops_odd_sizes": variant(cuda, "capture_list_drops_odd_sizes",
                                            graphmode_capture_sizes=_capture_sizes_without_odd_ones),
    "update_waits_on_the_host": variant(ascend, "update_waits_on_the_host", graphmode_make_graph=_graph_waiting_on_the_host),
    "token_limit_counts_draft_tokens": variant(
        ascend, "token_limit_counts_draft_tokens", graphmode_check_config=_limit_on_the_draft_tokens),
}
ISSUE_40_CAUGHT_LATE = {
    "update_path_chosen_by_the_graph": "each_option_variant_changes",
    "cncl_for_every_accelerator": "distributed_backend_per_device_type",
    "capture_list_drops_odd_sizes": "capture_list_keeps_what",
    "update_waits_on_the_host": "never_wait_on_the_host",
    "token_limit_counts_draft_tokens": "verify_steps_at_the_token_limit",
}
BROKEN.update(ISSUE_40)
CAUGHT_LATE.update(ISSUE_40_CAUGHT_LATE)
OPTIONS.update({name: ["-k", keyword] for name, keyword in ISSUE_40_CAUGHT_LATE.items()})
globals().update(ISSUE_40)


# -- Issue 40's classes (suite B): bugs that right outputs on the emulator hid --
#    One block, appended, so that it merges beside other additions.


# 57. A copy of the outputs kept per token count ("a stable tensor per size
#     for the engine"): right results, but graph memory grows at the first
#     step of every new size, past what plan_memory() said.
@hookimpl
def _outputs_copied_per_token_count(meta, batch_size, num_tokens):
    copies = meta.vendor_state.setdefault("output_copies", {})
    output = meta.output_buffers["output"][:, :num_tokens]
    if num_tokens not in copies:
        copies[num_tokens] = torch.empty_like(output)
    return copies[num_tokens].copy_(output)


# 58. A decode kernel built for float16 given every 16-bit cache: a bfloat16
#     cache read through .view(torch.float16), same width, other bits.
class _Float16KernelOps(ReferenceAttentionOps):
    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        if k_cache.element_size() != 2:
            return super().paged_decode_attention(query, k_cache, v_cache, attn, scale)
        half = super().paged_decode_attention(
            query.to(torch.float16), k_cache.view(torch.float16), v_cache.view(torch.float16), attn, scale)
        return half.to(query.dtype)


@hookimpl
def _float16_kernel_ops():
    return _Float16KernelOps()


# 59. Zeta's kernel on a runtime that keeps each captured call's host kv
#     lengths in parameter memory of its own, bucket rows, which an update
#     writes as many rows of as it is given (as a device runtime keeps a
#     launch's arguments); the update hook planted with graph.update(lens[:batch]):
#     padding rows keep an earlier, larger batch's lengths. Harmless for
#     Zeta's kernel, which masks padding rows by their table; wrong for one
#     that reads padding rows (a split plan over every row's length).
@torch.library.custom_op("broken_plugins::paged_decode_from_parameters", mutates_args=())
def _decode_from_parameters(query: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                            block_offsets: torch.Tensor, kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Zeta's decode kernel reading its kv lengths from parameter memory."""
    return torch.ops.zeta.paged_decode(query, k_blocks, v_blocks, block_offsets, kv_lens.tolist(), scale)


@_decode_from_parameters.register_fake
def _(query, k_blocks, v_blocks, block_offsets, kv_lens, scale):
    return torch.empty_like(query)


class ParameterMemoryGraph(zeta.ZetaEmulatedGraph):
    """Zeta's emulated runtime, its decode calls' host kv lengths held in
    parameter memory of the graph (one int64 tensor of the capture's rows
    per call); :meth:`update_kv_lens` writes the rows it is given."""

    def __init__(self):
        super().__init__()
        self.parameters: list[torch.Tensor] = []

    def record_call(self, session, func, args, kwargs):
        if func is not torch.ops.zeta.paged_decode.default:
            return session.record(func, args, kwargs)
        named = named_arguments(func, args, kwargs)
        memory = torch.tensor(named.pop("kv_lens"), dtype=torch.int64)  # the runtime's, outside the capture
        self.parameters.append(memory)
        return session.record(torch.ops.broken_plugins.paged_decode_from_parameters.default, (),
                              {**named, "kv_lens": memory})

    def update_kv_lens(self, lens):
        for memory in self.parameters:
            memory[:len(lens)] = torch.tensor(lens, dtype=torch.int64)

    def reset(self):
        self.parameters = []
        return super().reset()


@hookimpl
def _parameter_memory_graph(meta):
    return ParameterMemoryGraph() if meta.device.type == "cpu" else None


@hookimpl
def _update_with_the_batch_rows(graph, meta, batch_size, bucket):
    lens = meta.input_buffers[zeta.HOST_LENS][:bucket].tolist()
    graph.update_kv_lens(lens[:batch_size])  # "the padding rows are masked anyway"


#: The runtime above with Zeta's own update hook (every row of the bucket pushed): it passes.
parameter_memory_original = variant(zeta, "parameter_memory_original", graphmode_make_graph=_parameter_memory_graph)


# 60. A graph class replaying on a stream of its own ("so that the replay
#     overlaps the host's next step"), never made to wait for the stream
#     the step's inputs were copied on: right while steps are synchronised;
#     on a busy GPU the replay reads the previous step's inputs.
class _SideStreamGraph(DeviceGraph):
    def __init__(self, device):
        self.inner = make_device_graph(device)
        self.on_cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_cuda else stream_order.Stream("the graph's replay stream")

    def capture_begin(self, pool=None):
        self.inner.capture_begin(pool)

    def capture_end(self):
        self.inner.capture_end()

    def replay(self):
        with torch.cuda.stream(self.stream) if self.on_cuda else stream_order.use(self.stream):
            self.inner.replay()

    def reset(self):
        self.inner.reset()

    def pool(self):
        return self.inner.pool()


@hookimpl
def _side_stream_graph(meta):
    return _SideStreamGraph(meta.device)


# 61. kv lengths staged through ONE pinned host buffer, rewritten at every
#     step while the copy from it may still be in flight ("pinned, so the
#     copy is asynchronous"): right when steps are synchronised; steps
#     issued back to back read a later step's lengths.
@hookimpl(wrapper=True)
def _lengths_through_one_pinned_buffer(meta, inputs, batch_size, bucket):
    result = yield
    host = inputs.attn_metadata.kv_seqlens_cpu
    if host is None:
        return result
    pinned = meta.vendor_state.get("pinned_lengths")
    if pinned is None:
        pinned = meta.vendor_state["pinned_lengths"] = buffers.host_zeros(
            meta, (meta.max_batchs,), meta.input_buffers["kv_seqlens"].dtype, pinned=True)
    pinned[:batch_size].copy_(host)
    meta.input_buffers["kv_seqlens"][:batch_size].copy_(pinned[:batch_size], non_blocking=True)
    return result


BROKEN_SUITE_B = {
    "replay_on_an_unordered_stream": variant(cuda, "replay_on_an_unordered_stream",
                                             graphmode_make_graph=_side_stream_graph),
    "one_pinned_buffer_for_every_step": variant(
        camb, "one_pinned_buffer_for_every_step", graphmode_fill_buffers=_lengths_through_one_pinned_buffer),
    "pushed_rows_of_the_batch_into_parameter_memory": variant(
        parameter_memory_original, "pushed_rows_of_the_batch_into_parameter_memory",
        graphmode_update_graph_params=_update_with_the_batch_rows),
    "output_copies_per_token_count": variant(
        cuda, "output_copies_per_token_count", graphmode_get_outputs=_outputs_copied_per_token_count),
    "bfloat16_cache_read_as_float16": variant(
        cuda, "bfloat16_cache_read_as_float16", graphmode_attention_ops=_float16_kernel_ops),
}
CAUGHT_LATE_SUITE_B = {
    "output_copies_per_token_count": "every_batch_size_is_served",
    "one_pinned_buffer_for_every_step": "back_to_back",
}


def _register(broken: dict[str, Any], caught_late: dict[str, str]) -> None:
    """A later probe's plugins into BROKEN (and this module's names, for
    --plugin), the ones a late test catches into CAUGHT_LATE and OPTIONS."""
    BROKEN.update(broken)
    CAUGHT_LATE.update(caught_late)
    OPTIONS.update({name: ["-k", keyword] for name, keyword in caught_late.items()})
    globals().update(broken)


_register(BROKEN_SUITE_B, CAUGHT_LATE_SUITE_B)


# -- Suite C: realistic one-line vendor bugs of classes no plugin above holds
#    (the probe of 2026-12-02) --


# 62. Padding slots pointed at the batch's first block ("a slot we know is
#     mapped", for a fill-cache kernel that does not skip -1): every padding
#     token writes its keys and values over sequence 0's first cached token.
@hookimpl(wrapper=True)
def _padding_slots_in_the_first_block(meta, inputs, batch_size, bucket):
    result = yield
    slots, tokens = meta.input_buffers["kv_start_indices"], inputs.num_tokens
    slots[tokens:bucket * (tokens // batch_size)] = meta.input_buffers["block_offsets"][0, 0] * meta.block_size
    return result


# 63. Block-table padding rows pointed at the first sequence's first block
#     ("block 0 may be unmapped on our runtime"): padding rows read a live
#     sequence's KV, and a kernel that writes by table writes there.
@hookimpl(wrapper=True)
def _table_padding_with_the_first_block(meta, inputs, batch_size, bucket):
    result = yield
    tables = meta.input_buffers["block_offsets"]
    tables[batch_size:bucket] = tables[0, 0]
    return result


# 64. The bucket found with bisect_right where bisect_left was meant: a batch
#     equal to a capture size takes the next graph (right results, twice the
#     work at batch 1, and the largest batches' graphs never replay full).
@hookimpl
def _bucket_after_an_equal_size(batch_size, capture_sizes):
    index = bisect.bisect_right(capture_sizes, batch_size)
    return capture_sizes[index] if index < len(capture_sizes) else smallest_bucket(batch_size, capture_sizes)


# 65. position_ids copied for the first batch rows only, as for one token per
#     sequence: in a verify graph the later tokens keep an earlier step's
#     positions, and their rotary embedding is another position's.
@hookimpl(wrapper=True)
def _positions_of_one_token_per_sequence(meta, inputs, batch_size, bucket):
    positions, tokens = meta.input_buffers["position_ids"], inputs.num_tokens
    kept = positions[:, batch_size:tokens].clone()
    result = yield
    positions[:, batch_size:tokens] = kept
    return result


# 66. MACA's int64 slot column written through an int32 view ("the engine's
#     slots are int32"): the memory holds int32 slots, read as int64 pairs.
@hookimpl(wrapper=True)
def _slots_through_an_int32_view(meta, inputs, batch_size, bucket):
    result = yield
    slots, tokens = meta.input_buffers["kv_start_indices"], inputs.num_tokens
    slots.view(-1).view(torch.int32)[:tokens] = inputs.attn_metadata.kv_start_indices.to(torch.int32)
    return result


# 67. The block table copied one column short (an off-by-one in the width,
#     "the last column is the kernel's sentinel"): a sequence reads the
#     reserved block 0 for the tokens of its last block.
@hookimpl(wrapper=True)
def _table_one_column_short(meta, inputs, batch_size, bucket):
    result = yield
    width = inputs.attn_metadata.block_offsets.shape[-1]
    meta.input_buffers["block_offsets"][:batch_size, width - 1] = 0
    return result


# 68. kv lengths of the cached tokens only ("context length", as the engine's
#     cache reports it before the step): a sequence's KV length counts its
#     new tokens, so every sequence reads one key (q_len keys) too few.
@hookimpl(wrapper=True)
def _kv_lengths_without_the_new_tokens(meta, inputs, batch_size, bucket):
    result = yield
    meta.input_buffers["kv_seqlens"][:batch_size] -= inputs.num_tokens // batch_size
    return result


# 69. A graph context's max_q_seq_len of 1 for every decode graph ("decode is
#     one query per sequence"): PPU's kernel bounds each query by it, and a
#     verify graph of q_len 2 reads one.
@hookimpl(wrapper=True)
def _one_query_per_sequence_in_every_graph(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_q_seq_len = 1
    return static


# 70. position_ids padded with -1, as the slots are ("-1 marks padding"):
#     PyTorch's rotary gather wraps -1 to its table's last row, so results
#     are right here; a fused rotary kernel indexing its cos/sin table by
#     pointer reads before the table on a device.
@hookimpl
def _positions_padded_with_minus_one():
    return ppu.PPU_SPEC.with_buffers(BufferSpec("position_ids", torch.int64, shape=(1, TOKENS), padding=-1))


BROKEN_SUITE_C = {
    "padding_slots_in_a_live_block": variant(
        maca, "padding_slots_in_a_live_block", graphmode_fill_buffers=_padding_slots_in_the_first_block),
    "table_padding_with_a_live_block": variant(
        camb, "table_padding_with_a_live_block", graphmode_fill_buffers=_table_padding_with_the_first_block),
    "bucket_after_an_equal_size": variant(
        cuda, "bucket_after_an_equal_size", graphmode_compatible_size=_bucket_after_an_equal_size),
    "positions_of_one_token_per_sequence": variant(
        cuda, "positions_of_one_token_per_sequence", graphmode_fill_buffers=_positions_of_one_token_per_sequence),
    "slots_through_an_int32_view": variant(
        maca, "slots_through_an_int32_view", graphmode_fill_buffers=_slots_through_an_int32_view),
    "table_one_column_short": variant(camb, "table_one_column_short", graphmode_fill_buffers=_table_one_column_short),
    "kv_lengths_without_the_new_tokens": variant(
        cuda, "kv_lengths_without_the_new_tokens", graphmode_fill_buffers=_kv_lengths_without_the_new_tokens),
    "positions_padded_with_minus_one": variant(
        ppu, "positions_padded_with_minus_one", graphmode_graph_spec=_positions_padded_with_minus_one),
    "one_query_per_sequence_in_every_graph": variant(
        ppu, "one_query_per_sequence_in_every_graph", graphmode_update_context=_one_query_per_sequence_in_every_graph),
}
# Caught by the multi-token decode test (every test before it passes them).
CAUGHT_LATE_SUITE_C = {
    "positions_of_one_token_per_sequence": "every_q_len_with_batch_churn",
    "one_query_per_sequence_in_every_graph": "every_q_len_with_batch_churn",
}
_register(BROKEN_SUITE_C, CAUGHT_LATE_SUITE_C)


# -- Suite D: from a vendor written from the docs (2026-12-03) --


# 71. The update hook keeps one graph per bucket ("a bucket has a graph") and
#     pushes the lengths into that one, where graphs are per (bucket, q_len):
#     a verify graph of a bucket whose one-token graph came first replays
#     with its capture's lengths. Ascend's update, taking two tokens per
#     sequence, as the vendor that wrote it declared.
@hookimpl
def _update_the_first_graph_of_the_bucket(graph, meta, batch_size, bucket):
    kept = meta.vendor_state.setdefault("graph_of_bucket", weakref.WeakValueDictionary())
    ascend.graphmode_update_graph_params(kept.setdefault(bucket, graph), meta, batch_size, bucket)


@hookimpl
def _ascend_of_two_tokens_per_sequence():
    return ascend.ASCEND_SPEC.replace(max_q_len=2)


BROKEN_SUITE_D = {
    "update_keyed_by_bucket_alone": variant(
        ascend, "update_keyed_by_bucket_alone", graphmode_graph_spec=_ascend_of_two_tokens_per_sequence,
        graphmode_update_graph_params=_update_the_first_graph_of_the_bucket),
}
_register(BROKEN_SUITE_D, {})

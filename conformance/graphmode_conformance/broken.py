"""Deliberately broken vendor plugins, one per bug class.

Each is a correct plugin with one hook changed, the way real vendor bugs
look. The suite must fail on every one and pass on the unchanged originals
(``tests/test_conformance_catches_broken_vendors.py``). Point the suite at one
with ``graphmode conformance --device cpu --plugin graphmode_conformance.broken:NAME``.
"""

from __future__ import annotations

import types
from typing import Any

import graphmode.default as cuda
import graphmode_ascend.plugin as ascend
import graphmode_camb.plugin as camb
import graphmode_ppu.plugin as ppu
from graphmode import buffers, hookimpl
from graphmode.buckets import smallest_bucket

__all__ = ["BROKEN", "ORIGINALS", "variant"]


def variant(base: Any, name: str, **changes: Any) -> types.SimpleNamespace:
    """A plugin object with every hook implementation of ``base``, the given
    ones replaced."""
    plugin = types.SimpleNamespace(__name__=name, __version__="broken")
    for attr in dir(base):
        if attr.startswith("graphmode_"):
            setattr(plugin, attr, getattr(base, attr))
    for attr, function in changes.items():
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


BROKEN = {
    "slot_zero_padding": variant(cuda, "slot_zero_padding", graphmode_make_buffers=_slot_zero),
    "stale_padding": variant(camb, "stale_padding", graphmode_fill_buffers=_live_rows_only),
    "context_not_on_buffer": variant(cuda, "context_not_on_buffer", graphmode_update_context=_context_copy),
    "frozen_max_len": variant(camb, "frozen_max_len", graphmode_update_context=_frozen_max_len),
    "kv_lengths_never_pushed": variant(ascend, "kv_lengths_never_pushed", graphmode_update_graph_params=_no_update),
    "bucket_below_batch": variant(cuda, "bucket_below_batch", graphmode_compatible_size=_bucket_below_batch),
    "captured_at_batch_size": variant(cuda, "captured_at_batch_size", graphmode_update_context=_capture_at_batch_size),
    "unsliced_outputs": variant(cuda, "unsliced_outputs", graphmode_get_outputs=_unsliced_outputs),
    "minus_one_max_len": variant(ppu, "minus_one_max_len", graphmode_update_context=_minus_one_max_len),
}

# The correct plugins the broken ones vary, loaded the same way.
ORIGINALS = {
    "cuda_original": variant(cuda, "cuda_original"),
    "camb_original": variant(camb, "camb_original"),
    "ascend_original": variant(ascend, "ascend_original"),
}

globals().update(BROKEN)
globals().update(ORIGINALS)

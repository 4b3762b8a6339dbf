"""Broken vendor plugins, one per bug that vendor plugins have shipped.

Like ``tests/broken_plugins.py`` (whose bug classes these do not repeat):
each is a built-in vendor's hooks with one changed, the way the slip looks
in a real plugin. ``tests/test_conformance_shipped_bugs.py`` runs the suite
on each and asserts what its first failure says. Point the suite at one,
from tests/, with ``graphmode conformance --device cpu --plugin
shipped_bugs:NAME`` (plus its ``OPTIONS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import acme_vendor as acme
import torch
from acme_vendor import ACME_SPEC, _blocks_of
from broken_plugins import variant

import graphmode.default as cuda
import graphmode_ascend.plugin as ascend
import graphmode_camb.plugin as camb
from graphmode import buffers, hookimpl
from graphmode.attention import ReferenceAttentionOps
from graphmode.spec import CUDA_VENDOR_SPEC

__all__ = ["BROKEN", "OPTIONS"]


# 1. Padding rows copied from the last live row ("pad the batch by repeating
#    its last request", as engines that pad requests rather than rows do):
#    every padding token's slot is the last live token's, so the graph writes
#    the padding tokens' keys into that sequence's live block.
@hookimpl
def _pad_with_the_last_request(meta, inputs, batch_size, bucket):
    buffers.fill(meta, inputs, batch_size, bucket)
    for spec in meta.spec.buffers:
        if spec.written and batch_size < bucket:
            rows = meta.input_buffers[spec.name].narrow(spec.row_dim, 0, bucket)
            last = rows.narrow(spec.row_dim, batch_size - 1, 1)
            rows.narrow(spec.row_dim, batch_size, bucket - batch_size).copy_(last.expand_as(
                rows.narrow(spec.row_dim, batch_size, bucket - batch_size)))
    return True


# 2. Host kv lengths pushed on one path only: an early return for a full
#    bucket ("nothing to pad, nothing to do") placed above the push, so a
#    replay whose batch fills its bucket keeps the lengths of the step before.
@hookimpl
def _no_push_for_a_full_bucket(graph, meta, batch_size, bucket):
    if batch_size == bucket:
        return
    graph.push_kv_lengths(meta.input_buffers["kv_seqlens"][:bucket].tolist())


# 3. x_active_mask recomputed only when the bucket changes (the mask "only
#    depends on the bucket"): after a shrink inside the bucket, padding tokens
#    stay active, and MoE dispatch routes them as live tokens.
@hookimpl(wrapper=True)
def _mask_per_bucket(meta, inputs, batch_size, bucket):
    mask = meta.input_buffers["x_active_mask"]
    kept = mask.clone() if meta.vendor_state.get("mask_bucket") == bucket else None
    result = yield
    if kept is not None:
        mask.copy_(kept)
    meta.vendor_state["mask_bucket"] = bucket
    return result


# 4. Acme's per-token block input kept outside the declarations and computed
#    in graphmode_update_context, which runs at capture only: every replay's
#    fill-cache kernel reads the capture step's blocks.
@hookimpl
def _acme_spec():
    return ACME_SPEC.replace(buffers=tuple(b for b in ACME_SPEC.buffers if b.name != "slot_blocks"))


@hookimpl(wrapper=True)
def _acme_buffers_with_an_extra(meta):
    made = yield
    made["slot_blocks"] = torch.zeros(meta.max_tokens, dtype=torch.int32, device=meta.device)
    return made


@hookimpl
def _blocks_at_capture(meta, inputs, batch_size, bucket):
    static = buffers.graph_context(meta, inputs, batch_size, bucket)
    blocks = meta.input_buffers["slot_blocks"]
    blocks.zero_()
    blocks[:batch_size].copy_(_blocks_of(inputs.attn_metadata.kv_start_indices))
    static.attn_metadata.vendor_fields["slot_blocks"] = blocks[:bucket]
    return static


# 5. Ascend's third stage (above 256 sequences) rounding down to a multiple of
#    256 ("n // 256 * 256"), right only at the multiples themselves.
@hookimpl
def _stage_three_rounds_down(batch_size, capture_sizes):
    if batch_size > 256:
        bucket = batch_size // 256 * 256
        return bucket if bucket in capture_sizes else None
    return cuda.graphmode_compatible_size(batch_size, capture_sizes)


# 6. Outputs cut to the batch's rows rather than its tokens: right while
#    every sequence has one new token, wrong for q_len > 1 (speculative
#    verify, MTP).
@hookimpl
def _outputs_cut_to_the_batch(meta, batch_size, num_tokens):
    return meta.output_buffers["output"][:, :batch_size]


# 7. Two buffers made as views of one row ("q_start_loc, q_seqlens,
#    kv_seqlens are rows of one (3, max_batchs) tensor", with an index slip:
#    the kv lengths are row 1, the query lengths' row).
@hookimpl(wrapper=True)
def _kv_lengths_on_the_query_row(meta):
    made = yield
    made["kv_seqlens"] = made["q_seqlens"]
    return made


# 8. The block table copied for the first sequence only (a copy of
#    ``table[0]`` where ``table`` was meant): the other rows keep what an
#    earlier step wrote.
@hookimpl
def _first_table_row_only(meta, inputs, batch_size, bucket):
    table = meta.input_buffers["block_offsets"]
    before = table.clone()
    buffers.fill(meta, inputs, batch_size, bucket)
    table[1:batch_size].copy_(before[1:batch_size])
    return True


# 9. The max kv length bounded by the step's own block table (its width
#    times the block size): a bound at capture, frozen into the graph; later
#    steps with longer sequences (wider tables) read too few keys.
@hookimpl(wrapper=True)
def _max_len_from_the_step_table(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_kv_seq_len = inputs.attn_metadata.block_offsets.shape[1] * meta.block_size
    return static


# 10. Slot indices narrowed to int16 ("the slot buffer is per token, keep it
#     small"): right while the cache has at most 32768 slots; past that the
#     slots wrap, and a token writes into another sequence's block.
@hookimpl
def _int16_slots_spec():
    return ascend.ASCEND_SPEC.replace(buffers=tuple(
        dataclasses.replace(b, dtype=torch.int16) if b.name == "kv_start_indices" else b
        for b in ascend.ASCEND_SPEC.buffers
    ))


# 11. A fill-cache kernel indexing the flat cache with the slots as given
#     (``cache.view(-1, K, D)[slots] = key``): slot -1 is Python's last
#     element, so every padding token writes the cache's last slot. Eager
#     steps have no padding rows and stay right.
class _WrappingSlotOps(ReferenceAttentionOps):
    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = self._slots(attn).long()
        for cache, values in ((k_cache, key), (v_cache, value)):
            flat = self.block_view(cache, values.shape[-1]).flatten(0, 1)
            flat[slots] = values.to(flat.dtype)


@hookimpl
def _wrapping_slot_ops():
    return _WrappingSlotOps()


# 12. The slot buffer filled per sequence, as for one new token each (Camb's
#     slots are sized by batch): with q_len > 1 only the first ``batch``
#     tokens get their slots, the others keep -1 and write nothing.
@hookimpl(wrapper=True)
def _slots_per_sequence(meta, inputs, batch_size, bucket):
    result = yield
    meta.input_buffers["kv_start_indices"][batch_size:] = -1
    return result


# 13. q_start_loc declared without q_len_scaled (a spec copied from before
#     multi-token graphs): its padding rows start at the row index, not
#     row * q_len, so in a graph of q_len 2 padding sequences start inside
#     the live tokens.
@hookimpl
def _unscaled_starts_spec():
    return CUDA_VENDOR_SPEC.replace(buffers=tuple(
        dataclasses.replace(b, q_len_scaled=False) if b.name == "q_start_loc" else b for b in CUDA_VENDOR_SPEC.buffers
    ))


BROKEN: dict[str, Any] = {
    "padding_repeats_the_last_request": variant(
        camb, "padding_repeats_the_last_request", graphmode_fill_buffers=_pad_with_the_last_request),
    "no_push_for_a_full_bucket": variant(
        ascend, "no_push_for_a_full_bucket", graphmode_update_graph_params=_no_push_for_a_full_bucket),
    "active_mask_per_bucket": variant(ascend, "active_mask_per_bucket", graphmode_fill_buffers=_mask_per_bucket),
    "extra_buffer_at_capture_only": variant(
        acme.plugin, "extra_buffer_at_capture_only", graphmode_graph_spec=_acme_spec,
        graphmode_make_buffers=_acme_buffers_with_an_extra, graphmode_update_context=_blocks_at_capture),
    "stage_three_rounds_down": variant(
        ascend, "stage_three_rounds_down", graphmode_compatible_size=_stage_three_rounds_down),
    "outputs_cut_to_the_batch": variant(cuda, "outputs_cut_to_the_batch", graphmode_get_outputs=_outputs_cut_to_the_batch),
    "aliased_length_buffers": variant(cuda, "aliased_length_buffers", graphmode_make_buffers=_kv_lengths_on_the_query_row),
    "first_table_row_only": variant(camb, "first_table_row_only", graphmode_fill_buffers=_first_table_row_only),
    "max_len_from_the_step_table": variant(
        camb, "max_len_from_the_step_table", graphmode_update_context=_max_len_from_the_step_table),
    "int16_slots": variant(ascend, "int16_slots", graphmode_graph_spec=_int16_slots_spec),
    "slot_minus_one_wraps": variant(cuda, "slot_minus_one_wraps", graphmode_attention_ops=_wrapping_slot_ops),
    "slots_per_sequence": variant(cuda, "slots_per_sequence", graphmode_fill_buffers=_slots_per_sequence),
    "unscaled_query_starts": variant(cuda, "unscaled_query_starts", graphmode_graph_spec=_unscaled_starts_spec),
}

OPTIONS: dict[str, list[str]] = {}

globals().update(BROKEN)

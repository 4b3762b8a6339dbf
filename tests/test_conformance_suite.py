"""The conformance suite itself: it passes for every installed vendor on the
emulator, and it fails, for the right reason, on every deliberately broken
vendor while passing on the correct originals those vary."""

from __future__ import annotations

import dataclasses
import json

import broken_plugins
import pytest
import torch
from broken_plugins import BROKEN, OPTIONS, ORIGINALS

from graphmode.spec import BLOCKS, CUDA_SPEC, SEQUENCES, TOKENS, BufferSpec
from graphmode_conformance import cli
from graphmode_conformance.hooks import _copies_padded_unlike_their_source

pytestmark = pytest.mark.slow

# What the first failure of each broken plugin must say: the hook and the mechanism.
DIAGNOSES = {
    "out_rows_half_written": (
        "[kernels] vendor cuda: prefill_attention(out=) wrote rows",
        "differently from the result it returns without out",
    ),
    "kernel_off_contract": (
        "[kernels] vendor cuda: on the decode 1 step",
        "differing from graphmode's reference kernels",
        "graphmode_attention_ops",
    ),
    "slot_zero_padding": (
        "buffer kv_start_indices held [0] when made, not its declared padding -1",
        "graphmode_make_buffers must return every buffer holding its padding",
    ),
    "stale_padding": (
        "buffer input_ids padding rows 45..47 hold",
        "Hook: graphmode_fill_buffers did not reset them",
        "padding left stale after the batch shrank from 48 to 45 inside bucket 48",
    ),
    "stale_after_larger_bucket": (
        "[declared buffers] vendor camb, graphmode_fill_buffers of a batch of 41 in bucket 44",
        "Hook: graphmode_fill_buffers did not reset them: these rows still hold what the step of bucket 48 "
        "(batch 48) wrote: padding left stale when bucket 44 was reused after a larger bucket ran",
    ),
    "stale_after_shrink": (
        "Hook: graphmode_fill_buffers did not reset them",
        "padding left stale after the batch shrank from 48 to 45 inside bucket 48",
    ),
    "padding_to_power_of_two": (
        "buffer input_ids padding rows 32..47 hold",
        "Hook: graphmode_fill_buffers did not reset them: it reset rows 25..31 but not rows 32..47: padding reset to "
        "a bound (row 32, the next power of two above the batch (25)) other than the bucket (48)",
    ),
    "wrong_padding_kv_length": (
        "buffer kv_seqlens padding rows 45..47 hold [1, 1, 1], not the declared padding 0",
        "Hook: graphmode_fill_buffers wrote [1, 1, 1] into padding rows. That is a padding kv length other than "
        "the vendor's declared 0",
    ),
    "context_not_on_buffer": (
        "attn_metadata.kv_seqlens of the graph context is not a view of its buffer kv_seqlens",
        "Hook: graphmode_update_context",
    ),
    "frozen_max_len": (
        "A graph freezes host values, so every replay would use the capture step's max length",
        "Hook: graphmode_update_context",
    ),
    "kv_lengths_never_pushed": ("(replay): the runner raised ReplayError", "on the device this replay would hang"),
    "no_update_hook": (
        "declares host_kv_lengths (its kernels take kv lengths as host values, which a graph freezes at capture) "
        "but implements no graphmode_update_graph_params",
        "Hook: graphmode_update_graph_params",
    ),
    "bucket_below_batch": ("graphmode_compatible_size(9) returned 8; it must be a capture size >= 9",),
    "captured_at_batch_size": (
        "input_ids has 9 rows for a batch of 9 in bucket 10; graphs must be captured at their bucket's size",
        "Hook: graphmode_update_context",
    ),
    "table_narrowed_at_capture": (
        "attn_metadata.block_offsets has shape (",
        "a graph context's field is the buffer's first",
        "Hook: graphmode_update_context",
    ),
    "unsliced_outputs": ("Likely cause: outputs not cut to the live tokens (graphmode_get_outputs",),
    "outputs_from_wrong_rows": (
        "max |graph - eager|",
        "Likely cause: outputs cut from the wrong rows: the graph's output holds eager's values in its first",
        "token rows, but graphmode_get_outputs returned the rows from token",
    ),
    "minus_one_max_len": ("max_kv_seq_len=-1: PPU's FlashAttention varlen kernel needs a positive upper bound",),
    "host_read_in_fill": (
        "(replay): the runner raised ReplayError in graphmode_fill_buffers",
        "graphmode_fill_buffers read a device value on the host during a replay step (Tensor.item() of device memory",
    ),
    "host_read_in_update": (
        "vendor_options {'update_path': 'graph_update'}",
        "the runner raised ReplayError in graphmode_update_graph_params",
        "read a device value on the host during a replay step (Tensor.__bool__() of device memory",
    ),
    "host_read_in_outputs": (
        "the runner raised ReplayError in graphmode_get_outputs",
        "read a device value on the host during a replay step (Tensor.__int__() of device memory",
    ),
    "update_without_wait": (
        "the runner raised ReplayError in graphmode_update_graph_params",
        "would change parameters the previous replay is still reading",
    ),
    "mutates_engine_inputs": (
        "[engine inputs] vendor ascend, vendor_options {'update_path': 'graph_update'}, graphmode_fill_buffers",
        "modified the engine's attn_metadata.q_seqlens in place: [1, 1, 1, 1, 1] became [1, 2, 3, 4, 5]. Hook: "
        "graphmode_fill_buffers",
    ),
    # Issue 22's classes.
    "first_output_cut_only": (
        "[every output of a tuple equals eager] vendor cuda on cpu, graph, batch 3, bucket 4",
        "output[1] has shape (1, 4, 256), eager (1, 3, 256), while output[0] has eager's shape",
        "graphmode_get_outputs cut only some tensors of the model's tuple to the live tokens",
    ),
    "graphs_outside_the_pool": (
        "[memory pool] vendor cuda on cpu, graph: 2 of 3 graphs were captured outside the runner's memory pool",
        "graph memory grows with every bucket though outputs are right. Hook: graphmode_make_graph",
    ),
    "detected_without_runtime": (
        "[detection] vendor camb: graphmode_vendor_info says detected",
        "its runtime torch_mlu is not installed (importlib.util.find_spec('torch_mlu') is None)",
        "Automatic selection (select_vendor() with no vendor named) would pick camb here",
    ),
    "plan_cached_by_shape": (
        "[planning state] vendor cuda on cpu, graph: eagerly, at the step of 6 tokens of 1 sequence with kv lengths "
        "[12] (longest 12), the vendor's kernels give logits differing from graphmode's reference kernels",
        "a kernel of graphmode_attention_ops keeps per-call planning state",
        "the step of 6 tokens of 1 sequence with kv lengths [6] (longest 6), of the same shapes, was right",
    ),
    "host_copy_in_fill": (
        "(replay): the runner raised ReplayError in graphmode_fill_buffers",
        "read a device value on the host during a replay step (Tensor.__setitem__() of device memory into host memory",
    ),
    "dist_backend_from_string": (
        "[distributed backend] vendor maca: graphmode_dist_backend answers cuda -> 'nccl', cuda:0 -> 'gloo'",
        "must answer from device.type, not from the device's string form",
    ),
    "pushed_padding_stale": (
        "[pushed host values] vendor ascend",
        "after graphmode_update_graph_params the graph's",
        "reads actual_seq_lengths_kv",
        "padding rows left stale, pushed for the live rows only",
        "Hook: graphmode_update_graph_params must push every row up to the bucket",
    ),
    "graphs_kept_in_a_registry": (
        "[graph lifetime] vendor ascend on cpu, vendor_options {'update_path': 'graph_update'}: after runner.reset(), "
        "3 of 3 graphs the runner held are still alive after gc.collect(): the graphmode_ascend.graph.AscendGraph of "
        "bucket 8 (held by broken_plugins._ALL_GRAPHS)",
        "Something outside the runner keeps the graphs graphmode_make_graph returned",
        "device memory grows with every reset or reload though outputs are right",
    ),
    # The probe of 2026-11-26.
    "long_context_path": (
        "[kernels] vendor cuda: on the decode 1 with a 1028-token context step",
        "differing from graphmode's reference kernels",
        "graphmode_attention_ops",
        "with a long context: a path taken above some length only (split-KV partitions and their merge)",
    ),
    "one_offset_for_a_mixed_step": (
        "[kernels] vendor cuda: on the mixed (4 decodes, a chunk of 9) step",
        "graphmode_attention_ops",
        "a causal offset (kv length - query length) taken for the whole batch rather than per sequence",
    ),
    "decode_in_launches_of_32": (
        "[kernels] vendor cuda: on the decode of 40 sequences step",
        "Likely cause: graphmode_attention_ops's paged_decode_attention",
    ),
    "bulk_write_at_consecutive_slots": (
        "[kernels] vendor cuda: on the prefill of 640 tokens over 3 sequences step",
        "Likely cause: graphmode_attention_ops's fill_kv_cache",
    ),
    "scale_ignored": (
        "[kernels] vendor cuda: paged_decode_attention with scale",
        "Likely cause: the kernel ignores the scale it is given",
    ),
    "active_mask_per_sequence": (
        "[x_active_mask] vendor ascend: in a graph of q_len 2, batch 3 in bucket 4 (6 live tokens of 8 token rows)",
        "x_active_mask declared or filled per sequence",
        "declare it shape (TOKENS,) in graphmode_graph_spec",
    ),
    "outputs_as_half": (
        "graph output has dtype torch.float16, eager torch.float32",
        "graphmode_get_outputs converted the graph's output",
    ),
    "padding_slot_clamped_to_zero": (
        "cache slots of layer 0 that no live token of this step writes (slot 0: the reserved block 0)",
        "a padding row's slot -1 became slot 0, in the vendor's fill_kv_cache (graphmode_attention_ops: a clamp",
    ),
    "direct_writes_with_host_staging": (
        "[declared buffers] vendor camb on cpu, host staging (step inputs on the host: every buffer write of "
        "graphmode_fill_buffers must go through graphmode.buffers.stage, which routes it to the pinned mirror)",
        "graphmode_fill_buffers did not copy the step's values into the live rows",
    ),
    "table_copied_as_contiguous": (
        "[declared buffers] vendor camb on cpu, block tables sliced from a wider table (not contiguous: a copy of "
        "numel() elements from the first one reads columns of other rows)",
        "buffer block_offsets live rows",
        "graphmode_fill_buffers did not copy the step's values into the live rows",
    ),
    "pushes_the_previous_step": (
        "[graph equals eager] vendor ascend on cpu, vendor_options {'update_path': 'graph_update'}, batch 7, bucket 8",
        "reads actual_seq_lengths_kv [66, 63, 60, 57, 54, 51, 48, 45], whose live rows 0..6 are not this step's",
        "they are what buffer kv_seqlens held before this step's fill: the previous step's values. Hook: "
        "graphmode_update_graph_params must push this step's rows",
    ),
    "pushes_another_runners_lengths": (
        "reads actual_seq_lengths_kv",
        "they match no host buffer: values from an earlier step, or from another runner's buffers",
        "Hook: graphmode_update_graph_params must push this step's rows",
    ),
    # The second probe of 2026-11-26.
    "block_table_through_int16": (
        "[large values] vendor camb, graphmode_fill_buffers of a decode step of 5 sequences",
        "buffer block_offsets live rows 0..4 hold",
        "they are the step's values converted to torch.int16 and back",
        "Hook: graphmode_fill_buffers must copy integer step tensors into the integer buffers",
    ),
    "slots_through_float32": (
        "[large values] vendor maca",
        "buffer kv_start_indices live rows 0..4 hold",
        "they are the step's values converted to torch.float32 and back",
        "Hook: graphmode_fill_buffers",
    ),
    "host_lengths_through_int16": (
        "[large values] vendor ascend, vendor_options {'update_path': 'graph_update'}",
        "buffer kv_seqlens live rows 0..4 hold",
        "attn_metadata.kv_seqlens_cpu or attn_metadata.kv_seqlens is",
        "converted to torch.int16 and back",
    ),
    "slot_blocks_declared_int16": (
        "[large values] vendor acme",
        "buffer slot_blocks live rows 0..4 hold",
        "buffer slot_blocks is declared torch.int16, which cannot hold them. Declare it int32 (or int64) in "
        "graphmode_graph_spec",
    ),
    "query_starts_padded_with_zero": (
        "[declarations] vendor cuda: buffer q_start_loc (query starts, written by no step) has padding 0",
        "Declare padding=ROW_INDEX (graphmode.spec) in graphmode_graph_spec",
    ),
    "table_kept_by_reference": (
        "every step tensor a view of a persistent one written in place",
        "buffer block_offsets live rows 0..7 hold",
        "graphmode_fill_buffers did not copy the step's values into the live rows: they are what the buffer held "
        "before this fill, so the copy was skipped for them",
        "compared with a tensor kept from the last step by reference",
    ),
    # The third probe of 2026-11-26.
    "cache_copied_contiguous": (
        "[graph memory] vendor camb on cpu: plan_memory() on a probe cache of 4 blocks planned",
        "Graph memory grows with the KV cache's size",
        "a kernel of graphmode_attention_ops copies the whole cache inside the graph (.contiguous()",
    ),
    "verify_not_causal": (
        "[kernels] vendor maca: on the decode of 2 tokens per sequence step",
        "graphmode_attention_ops",
        "causal among the new tokens (FlashAttention's causal=True, whose default is False",
    ),
    "hccl_for_every_device": (
        "[distributed backend] vendor ascend: graphmode_dist_backend answers 'hccl' for cpu, a device type the "
        "vendor does not drive",
        "Hook: graphmode_dist_backend must answer from device.type and return None for device types it does not drive",
    ),
    "advice_on_any_stream_error": (
        "[capture advice] vendor ascend: graphmode_capture_error turned RuntimeError('CUDA error: operation not "
        "permitted when stream is capturing')",
        "into CaptureError: 'capturing bucket 4 ran out of NPU streams",
        "Hook: graphmode_capture_error must match its runtime's signature exactly",
    ),
    "out_accumulates": (
        "[kernels] vendor cuda: prefill_attention(out=) wrote rows",
        "it adds its result to what out held (an out of ones came back as the result + 1)",
        "Hook: graphmode_attention_ops: the out= path must overwrite out, never read it",
    ),
    "fill_of_the_vendors_own_spec": (
        "[declared buffers] vendor camb on cpu, batch 12, bucket 12, step 1 (capture): buffer token_scale live rows",
        "graphmode_fill_buffers did not copy the step's values into the live rows. Buffer token_scale is the "
        "engine's declared step input",
        "Fill every buffer of meta.spec",
    ),
    "staged_from_the_device_buffer": (
        "host staging (step inputs on the host",
        "the runner raised InputError in graphmode_fill_buffers (plugin acme): the step's rows for the "
        "'slot_blocks' buffer are a device tensor",
        "But every step tensor the runner got here is a host tensor: that device tensor is graphmode_fill_buffers's "
        "own, computed from device memory",
        "Hook: graphmode_fill_buffers (plugin acme) must compute what it stages from the step's tensors",
    ),
    # The fourth probe of 2026-11-26.
    "length_columns_of_one_tensor": (
        "[buffers] graphmode_make_buffers made buffer q_start_loc not contiguous (shape (48,), strides (3,)",
        "A device kernel takes a buffer by its pointer",
        "rows of one (3, max_batchs) tensor, not columns of a (max_batchs, 3) one",
    ),
    "one_graph_for_every_bucket": (
        "the runner raised CaptureError: capturing the decode graph of bucket 2: graphmode_make_graph (plugin cuda) "
        "returned the graph object it returned for bucket",
        "Hook: graphmode_make_graph must return a new graph at every call",
    ),
    "lengths_buffer_replaced": (
        "[declared buffers] vendor camb",
        "meta.input_buffers['kv_seqlens'] is another tensor than at the last fill: a hook replaced the buffer",
        "the graphs captured with the old one never see this step's values. Hook: graphmode_fill_buffers must write "
        "every buffer in place",
    ),
    "token_padding_to_the_bucket": (
        "[declared buffers] vendor cuda on cpu, batch 3 x q_len 2, bucket 4",
        "Hook: graphmode_fill_buffers did not reset them",
        "in a graph of q_len 2 the padding token rows run to bucket x q_len (8), and a reset that stops at the "
        "bucket (4 rows, its sequences) leaves them",
    ),
    "max_len_one_below_capacity": (
        "[step context] vendor ppu: the graph context has max_kv_seq_len=127 (the capacity 128 minus one: the last "
        "position, not the length",
        "Hook: graphmode_update_context",
    ),
    # Issue 40's classes.
    "update_path_chosen_by_the_graph": (
        "[option variants] vendor ascend on cpu: under vendor_options {'update_path': 'graph_update'} and "
        "{'update_path': 'task_group'} (GraphSpec.option_variants) a capture and two replays of batch 3 in bucket 4 "
        "ran the same code",
        "So the option reaches nothing that runs, and one of the declared configurations is never what runs",
        "a graph class choosing its own path",
        "Hooks: graphmode_make_graph (read meta.vendor_options)",
    ),
    "cncl_for_every_accelerator": (
        "[distributed backend] vendor camb: graphmode_dist_backend answers 'cncl' for cuda, one of the vendor's "
        "device types, whose torch.distributed backend is 'nccl'",
        "fails at start-up, in init_process_group('cncl')",
        "Hook: graphmode_dist_backend must answer from device.type: the vendor's library for its own device types only",
    ),
    "capture_list_drops_odd_sizes": (
        "[capture list] vendor cuda: at max_batches=48 with no capture list given, graphmode_capture_sizes returned "
        "[1, 2, 4, 6, 8, 10,",
        "it drops [3, 5, 7]. So batches of [3, 5, 7] pad into the next graph kept, unreported",
        "Hook: graphmode_capture_sizes must return the declared list",
    ),
    "update_waits_on_the_host": (
        "[host waits] vendor ascend on cpu, vendor_options {'update_path': 'graph_update'}, batch 3, bucket 4 "
        "(replay): graphmode_update_graph_params (plugin ascend) waited on the host for the device: "
        "Event.synchronize() called at broken_plugins.py:",
        "in _after_last_replay",
        "the host stalls there at every step until the previous replay has finished",
        "update_stream.wait_event(event)",
    ),
    "token_limit_counts_draft_tokens": (
        "[token limit] vendor ascend on cpu, vendor_options {'update_path': 'graph_update'}: a runner of "
        "max_q_len=17, the most tokens per sequence the vendor accepts (graphmode_check_config refuses max_q_len=18",
        "fails a verify step of batch 1 with 17 tokens per sequence (16 draft tokens and the bonus token)",
        "a sequence of 17 query tokens (the layout takes at most 16 per sequence)",
        "Hook: graphmode_check_config (or GraphSpec.max_q_len) must refuse every max_q_len above what the kernels "
        "take, counting the bonus token",
    ),
    # Issue 40's classes (suite B).
    "output_copies_per_token_count": (
        "[served memory] vendor cuda on cpu: plan_memory() planned",
        "once every batch size 1..12 had been served",
        "none more after serving every size again: memory kept per size",
        "copies of the outputs kept per token count. Hook: graphmode_get_outputs",
    ),
    "pushed_rows_of_the_batch_into_parameter_memory": (
        "[pushed host values] vendor zeta on cpu, batch 19, bucket 20 (replay): after graphmode_update_graph_params "
        "the graph's broken_plugins.paged_decode_from_parameters.default (call 1 of 2) reads kv_lens (memory of the "
        "graph's own, int64)",
        "padding rows 19..19 hold [9], not what buffer zeta_kv_lens holds there ([1], its declared padding 1)",
        "Hook: graphmode_update_graph_params must push every row up to the bucket",
    ),
    "replay_on_an_unordered_stream": (
        "[graph equals eager] vendor cuda on cpu, batch 6, bucket 6, step 2 (replay): the runner raised ReplayError "
        "in _SideStreamGraph.replay() (the graph graphmode_make_graph returned)",
        "replayed on <the graph's replay stream>, which is not ordered after the step's input copies on <the "
        "default stream>",
    ),
    "one_pinned_buffer_for_every_step": (
        "[steps back to back] vendor camb on cpu, step 2 of 8 (batch 7, issued while the steps before it may still "
        "run): the runner raised ReplayError in graphmode_fill_buffers (plugin camb): pinned host memory rewritten "
        "while a copy from it is in flight",
        "in _lengths_through_one_pinned_buffer",
    ),
    "bfloat16_cache_read_as_float16": (
        "[kernels] vendor cuda: with the model and its KV cache in bfloat16",
        "with a float16 cache the same steps agree: the bfloat16 cache is read as float16",
        "Hook: graphmode_attention_ops must read the cache in its own dtype",
    ),
    # Suite C (2026-12-02): realistic one-line bugs of classes no plugin above holds.
    "padding_slots_in_a_live_block": (
        "buffer kv_start_indices padding rows 45..47 hold",
        "Hook: graphmode_fill_buffers wrote",
        "cached before this step), so every padding token writes its keys and values over a live sequence's KV",
    ),
    "table_padding_with_a_live_block": (
        "buffer block_offsets padding rows 45..47 hold",
        "Hook: graphmode_fill_buffers wrote",
        "padding rows read a live sequence's KV",
    ),
    "bucket_after_an_equal_size": (
        "graphmode_compatible_size(1) returned 2 (the next capture size: a search that skips a size equal to the "
        "batch, bisect_right where bisect_left is meant), but 1 is a capture size",
    ),
    "positions_of_one_token_per_sequence": (
        "[declared buffers] vendor cuda on cpu, batch 8 x q_len 2",
        "buffer position_ids live rows 8..15 hold",
        "graphmode_fill_buffers did not copy the step's values into the live rows: its first 8 rows (one per "
        "sequence) hold the step's values, rows past them do not",
    ),
    "slots_through_an_int32_view": (
        "buffer kv_start_indices live rows",
        "graphmode_fill_buffers did not copy the step's values into the live rows: its memory holds the step's "
        "values as torch.int32 (written through a view of another dtype, where the buffer is declared torch.int64)",
    ),
    "table_one_column_short": (
        "buffer block_offsets live rows",
        "graphmode_fill_buffers did not copy the step's values into the live rows: only column 1 of this step's "
        "2-column table differ, its last",
    ),
    "kv_lengths_without_the_new_tokens": (
        "buffer kv_seqlens live rows 0..4 hold",
        "graphmode_fill_buffers did not copy the step's values into the live rows: every live row is the step's "
        "value -1: the lengths of the cached tokens only, without this step's 1 new token(s) per sequence",
    ),
    "positions_padded_with_minus_one": (
        "[padding] vendor ppu: the declared padding is not neutral: buffer position_ids padding -1: it holds "
        "positions",
        "declare padding=0. Fix the plugin's GraphSpec (graphmode_graph_spec)",
    ),
    "one_query_per_sequence_in_every_graph": (
        "the runner raised RuntimeError: PPU: a length is above max_q_seq_len=1",
        "Likely cause: the graph context has max_q_seq_len=1, but every replay of this graph carries 2 new tokens "
        "per sequence",
        "Hook: graphmode_update_context",
    ),
    "update_keyed_by_bucket_alone": (
        "[multi-token decode graph equals eager] vendor ascend on cpu, a step of 4 sequences and 8 tokens: the "
        "runner raised ReplayError in AscendGraph.replay()",
        "no parameter update recorded since the last replay",
        "graphmode_update_graph_params skipped or left incomplete",
    ),
}


def run_suite(tmp_path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = cli.main(["--report", str(report), *args])
    return status, json.loads(report.read_text())


def failures(report: dict) -> list[dict]:
    return [r for run in report["runs"] for r in run["records"] if r["outcome"] in ("failed", "error")]


def test_every_bug_class_has_a_broken_plugin_and_a_diagnosis():
    assert set(BROKEN) == set(DIAGNOSES)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_suite_fails_on_a_broken_vendor_for_the_right_reason(name, tmp_path):
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"broken_plugins:{name}", *OPTIONS.get(name, ()), "--", "-x")
    assert status != 0
    failed = failures(report)
    assert failed, f"{name}: the suite reported no failure"
    for part in DIAGNOSES[name]:
        assert part in failed[0]["message"], failed[0]["message"]


# The classes only a device shows, on a GPU: there the emulator's refusals
# are not in play, and the first failure must still name the hook and the
# mechanism (graphmode_conformance.launch_stream, .back_to_back).
GPU_DIAGNOSES = {
    "replay_on_an_unordered_stream": (
        "[graph equals eager] vendor cuda on cuda",
        "_SideStreamGraph.replay() (the graph class graphmode_make_graph returned) switches streams",
        "Hook: graphmode_make_graph",
    ),
    "one_pinned_buffer_for_every_step": (
        "[steps back to back] vendor camb on cuda",
        "one pinned host buffer rewritten for every step while the copy from it is still in flight",
        "in _lengths_through_one_pinned_buffer",
        "Hook: graphmode_fill_buffers",
    ),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the classes only a device shows need a CUDA GPU")
@pytest.mark.parametrize("name", sorted(GPU_DIAGNOSES))
def test_a_gpu_run_of_the_suite_names_the_classes_only_a_device_shows(name, tmp_path):
    status, report = run_suite(tmp_path, "--device", "cuda", "--plugin", f"broken_plugins:{name}", "--", "-x")
    assert status != 0
    failed = failures(report)
    assert failed, f"{name}: the suite reported no failure"
    for part in GPU_DIAGNOSES[name]:
        assert part in failed[0]["message"], failed[0]["message"]


# The originals the broken plugins are made from: their vendor's own hooks,
# given with --plugin. The one with kernels of its own (CUDA's, taking out=)
# runs every test its out= path reaches: the kernel check and every prefill,
# mixed and piecewise step, which its broken variants fail (the rest of the
# suite is CUDA's, which the installed-vendor runs below pass end to end, as
# they pass the other originals, their vendor's hooks unchanged).
END_TO_END_ORIGINALS = ["cuda_out_original"]


@pytest.mark.parametrize("name", END_TO_END_ORIGINALS)
def test_the_suite_passes_on_the_correct_originals(name, tmp_path):
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"broken_plugins:{name}",
                               "-k", "kernels or piecewise or prefill or mixed")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_the_kernels_compute_what_the_reference_kernels_compute"] == "passed", ran
    assert sum(outcome == "passed" for outcome in ran.values()) >= 10, ran


@pytest.mark.parametrize("name", sorted(set(ORIGINALS) - set(END_TO_END_ORIGINALS)))
def test_the_other_originals_are_their_vendors_hooks_unchanged(name):
    vendor = getattr(broken_plugins, name.removesuffix("_original"))
    hooks = {attr for attr in dir(vendor) if attr.startswith("graphmode_")}
    original = ORIGINALS[name]
    assert hooks and hooks == {attr for attr in vars(original) if attr.startswith("graphmode_")}
    assert all(getattr(original, attr) is getattr(vendor, attr) for attr in hooks)


def test_piecewise_failures_of_a_broken_out_path_point_at_the_kernel(tmp_path):
    """Past the [kernels] check, the piecewise steps of a vendor whose out=
    path writes half the rows fail too; their diagnosis names that path
    beside the buffer hooks."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "broken_plugins:out_rows_half_written",
                               "-k", "piecewise", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "the out= path of the vendor's prefill_attention (piecewise graphs pass out=" in message, message


def test_the_power_of_two_plant_passes_on_a_power_of_two_capture_list(tmp_path):
    # Why it runs with 1,3,6,12,24,48: on powers of two the bug is invisible.
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "broken_plugins:padding_to_power_of_two",
                               "--capture-sizes", "1,2,4,8,16,32,48", "-k", "declared_padding")
    assert status == 0, failures(report)


def test_a_vendor_with_a_fixed_capture_list_passes_and_its_header_says_so(tmp_path):
    """Hardware that captures only 1, 2, 4, ..., 32 (tests/plugins/fixed_capture_list.py):
    the suite checks its list against that declaration, and batches 33..48 run eagerly
    (the tests of batch sizes, buckets and capture lists: the rest is CUDA's)."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.fixed_capture_list:plugin",
                               "-k", "batch or bucket or capture")
    assert status == 0, failures(report)
    header = "\n".join(report["runs"][0]["header"])
    assert "max_batches 48, largest graph 32 (declared by the vendor)" in header
    assert "capture list at max_batches=48: [1, 2, 4, 8, 16, 32] (the vendor's policy); batches 33..48 run eagerly" in header
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_batches_above_the_largest_graph_run_eagerly"] == "passed"


def test_a_host_lengths_vendor_with_the_default_capture_policy_passes(tmp_path):
    """Zeta (tests/plugins/zeta.py, an outsider's plugin: host kv lengths
    pushed before every replay) on the default graded capture list: the
    replay test picks its batches inside one bucket of that list, so it
    replays as often on graded sizes as on powers of two. The tests its
    pushed lengths and its buckets reach (the rest is CUDA's hooks, which
    the installed-vendor runs pass end to end)."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:plugin", "-k",
                               "new_host_values or pushed_host or every_batch_size or capture_list or compatible_size or interleaved")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_new_host_values_reach_every_replay"] == "passed"
    assert "capture list at max_batches=48: [1, 2, 3, 4, 5, 6, 7, 8, 10, 12," in "\n".join(report["runs"][0]["header"])


def test_stale_pushed_padding_is_caught_on_a_graded_list_and_named_by_the_host_buffer(tmp_path):
    """Zeta pushing only the live rows of its host lengths (trial 22's slip):
    caught inside a bucket of the graded list (not only on powers of two),
    the diagnosis naming the host buffer it pushes from, not the device
    buffer kv_seqlens that holds the same values."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:pushed_live_rows_only",
                               "-k", "pushed_host", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "[pushed host values] vendor zeta on cpu, batch 19, bucket 20 (replay)" in message, message
    assert "rows 0..18 are this step's zeta_kv_lens" in message, message
    assert "must push every row up to the bucket from its host buffer (meta.input_buffers['zeta_kv_lens'][:bucket]" \
        in message, message


def test_a_pushed_host_list_of_the_batch_not_the_bucket_is_caught(tmp_path):
    """Zeta pushing its host lengths' live rows alone, a list of batch_size
    values into a graph captured with bucket rows (the second outsider's
    slip): its emulated kernel reads rows past the list as length 0, so the
    outputs are right, and the suite passed it; a device kernel reads past
    the host array."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:pushed_batch_rows_only",
                               "-k", "pushed_host", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "[pushed host values] vendor zeta on cpu, batch 19, bucket 20 (replay)" in message, message
    assert "19 values, this step's live rows of zeta_kv_lens, but the graph was captured with 20 rows" in message, message
    assert "(meta.input_buffers['zeta_kv_lens'][:bucket], not [:batch_size])" in message, message


def test_a_runtime_keeping_pushed_lengths_in_parameter_memory_passes_with_every_row_pushed(tmp_path):
    """The runtime of pushed_rows_of_the_batch_into_parameter_memory with
    Zeta's own update (every row of the bucket): its graph-owned lengths
    hold the declared padding, and the check passes."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "broken_plugins:parameter_memory_original",
                               "-k", "pushed_host or new_host_values")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_pushed_host_values_hold_padding_in_padding_rows"] == "passed", ran


def test_a_push_into_one_kernel_call_of_several_names_the_call_left_stale(tmp_path):
    """Zeta updating its first layer's decode call alone: the diagnosis names
    which call of the graph reads the previous step's lengths, not only the
    operator every layer calls."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:pushed_first_call_only",
                               "-k", "pushed_host", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "the graph's zeta.paged_decode.default (call 2 of 2) reads kv_lens" in message, message
    assert "the previous step's values" in message, message


def test_pushed_host_values_are_read_from_an_emulated_graph_behind_a_runtime_handle(tmp_path):
    """The same slip with Zeta's emulated graph behind a DeviceGraph wrapper
    and a runtime handle (wrapper -> handle -> graph), as a runtime of
    another graph interface is wrapped: the suite looked one attribute down
    only, so every check of pushed values passed unseen."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin",
                               "plugins.zeta:wrapped_pushed_batch_rows_only", "-k", "pushed_host", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "19 values, this step's live rows of zeta_kv_lens, but the graph was captured with 20 rows" in message, message


def test_a_graph_whose_emulated_records_are_out_of_sight_is_named(tmp_path):
    """A wrapper keeping its emulated graph in a list: the suite cannot
    read what the update hook pushes, and says so rather than passing."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:graph_out_of_sight",
                               "-k", "pushed_host", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "[pushed host values] vendor zeta on cpu, bucket 20: the graph graphmode_make_graph returned, a " \
        "WrappedZetaGraph, neither is an EmulatedGraph nor holds one" in message, message
    assert "keeping it as an attribute (self.graph), not in a list or dict" in message, message


def test_a_vendor_with_a_sentinel_block_table_and_a_wrapped_graph_passes(tmp_path):
    """Vexa (tests/plugins/vexa.py, the second outsider's plugin): a runtime
    graph of another interface behind a DeviceGraph, two-stage capture sizes
    ending at its largest graph, host kv lengths pushed at every replay, a
    block table with the sentinel -1, (batch, 1) slots."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.vexa:plugin",
                               "-k", "read_no_block or pushed_host or every_batch_size")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_padding_rows_read_no_block_but_the_reserved_one"] == "passed", ran


def test_a_kernel_indexing_the_cache_with_its_sentinel_is_caught(tmp_path):
    """Vexa's kernel using the sentinel -1 as a block index: PyTorch reads
    the cache's last block (a device kernel reads out of range), which block
    0's tests cannot see; the suite passed it before the unowned-block test."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.vexa:sentinel_indexed",
                               "-k", "read_no_block")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "give non-finite outputs" in message, message
    assert "with NaN in blocks " in message and " (sentinel -1) of the cache's " in message, message
    assert "which no sequence owns" in message and "indexing the cache with a block-table sentinel" in message, message


def test_a_kernel_indexing_the_cache_with_a_declared_sentinel_of_minus_three_is_caught(tmp_path):
    """The same slip with the table's declared sentinel -3 (an outsider's
    plugin, 2026-12-02): it reads the third block from the end, which a test
    poisoning only the last block passed."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.vexa:minus_three_indexed",
                               "-k", "read_no_block")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "give non-finite outputs" in message, message
    assert " (sentinel -3) of the cache's " in message, message


def test_a_fused_cache_vendor_pushing_a_length_bound_passes(tmp_path):
    """Quill (tests/plugins/quill.py, the third outsider's plugin): key and
    value caches the two halves of one fused tensor per layer, written by one
    kernel; a decode kernel taking cumulative starts and a host length bound
    pushed into every captured call (a scalar, not a list). The tests its
    traits reach: the kernels against the reference (the fused write), block
    0 through the halves' block_view, and replays with growing lengths."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.quill:plugin",
                               "-k", "reference_kernels or depend_on_the_reserved_block or new_host_values")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_new_host_values_reach_every_replay"] == "passed", ran
    assert ran["test_live_results_never_depend_on_the_reserved_block"] == "passed", ran


@pytest.mark.parametrize(("slip", "named"), [
    ("fused_rebuilt_by_copy", ("on the prefill step", "graphmode_attention_ops's fill_kv_cache: after this step the key "
                               "cache of layer 0, read through block_view, differs from the reference kernels'",
                               "(they hold zeros: nothing reached the cache passed)", "torch.stack")),
    ("cu_seqlens_padded_at_the_end", ("on the decode 1 step", "The caches agree at this step's slots",
                                      "graphmode_attention_ops's paged_decode_attention computes something else")),
])
def test_a_kernel_slip_is_named_by_the_kernel_at_fault(slip, named, tmp_path):
    """Quill's fused cache written through a stacked copy of its halves, and
    its cumulative starts padded at the wrong end: the kernels check names
    the cache write when the cache differs from the reference's at the
    step's slots, else the step's attention kernel (it named the three
    kernels alike)."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"plugins.quill:{slip}",
                               "-k", "reference_kernels")
    assert status != 0
    message = failures(report)[0]["message"]
    for part in named:
        assert part in message, message


def test_a_host_length_bound_pushed_short_is_named(tmp_path):
    """Quill pushing its kernel's max_seqlen_k one short (the longest
    position, not a length): the replay's outputs differ, and the diagnosis
    names the operator, the argument, its value against the step's longest
    kv length, and the hook. Before, it listed four possible causes and
    named none of them. (plugins.quill:bound_kept_at_capture, the capture
    step's maximum kept by graphmode_update_context, gets the same diagnosis.)"""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.quill:bound_off_by_one",
                               "-k", "new_host_values", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "(replay)" in message and "Likely cause: at this replay the graph's quill.paged_decode.default (call 1 of 2)" \
        " reads the host length bound max_seqlen_k=" in message, message
    assert "below this step's longest kv length" in message, message
    assert "into every call at every replay in graphmode_update_graph_params" in message, message


def test_cumulative_starts_moved_from_host_lengths_fail_at_capture(tmp_path):
    """Quill computing cu_seqlens_k from kv_seqlens_cpu and moving it to the
    device inside the captured kernel: CUDA refuses the pageable copy at
    capture; the emulator ran it once and replays read the capture step's
    starts, failing later with a generic diagnosis. Now the capture fails,
    naming the line and the fix."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.quill:cu_seqlens_from_host_lengths",
                               "-k", "new_host_values", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "(capture): the runner raised CaptureError: Tensor.to(device) of pageable host memory inside graph " \
        "capture" in message, message
    assert "plugins/quill.py" in message and "in paged_decode_attention" in message, message
    assert "compute it on the device from device tensors (attn.kv_seqlens, not kv_seqlens_cpu)" in message, message


def test_a_host_length_buffer_padded_with_minus_one_is_refused_by_its_declaration(tmp_path):
    """Zeta's host kv lengths declared with padding=-1 (trial 22's slip, "-1
    writes nothing" copied from the slot buffer): the emulator's kernel masks
    padding rows, so outputs stay right; the declaration check refuses it."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.zeta:lengths_padded_with_minus_one",
                               "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    assert "[padding] vendor zeta: the declared padding is not neutral: buffer zeta_kv_lens (source " \
        "attn_metadata.kv_seqlens_cpu) padding -1: it holds lengths" in message, message
    assert "padding rows read the reserved block 0 with length 1; declare padding=1 (0..16)" in message, message
    assert "graphmode_graph_spec" in message, message


@pytest.mark.parametrize("declared, expected", [
    (BufferSpec("slots_copy", torch.int32, shape=(TOKENS,), padding=0, source="attn_metadata.kv_start_indices"),
     "buffer slots_copy (source attn_metadata.kv_start_indices) padding 0: it holds KV slots"),
    (BufferSpec("table_copy", torch.int32, shape=(SEQUENCES, BLOCKS), padding=-1, source="attn_metadata.block_offsets"),
     "buffer table_copy (source attn_metadata.block_offsets) padding -1: it holds block-table entries"),
    (BufferSpec("q_lens", torch.int32, padding=-1, host=True, source="attn_metadata.q_seqlens"),
     "buffer q_lens (source attn_metadata.q_seqlens) padding -1: it holds lengths"),
    (BufferSpec("kv_lens", torch.int32, padding=17, host=True, source="attn_metadata.kv_seqlens_cpu"),
     "padding 17: it holds lengths, and every padding row would hand the kernel a length of 17 (more than the "
     "reserved block's 16 tokens"),
])
def test_every_copy_of_a_slot_table_or_length_field_pads_like_it(declared, expected):
    problems = _copies_padded_unlike_their_source(CUDA_SPEC.with_buffers(declared), 16)
    assert len(problems) == 1 and expected in problems[0], problems
    neutral = dataclasses.replace(declared, padding={"slots_copy": -1, "table_copy": 0}.get(declared.name, 1))
    assert _copies_padded_unlike_their_source(CUDA_SPEC.with_buffers(neutral), 16) == []


INSTALLED_VENDORS = ["cuda", "ascend", "camb", "maca", "ppu"]


@pytest.mark.parametrize("vendor", INSTALLED_VENDORS)
def test_graphmode_conformance_passes_for_every_installed_vendor_on_the_emulator(vendor, tmp_path, capfd):
    # One vendor per test, so that the five whole-suite runs spread over
    # pytest's workers; the bare command's plan over all five is checked below.
    status, report = run_suite(tmp_path, "--vendor", vendor, "--device", "cpu")
    summary = capfd.readouterr().out
    assert status == 0, summary
    assert [(run["vendor"], run["device"]) for run in report["runs"]] == [(vendor, "cpu")]
    assert "== graphmode conformance summary ==" in summary and f"\n{vendor:<16} cpu" in summary, summary


def test_the_bare_command_on_the_cpu_plans_every_installed_vendor():
    # --device cpu: every vendor on the emulator on any machine (on a GPU machine the
    # bare command tests the detected vendor on its device instead). The runs
    # above are those of this plan.
    assert sorted(cli.targets(None, "cpu", None)) == sorted((vendor, "cpu") for vendor in INSTALLED_VENDORS)


def test_ascend_runs_every_test_on_both_update_paths(tmp_path):
    status, report = run_suite(tmp_path, "--vendor", "ascend", "--device", "cpu", "-k", "capture_step_and_replay")
    assert status == 0, failures(report)
    assert sorted(r["test"] for r in report["runs"][0]["records"]) == [
        "test_capture_step_and_replay_steps_are_both_correct[update_path=graph_update]",
        "test_capture_step_and_replay_steps_are_both_correct[update_path=task_group]",
    ]
    assert "option variants (GraphSpec.option_variants), each test under every one: update_path=graph_update, " \
        "update_path=task_group" in report["runs"][0]["header"]


def test_xfails_file_marks_tests_and_reports_ids_matching_nothing(tmp_path, capfd):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(
        "# known problems of this vendor\n"
        "test_declared_padding_after_shrinks_and_larger_buckets  # upstream keeps stale padding\n"
        "test_that_does_not_exist\n"
    )
    status, report = run_suite(
        tmp_path, "--plugin", "broken_plugins:stale_padding", "--xfails", str(xfails),
        "-k", "declared_padding_after or vendor_describes",
    )
    records = {r["test"]: r for r in report["runs"][0]["records"]}
    assert records["test_declared_padding_after_shrinks_and_larger_buckets"]["outcome"] == "xfailed"
    assert records["test_vendor_describes_itself"]["outcome"] == "passed"
    assert status == 0
    assert "xfail ids matching no test: test_that_does_not_exist" in capfd.readouterr().out


def test_report_header_names_vendor_device_and_versions(tmp_path):
    status, report = run_suite(tmp_path, "--vendor", "maca", "--device", "cpu", "-k", "vendor_describes")
    header = "\n".join(report["runs"][0]["header"])
    assert status == 0
    assert "vendor maca (plugin 0.1.0)" in header
    assert "device cpu (CPU graph emulator); torch" in header and "graphmode 0.1.0" in header


def test_a_vendor_whose_runtime_needs_an_update_before_every_replay_passes(tmp_path):
    """Lumen (tests/plugins/lumen.py, the fourth outsider's plugin, written
    from docs/ alone): a runtime graph refusing any replay without an
    explicit update of its captured decode calls, host kv lengths int64
    (batch, 1), a -1 block-table sentinel, a heads-first KV cache, a capture
    policy of its own and typed options choosing the update path. One
    variant, the tests its traits reach."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.lumen:plugin", "--variant",
                               "update_mode=per_call", "-k", "new_host_values or read_no_block")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_new_host_values_reach_every_replay[update_mode=per_call]"] == "passed", ran
    assert "capture list at max_batches=48: [1, 2, 4, 8, 16, 24, 32, 40, 48]" in "\n".join(report["runs"][0]["header"])


@pytest.mark.parametrize(("slip", "named"), [
    # Its runtime refused the replay: the error came from no hook, and named none.
    ("update_skipped_when_batch_unchanged", ("(replay): the runner raised RuntimeError in LumenGraph.replay() (the "
                                             "graph graphmode_make_graph returned): LUMEN_ERR_TASK_NOT_UPDATED",
                                             "an update graphmode_update_graph_params skipped")),
    # The kernel's shape error alone, naming no hook.
    ("pushed_for_the_largest_bucket", ("Likely cause: at this replay the graph's lumen.paged_decode.default (call 1 "
                                       "of 2) reads kv_lens, a host list of 48 values (every row of a buffer",
                                       "captured with 8 rows", "meta.input_buffers[name][:bucket]")),
    ("lengths_not_on_the_host", ("(capture): the runner raised CaptureError: Tensor.tolist() inside graph capture",
                                 "in paged_decode_attention", "a buffer declared BufferSpec(host=True)")),
])
def test_an_update_per_replay_slip_is_named_with_its_hook(slip, named, tmp_path):
    """Lumen's slips whose first failure named no hook or no fix before."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"plugins.lumen:{slip}", "--variant",
                               "update_mode=all_calls", "-k", "capture_step_and_replay", "--", "-x")
    assert status != 0
    message = failures(report)[0]["message"]
    for part in named:
        assert part in message, message


def test_a_vendor_pushing_int64_host_lengths_by_graph_update_passes(tmp_path):
    """Nimbus (tests/plugins/nimbus.py, the fifth outsider's plugin, written
    from the docs alone): int64 host kv lengths re-issued into every captured
    decode call by its runtime graph's update(seq_lens=...), (tokens, 1)
    int64 slots, a block table of its own padded -1, buckets 1, 2, 4 then
    multiples of 8. The tests its traits reach, at a small max_batches."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", "plugins.nimbus:plugin",
                               "--max-batches", "12", "-k",
                               "read_no_block or new_host_values or depend_on_the_reserved_block")
    assert status == 0, failures(report)
    ran = {r["test"]: r["outcome"] for run in report["runs"] for r in run["records"]}
    assert ran["test_new_host_values_reach_every_replay"] == "passed", ran
    assert ran["test_padding_rows_read_no_block_but_the_reserved_one"] == "passed", ran


@pytest.mark.parametrize(("slip", "tests", "named"), [
    ("lengths_not_pushed", "new_host_values", (
        "(replay)", "nimbus.paged_decode.default (call 1 of 2) reads seq_lens",
        "the previous step's values", "Hook: graphmode_update_graph_params must push")),
    ("lengths_padded_like_slots", "declared_padding_is_neutral", (
        "buffer seq_lens_host (source attn_metadata.kv_seqlens_cpu) padding -1", "declare padding=1")),
    ("table_built_on_the_host", "new_host_values", (
        "Tensor.tolist() of device memory", "in _table_on_the_host",
        "source function of buffer nimbus_table", "Fix the BufferSpec 'nimbus_table' of graphmode_graph_spec")),
])
def test_a_nimbus_slip_is_named_by_hook_and_mechanism(slip, tests, named, tmp_path):
    """Nimbus's planted slips: lengths not pushed at a replay, host lengths
    padded like slots, and its table's source function reading the step's
    table on the host (named as the default fill alone before 2026-11-26,
    which points a vendor at graphmode's own hook)."""
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"plugins.nimbus:{slip}",
                               "--max-batches", "12", "-k", tests)
    assert status != 0
    message = failures(report)[0]["message"]
    for part in named:
        assert part in message, message


def test_a_sentinel_table_copied_from_block_offsets_is_told_how_to_derive_it():
    """Lumen's -1-padded table copied from block_offsets as it is: refused
    (unused columns point at block 0), and the fix was "declare padding=0",
    wrong for a kernel that needs the sentinel; now it names the source."""
    spec = CUDA_SPEC.with_buffers(BufferSpec("table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=-1,
                                             source="attn_metadata.block_offsets"))
    (problem,) = _copies_padded_unlike_their_source(spec, 16)
    assert "a kernel marking no block with -1 keeps padding -1 and derives the source" in problem, problem

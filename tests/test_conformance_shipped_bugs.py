"""The conformance suite against bugs vendor plugins have shipped
(``tests/shipped_bugs.py``): its first failure on each names the hook and
the mechanism. The correct vendors these vary pass the whole suite, the
checks added for these bugs included (``test_conformance_suite.py`` runs
every installed vendor end to end)."""

from __future__ import annotations

import pytest
import torch
from shipped_bugs import BROKEN, OPTIONS
from test_conformance_suite import failures, run_suite

from graphmode_conformance.hooks import _overlapping

pytestmark = pytest.mark.slow

DIAGNOSES = {
    "padding_repeats_the_last_request": (
        "[declared buffers] vendor camb, graphmode_fill_buffers of a batch of 45 in bucket 48: buffer input_ids "
        "padding rows 45..47 hold",
        "They repeat live row 44: the batch padded by repeating a live request; padding rows must not share its "
        "slots, block table or lengths",
        "Padding rows 45..47 of kv_start_indices hold",
        "slots this step's live tokens write, so the graph writes padding tokens' keys and values into a live "
        "sequence's KV block",
    ),
    "no_push_for_a_full_bucket": (
        "batch 8, bucket 8, step 2 (replay): the runner raised ReplayError",
        "on the device this replay would hang",
    ),
    "active_mask_per_bucket": (
        "buffer x_active_mask padding rows 33..47 hold [True, True",
        "not the declared padding False",
        "padding left stale after the batch shrank from 48 to 33 inside bucket 48",
    ),
    "extra_buffer_at_capture_only": (
        "[step context] vendor acme",
        "graphmode_update_context wrote into buffer slot_blocks",
        "It runs before each capture only, never on replay, so every replay would read slot_blocks as the capture "
        "step left it",
    ),
    "stage_three_rounds_down": (
        "[hook contract] vendor ascend: graphmode_compatible_size(257) returned 256; it must be a capture size >= 257",
    ),
    "outputs_cut_to_the_batch": (
        "[multi-token decode graph equals eager] vendor cuda on cpu, batch 8 x q_len 2, bucket 8",
        "graph output has shape (1, 8, 256), eager (1, 16, 256)",
        "outputs cut short: the graph's output holds 16 token rows, but graphmode_get_outputs returned 8 of the "
        "step's 16 tokens: it cut to batch_size (8 sequences), not num_tokens",
    ),
    "aliased_length_buffers": (
        "[buffers] graphmode_make_buffers made buffers",
        "q_seqlens",
        "kv_seqlens",
        "in overlapping memory",
        "every fill of one overwrites the other",
    ),
    "first_table_row_only": (
        "buffer block_offsets live rows 1..4 hold",
        "graphmode_fill_buffers did not copy the step's values into the live rows",
    ),
    "max_len_from_the_step_table": (
        "[step context] vendor camb: the graph context has max_kv_seq_len=",
        "the capture step's own block-table width times the block size",
        "Hook: graphmode_update_context",
    ),
    "int16_slots": ("buffer kv_start_indices has dtype torch.int16, not int32/int64",),
    "slot_minus_one_wraps": (
        "(replay): the graph step changed 1 key-cache slots of layer 0 that no live token of this step writes",
        "is the cache's last slot: the vendor's fill_kv_cache (graphmode_attention_ops) indexed the cache with a "
        "padding row's slot -1",
    ),
    "slots_per_sequence": (
        "[declared buffers] vendor cuda on cpu, batch 8 x q_len 2, bucket 8, step 2 (capture): buffer "
        "kv_start_indices live rows 8..15 hold [-1, -1, -1, -1, -1, -1, -1, -1]",
        "graphmode_fill_buffers did not copy the step's values into the live rows",
    ),
    "unscaled_query_starts": (
        "[declarations] vendor cuda: buffer q_start_loc (query starts, written by no step, padding 'row_index') is "
        "not q_len_scaled, but the vendor takes multi-token decode graphs",
        "Declare it q_len_scaled=True in graphmode_graph_spec",
    ),
}


# The suite's test that meets a bug first, for the bugs it meets late (a
# minute into a loaded CI run each): the run goes to that test only.
FIRST_MET_BY = {
    "outputs_cut_to_the_batch": "every_q_len_with_batch_churn",
    "slots_per_sequence": "every_q_len_with_batch_churn",
    "slot_minus_one_wraps": "warmup_reset_and_recapture_in_every_mode",
}


def test_every_shipped_bug_has_a_diagnosis():
    assert set(BROKEN) == set(DIAGNOSES)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_suite_names_each_shipped_bug(name, tmp_path):
    only = ["-k", FIRST_MET_BY[name]] if name in FIRST_MET_BY else []
    status, report = run_suite(tmp_path, "--device", "cpu", "--plugin", f"shipped_bugs:{name}", *OPTIONS.get(name, ()),
                               "--", "-x", *only)
    assert status != 0
    failed = failures(report)
    assert failed, f"{name}: the suite reported no failure"
    for part in DIAGNOSES[name]:
        assert part in failed[0]["message"], failed[0]["message"]


def test_views_of_one_tensor_are_separate_buffers_unless_they_overlap():
    # lmdeploy's q_start_loc, q_seqlens, kv_seqlens: rows of one (3, max_batchs) tensor.
    rows = torch.zeros(3, 8, dtype=torch.int32)
    assert _overlapping({"q_start_loc": rows[0], "q_seqlens": rows[1], "kv_seqlens": rows[2]}) is None
    assert _overlapping({"q_seqlens": rows[1], "kv_seqlens": rows[1]}) == ("kv_seqlens", "q_seqlens")
    assert _overlapping({"whole": rows, "kv_seqlens": rows[2]}) is not None
    assert _overlapping({"a": torch.zeros(4), "b": torch.zeros(4)}) is None

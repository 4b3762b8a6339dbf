"""PPU's maxima: graph contexts pass bounds that hold at every replay, and the
reference kernel enforces FlashAttention's varlen contract (a positive
max_seqlen_k, no sequence above it) without reading the device on the host."""

from __future__ import annotations

import pytest
import torch
from broken_plugins import BROKEN, variant
from setups import tiny_setup

import graphmode
import graphmode_ppu.plugin as ppu
from graphmode import InputError
from graphmode_ppu.ops import PPUAttentionOps


def _graph_context(setup, batch: int):
    step = setup.engine.decode(setup.prefill(batch))
    meta = setup.runner.graph_meta()
    bucket = setup.runner.bucket_of(batch)
    hook = setup.runner.vendor.hook
    with torch.inference_mode():
        hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        return hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket).attn_metadata


def test_graph_context_passes_the_block_table_capacity():
    setup = tiny_setup("ppu", block_size=16, width=8)
    attn = _graph_context(setup, 3)
    assert attn.max_kv_seq_len == 8 * 16 and attn.max_q_seq_len == 1


def test_the_ppu_kernel_is_the_enforcing_reference():
    assert isinstance(graphmode.load_vendor("ppu").attention_ops(), PPUAttentionOps)


@pytest.mark.parametrize("field, value", [("max_kv_seq_len", -1), ("max_kv_seq_len", 0), ("max_q_seq_len", -1)])
def test_the_kernel_refuses_a_maximum_that_is_not_positive(field, value):
    setup = tiny_setup("ppu")
    attn = _graph_context(setup, 3).replace(**{field: value})
    ops, cache = PPUAttentionOps(), setup.graph_cache[0]
    query = torch.zeros(4, 4, 16)
    with pytest.raises(InputError, match=rf"{field}={value}: PPU's FlashAttention varlen kernel needs a positive upper bound"):
        ops.paged_decode_attention(query, cache[0], cache[1], attn, 1.0)


def test_a_plugin_passing_minus_one_fails_its_first_graph_step():
    """Today's contract ('-1: derive it') under the enforcing kernel."""
    setup = tiny_setup("minus_one_max_len", plugin=BROKEN["minus_one_max_len"])
    seqs = setup.prefill(3, [4, 9, 17])
    with pytest.raises(InputError, match=r"max_kv_seq_len=-1: PPU's FlashAttention varlen kernel"):
        setup.decode(seqs)


@graphmode.hookimpl(wrapper=True)
def _capture_step_max(meta, inputs, batch_size, bucket):
    static = yield
    static.attn_metadata.max_kv_seq_len = inputs.attn_metadata.max_kv_seq_len
    return static


def test_a_bound_below_a_later_length_fails_at_replay_not_at_capture():
    """The capture step's maximum is frozen into the graph; the kernel checks
    lengths against it on the device, so capture works (no host read) and
    the first replay with a longer sequence fails."""
    plugin = variant(ppu, "capture_step_max", graphmode_update_context=_capture_step_max)
    setup = tiny_setup("capture_step_max", plugin=plugin)
    seqs = setup.prefill(3, [4, 9, 17])
    setup.decode(seqs)  # captures with max_kv_seq_len=18
    assert setup.runner.stats.captures == 1
    with pytest.raises(RuntimeError, match=r"PPU: a length is above max_kv_seq_len=18"):
        setup.decode(seqs)  # kv lengths 5, 10, 19
    assert setup.runner.stats.replays == 0


def test_graph_equals_eager_as_sequences_cross_blocks():
    setup = tiny_setup("ppu", block_size=16, width=8)
    seqs = setup.prefill(5, [1, 14, 15, 31, 47])
    for _ in range(4):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=0)
    assert setup.runner.stats.replays == 3 and setup.caches_close()

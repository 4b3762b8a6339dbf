"""Rows of zero new tokens: padding rows an engine adds itself (vLLM pads
``seq_lens`` with 0), legal in every step whatever the rest of the step
(docs/engines.md, "Rows of zero new tokens"). They run, write no KV, and
their outputs are cut: the step's result holds its tokens only, equal to
eager's on the same inputs, in every execute mode and on every vendor.

Before, such a row was accepted beside enough tokens (a prefill of [5, 0, 3])
and refused beside too few (``InputError: ... every scheduled sequence adds
at least one``), and a decode step of [2, 0] was refused as no decode."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode.model.engine import with_padding_rows

VENDORS = ["cuda", "ascend", "camb", "maca", "ppu"]
MODES = ["eager", "graph", "piecewise", "full_and_piecewise"]


def _slots_view(setup, cache):
    """Every cache tensor as (slots, features), whatever the vendor's layout."""
    ops, head_dim = setup.model.ops, setup.model.config.head_dim
    return [ops.block_view(t, head_dim).reshape(-1, ops.block_view(t, head_dim)[0, 0].numel())
            for pair in cache for t in pair]


def _run_both(setup, step):
    """The step through the runner and eagerly; the bytes the runner's cache
    changed outside the step's slots."""
    slots = step.attn_metadata.kv_start_indices.reshape(-1)
    written = torch.zeros(_slots_view(setup, setup.graph_cache)[0].shape[0], dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    before = [v.clone() for v in _slots_view(setup, setup.graph_cache)]
    with torch.inference_mode():
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    foreign = sum(int(((v != old) & ~written[:, None]).sum()) for v, old in zip(_slots_view(setup, setup.graph_cache), before))
    return graph, eager, foreign


def _random_caches(setup):
    torch.manual_seed(0)
    for graph_pair, eager_pair in zip(setup.graph_cache, setup.eager_cache):
        for g, e in zip(graph_pair, eager_pair):
            g.normal_()
            e.copy_(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vendor", VENDORS)
def test_padding_rows_run_write_no_kv_and_are_cut_in_every_mode(vendor, mode):
    max_q_len = 1 if vendor == "camb" else 2  # Camb's decode kernel takes one query per sequence
    setup = tiny_setup(vendor, max_batches=8, width=4, execute_mode=mode, max_q_len=max_q_len,
                       capture_batch_sizes=[1, 2, 4, 8], capture_token_sizes=[2, 4, 8, 16, 32])
    _random_caches(setup)  # any write outside the step's slots shows
    seqs = setup.prefill(3, [5, 7, 3])
    engine = setup.engine
    steps = [
        with_padding_rows(engine.decode(seqs), [0]),  # first
        with_padding_rows(engine.decode(seqs), [2, 4]),  # middle and last
        with_padding_rows(engine.decode(seqs[:1]), [1, 2, 3]),  # one token for four rows
        with_padding_rows(engine.decode(seqs, 2), [1]),  # a verify step of [2, 0, 2, 2]
        with_padding_rows(engine.decode(seqs[:1], 2), [1]),  # [2, 0]: as many tokens as rows
        with_padding_rows(engine.prefill(seqs[:2], [3, 1]), [0, 3, 4, 5]),  # fewer tokens than rows
        with_padding_rows(engine.prefill(seqs, [2, 1, 4]), [3]),  # more tokens than rows
    ]
    for step in steps:
        graph, eager, foreign = _run_both(setup, step)
        assert graph.shape == eager.shape == (1, step.num_tokens, setup.model.config.vocab_size)  # cut to the tokens
        assert torch.isfinite(graph).all()
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
        assert foreign == 0
    assert setup.caches_close()
    stats = setup.runner.stats
    if mode in ("piecewise", "full_and_piecewise"):  # every step in piecewise graphs
        assert not stats.eager_steps
    elif mode == "graph":  # no uniform decode (host facts cannot place tokens in rows): eager, counted
        assert stats.eager_steps == {"mixed_q_len": 5, "prefill": 3}  # the prefill setting up, and two above


def test_one_rule_whatever_the_neighbours():
    # The same padding row beside one token and beside several: both legal.
    setup = tiny_setup("cuda", max_batches=8, width=4, execute_mode="graph", capture_batch_sizes=[1, 2, 4, 8])
    seqs = setup.prefill(2, [3, 4])
    for step in (with_padding_rows(setup.engine.prefill(seqs[:1], [1]), [1, 2]),
                 with_padding_rows(setup.engine.prefill(seqs, [4, 2]), [1])):
        graph, eager, foreign = _run_both(setup, step)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
        assert foreign == 0


def test_padding_rows_in_host_built_steps_and_debug_mode():
    # A host-built step (host staging decided at the first graph step) and debug mode's value checks.
    setup = tiny_setup("ascend", max_batches=8, width=4, execute_mode="full_and_piecewise", host_inputs=True,
                       debug=True, capture_batch_sizes=[1, 2, 4, 8], capture_token_sizes=[2, 4, 8, 16])
    seqs = setup.prefill(3, [5, 7, 3])
    for rows in ([0], [1, 3], [3]):
        graph, eager, foreign = _run_both(setup, with_padding_rows(setup.engine.decode(seqs), rows))
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
        assert foreign == 0
    assert not setup.runner.stats.eager_steps  # the prefill and the padded decode steps: piecewise graphs


def test_a_step_of_padding_rows_alone_is_refused():
    # No token at all: nothing to compute. The one refusal of the rule, for the step, not for its rows.
    setup = tiny_setup("cuda")
    seqs = setup.prefill(2, [3, 4])
    step = setup.engine.prefill(seqs, [0, 0])
    with pytest.raises(Exception, match=r"a step of 2 sequences and 0 new tokens: a step needs at least one new token"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)

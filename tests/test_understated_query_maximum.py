"""A verify step (several new tokens per sequence) whose ``max_q_seq_len``
understates its real query lengths, its tokens equal to batch x the stated
maximum (``q_seqlens`` [3, 1] under ``max_q_seq_len=2``), passes host facts
as a uniform step of 2 tokens per sequence, and its full graph replays 2 for
each: 0.04 to 0.37 off eager (issue 40). Refused from host values where the
step is built on the host, and in debug mode; a device-built step's query
lengths are device values, which the runner does not read outside debug
mode (a synchronisation per step): docs/engines.md, "Bad step inputs"."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode import InputError

# Camb graphs one token per sequence only (GraphSpec.max_q_len 1): its verify steps run eagerly.
VERIFY_VENDORS = ["cuda", "ascend", "maca", "ppu"]

_NAMED = (r"max_q_seq_len=2, but sequence 0 has q_seqlens=3: the maximum understates the step's query lengths, "
          r"so its 4 tokens for 2 sequences \(batch x max_q_seq_len\) passed as a decode step of 2 token\(s\) per "
          r"sequence.*Pass the step's real max_q_seq_len \(the largest q_seqlens, 3\)")


def _understated(vendor, mode, **options):
    """A runner whose verify graph (bucket 2, q_len 2) is captured, and a step of
    query lengths [3, 1] under max_q_seq_len=2."""
    setup = tiny_setup(vendor, capture_batch_sizes=[1, 2, 4], execute_mode=mode, capture_token_sizes=[4, 8, 16],
                       max_q_len=4, **options)
    seqs = setup.prefill(2, [5, 9])
    for _ in range(2):  # a capture, then a replay
        graph, eager = setup.decode(seqs, 2)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    step = setup.engine.decode(seqs, [3, 1])
    return setup, step, step.attn_metadata.replace(max_q_seq_len=2)


def _run(setup, step, attn):
    with torch.inference_mode():
        return setup.runner(step.input_ids, step.position_ids, setup.graph_cache, attn)


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise", "piecewise"])
@pytest.mark.parametrize("vendor", VERIFY_VENDORS)
def test_a_host_built_verify_step_under_an_understated_maximum_is_refused_naming_it(vendor, mode):
    setup, step, attn = _understated(vendor, mode, host_inputs=True)
    replays = setup.runner.stats.replays + setup.runner.stats.piecewise_replays
    message = _NAMED if mode != "piecewise" else (  # piecewise steps' own check (check_query_lengths)
        r"sequence 0 has q_seqlens=3, above max_q_seq_len=2: .*Pass the step's real max_q_seq_len")
    with pytest.raises(InputError, match="^" + message):
        _run(setup, step, attn)
    assert setup.runner.stats.replays + setup.runner.stats.piecewise_replays == replays
    graph = _run(setup, step, step.attn_metadata).clone()  # the real maximum: eager (or piecewise), and right
    with torch.inference_mode():
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
def test_debug_mode_refuses_a_device_built_one_naming_the_maximum(mode):
    setup, step, attn = _understated("cuda", mode, debug=True)
    with pytest.raises(InputError, match="^debug mode: " + _NAMED):
        _run(setup, step, attn)

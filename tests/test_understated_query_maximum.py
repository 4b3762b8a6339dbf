"""A verify step (several new tokens per sequence) whose ``max_q_seq_len``
understates its real query lengths, its tokens equal to batch x the stated
maximum (``q_seqlens`` [3, 1] under ``max_q_seq_len=2``), passes host facts
as a uniform step of 2 tokens per sequence, and its full graph replays 2 for
each: 0.04 to 0.37 off eager (issue 40). Refused from host values where the
step is built on the host, and in debug mode. A device-built step is refused
where its host kv lengths prove it (a sequence whose kv_seqlens_cpu is below
the stated maximum adds fewer tokens, so another adds more), with no copy;
else its query lengths are read to the host (one copy a verify step,
counted) and checked: docs/engines.md, "Bad step inputs". (More tokens than batch x the maximum is refused for every
step, by host facts: tests/test_bad_step_inputs.py.)"""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode import InputError
from graphmode.emulator import is_host
from graphmode.model.engine import with_padding_rows

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


_PROVED = (r"max_q_seq_len=2, but sequence 1 has kv_seqlens_cpu=0: a sequence's KV length counts this step's new "
           r"tokens, so it adds at most 0, and the step's 4 tokens for 2 sequences \(batch x max_q_seq_len\) need "
           r"another sequence to add more than 2: the maximum understates.*Pass the step's real max_q_seq_len")


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VERIFY_VENDORS)
def test_a_device_built_one_whose_host_kv_lengths_prove_it_is_refused_without_debug_mode(vendor, mode):
    """q_seqlens [4, 0] (a padding row, kv length 0) under max_q_seq_len=2:
    4 tokens for 2 sequences read as 2 each, but the padding row's host kv
    length says it adds none. Before, its graph replayed 2 tokens for each."""
    setup, _, _ = _understated(vendor, mode)
    padded = with_padding_rows(setup.engine.decode(setup.engine.live()[:1], 4), [1])
    assert not is_host(padded.attn_metadata.q_seqlens)  # device-built: query lengths on the device only
    replays = setup.runner.stats.replays
    with pytest.raises(InputError, match="^" + _PROVED):
        _run(setup, padded, padded.attn_metadata.replace(max_q_seq_len=2))
    assert setup.runner.stats.replays == replays


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VERIFY_VENDORS)
def test_a_device_built_one_the_host_cannot_tell_is_refused_from_its_query_lengths_read(vendor, mode):
    """[3, 1] under max_q_seq_len=2, every host kv length at least 2, has the
    host facts of [2, 2]. Before, its graph replayed 2 tokens for each
    sequence, silently; now its query lengths are read (one copy) and it is
    refused naming the maximum."""
    setup, step, attn = _understated(vendor, mode)
    assert not is_host(attn.q_seqlens)
    replays, reads = setup.runner.stats.replays, setup.runner.stats.verify_length_reads
    with pytest.raises(InputError, match="^" + _NAMED):
        _run(setup, step, attn)
    assert setup.runner.stats.replays == replays
    assert setup.runner.stats.verify_length_reads == reads + 1


def test_a_device_built_uniform_verify_step_replays_counting_its_read_and_saying_so_once(caplog):
    setup = tiny_setup("cuda", capture_batch_sizes=[1, 2, 4], max_q_len=4)
    seqs = setup.prefill(2, [5, 9])
    graph, eager = setup.decode(seqs, 2)  # the capture
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    for _ in range(2):
        graph, eager = setup.decode(seqs, 2)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    said = [r for r in caplog.records if "reads q_seqlens and q_start_loc to the host once per such step" in r.message]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert setup.runner.stats.replays_by_q_len[2] == 2
    assert setup.runner.stats.verify_length_reads == 3  # the capture's step too
    assert "3 verify steps' query lengths read to the host" in setup.runner.stats.summary()

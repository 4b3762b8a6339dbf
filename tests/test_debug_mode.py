"""Debug mode (debug=True or GRAPHMODE_DEBUG=1): each graph step's device
values are read once and refused when a graph would silently give wrong
results; replays check that no captured tensor moved."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode import ConfigError, InputError


def _setup(**options):
    setup = tiny_setup(capture_batch_sizes=[2, 4], cache_blocks=40, debug=True, **options)
    seqs = setup.prefill(3, [3, 20, 9])  # blocks: one, two, one
    return setup, seqs


def _run(setup, step, **changes):
    with torch.inference_mode():
        return setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata.replace(**changes))


def test_debug_mode_is_off_by_default_and_the_environment_switches_it(monkeypatch):
    assert tiny_setup().runner.config.debug is False
    monkeypatch.setenv("GRAPHMODE_DEBUG", "1")
    assert tiny_setup().runner.config.debug is True
    monkeypatch.setenv("GRAPHMODE_DEBUG", "0")
    assert tiny_setup(debug=True).runner.config.debug is False
    monkeypatch.setenv("GRAPHMODE_DEBUG", "maybe")
    with pytest.raises(ConfigError, match=r"\$GRAPHMODE_DEBUG='maybe': use 1 \(debug checks on\) or 0 \(off\)"):
        tiny_setup()


def test_right_steps_pass_and_give_the_eager_results():
    setup, seqs = _setup()
    for batch in (3, 3, 2, 3, 2):
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.runner.stats.replays == 3


def _table(step, row, column, value):
    table = step.attn_metadata.block_offsets.clone()
    table[row, column] = value
    return table


def _slots(step, row, value):
    slots = step.attn_metadata.kv_start_indices.clone()
    slots[row] = value
    return slots


CASES = {
    "slot in another sequence's block": (
        lambda step: {"kv_start_indices": _slots(step, 0, int(step.attn_metadata.block_offsets[1, 0]) * 16 + 5)},
        r"token 0 \(sequence 0\) writes slot \d+ \(block \d+\), outside the sequence's own blocks \[\d+\]"),
    "slot at the wrong offset": (
        lambda step: {"kv_start_indices": _slots(step, 2, int(step.attn_metadata.kv_start_indices[2]) + 1)},
        r"token 2 \(sequence 2\) writes slot \d+, but its position kv_seqlens-1=10 lives at slot \d+"),
    "the slot of another sequence's token": (
        lambda step: {"kv_start_indices": _slots(step, 1, int(step.attn_metadata.kv_start_indices[0]))},
        r"token 1 \(sequence 1\) writes slot \d+ \(block \d+\), outside the sequence's own blocks \[\d+, \d+\]"),
    "block id past the cache": (
        lambda step: {"block_offsets": _table(step, 1, 5, 40)},
        r"sequence 1's block table holds block id 40 \(column 5\), outside the cache's 40 blocks \(0..39\)"),
    "negative block id": (
        lambda step: {"block_offsets": _table(step, 0, 7, -1)},
        r"sequence 0's block table holds block id -1 \(column 7\), outside the cache's 40 blocks"),
    "a sequence on the reserved block": (
        lambda step: {"block_offsets": _table(step, 1, 1, 0)},
        r"sequence 1 uses block 0 \(column 1 of its table, within its kv_seqlens=22\); block 0 is reserved"),
    "kv length above the table": (
        lambda step: {"kv_seqlens": torch.tensor([5, 22, 200], dtype=torch.int32),
                      "kv_seqlens_cpu": torch.tensor([5, 22, 200], dtype=torch.int32)},
        r"sequence 2 has kv_seqlens=200, above the 128 tokens its block table can address \(8 blocks x block_size=16\)"),
    "kv length below 1": (
        lambda step: {"kv_seqlens": torch.tensor([5, 0, 11], dtype=torch.int32),
                      "kv_seqlens_cpu": torch.tensor([5, 0, 11], dtype=torch.int32)},
        r"sequence 1 has kv_seqlens=0, below 1"),
    "host lengths disagree": (
        lambda step: {"kv_seqlens_cpu": torch.tensor([5, 23, 11], dtype=torch.int32)},
        r"sequence 1 has kv_seqlens_cpu=23 on the host but kv_seqlens=22 on the device"),
    "query lengths not one": (
        lambda step: {"q_seqlens": torch.tensor([1, 2, 0], dtype=torch.int32)},
        r"sequence 1 \(row 1\) has q_seqlens=2, but this graph decode step has 1 new token\(s\) per sequence"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_device_values_are_refused_before_the_graph_runs(case):
    changes, message = CASES[case]
    setup, seqs = _setup()
    setup.decode(seqs)  # captures bucket 4
    step = setup.engine.decode(seqs)
    with pytest.raises(InputError, match="debug mode: " + message):
        _run(setup, step, **changes(step))
    assert setup.runner.stats.replays == 0


def test_two_tokens_writing_one_slot_are_refused():
    # Both tokens in the same sequence's own block cannot happen in a decode
    # (one token per sequence); a sequence listed twice can.
    setup, seqs = _setup()
    setup.decode(seqs)
    step = setup.engine.decode([seqs[0], seqs[0]])
    twice = step.attn_metadata.replace(kv_start_indices=step.attn_metadata.kv_start_indices[[1, 1]],
                                       kv_seqlens=step.attn_metadata.kv_seqlens[[1, 1]],
                                       kv_seqlens_cpu=step.attn_metadata.kv_seqlens_cpu[[1, 1]])
    with pytest.raises(InputError, match=r"debug mode: tokens \[0, 1\] \(sequences \[0, 1\]\) all write slot \d+"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, twice)


def _moved_cache(setup):
    key, _ = setup.graph_cache[0]
    key.set_(key.clone())  # same tensor object, new memory: the identity check cannot see it


def _moved_weight(setup):
    weight = setup.model.layers[1].down_proj.weight
    weight.data = weight.data.clone()  # a weight reload into new tensors


@pytest.mark.parametrize("move, message", [
    # The KV cache's pointers are compared without debug mode too (graphmode.runner.cache_checks).
    (_moved_cache, r"past_key_values tensor 0 of 4 has new memory \(data_ptr 0x[0-9a-f]+, captured at 0x"),
    (_moved_weight, r"debug mode: model parameter 'layers.1.down_proj.weight' is at address 0x[0-9a-f]+, but the "
     r"graph of bucket 4"),
])
def test_a_captured_tensor_whose_memory_moved_is_refused_at_replay(move, message):
    setup, seqs = _setup()
    setup.decode(seqs)
    with torch.inference_mode():
        move(setup)
    with pytest.raises(InputError, match=message + r".*call runner.reset\(\)"):
        setup.decode(seqs)
    setup.runner.reset()
    graph, eager = setup.decode(seqs)  # captured again on the new memory
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


VENDORS = ["cuda", "ascend", "camb", "maca", "ppu"]


def _piecewise(vendor, mode):
    return tiny_setup(vendor, capture_batch_sizes=[2, 4], cache_blocks=40, debug=True, execute_mode=mode,
                      capture_token_sizes=[8, 16, 32])


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VENDORS)
def test_debug_mode_checks_piecewise_steps_addresses(vendor, mode):
    # A weight reload without reset: the piecewise graph replayed the old weights, silently.
    setup = _piecewise(vendor, mode)
    setup.prefill(2, [3, 4])  # captures token bucket 8
    with torch.inference_mode():
        _moved_weight(setup)
    with pytest.raises(InputError, match=r"debug mode: model parameter 'layers.1.down_proj.weight' is at address "
                       r"0x[0-9a-f]+, but the graph of token bucket 8 \(piecewise\) captured it at .*runner.reset"):
        setup.prefill(2, [2, 5])
    setup.runner.reset()
    setup.prefill(2, [2, 5])  # captured again on the new weights


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VENDORS)
def test_debug_mode_checks_piecewise_steps_values(vendor, mode):
    # A block id past the cache in a piecewise step crashed with an IndexError.
    setup = _piecewise(vendor, mode)
    seqs = setup.prefill(2, [3, 4])
    step = setup.engine.prefill(seqs, [2, 3])
    for changes, message in (
        ({"block_offsets": _table(step, 1, 5, 40)},
         r"sequence 1's block table holds block id 40 \(column 5\), outside the cache's 40 blocks"),
        ({"kv_start_indices": _slots(step, 0, int(step.attn_metadata.block_offsets[1, 0]) * 16 + 9)},
         r"token 0 \(sequence 0\) writes slot \d+ \(block \d+\), outside the sequence's own blocks"),
        ({"q_start_loc": torch.tensor([0, 1], dtype=torch.int32)},
         r"sequence 1 has q_start_loc=1, but its tokens start at token 2"),
    ):
        with pytest.raises(InputError, match="debug mode: " + message):
            _run(setup, step, **changes)
    with torch.inference_mode():  # the right step passes and matches eager
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)

"""A step's integer buffers filled by one copy (graphmode.fill_words): int64
viewed as int32 words, exact; other sources take the per-dtype copies."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode.fill_words import word_copy


def _counting_fill(monkeypatch):
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(destinations, sources, *args, **kwargs):
        calls.append(len(destinations))
        return real(destinations, sources, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return calls


@pytest.mark.parametrize("host_inputs", [False, True], ids=["device inputs", "host staging"])
def test_a_replay_step_fills_its_buffers_with_one_copy(host_inputs, monkeypatch):
    setup = tiny_setup(host_inputs=host_inputs, capture_batch_sizes=[4, 8])
    seqs = setup.prefill(8)
    for batch in (8, 3):  # captures
        setup.decode(seqs[:batch])
    calls = _counting_fill(monkeypatch)
    for batch in (8, 6, 2):  # replays: a full bucket, and padding rows reset
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")
    assert calls and len(calls) == 3, calls  # one _foreach_copy_ per replay step (the eager model makes none)
    assert setup.caches_close()


@pytest.mark.parametrize("change", ["int32 ids", "strided slots"])
def test_a_source_that_cannot_be_viewed_as_words_takes_the_per_dtype_copies(change, monkeypatch):
    setup = tiny_setup(capture_batch_sizes=[4])
    seqs = setup.prefill(4)
    setup.decode(seqs)  # the capture
    step = setup.engine.decode(seqs)
    ids, attn = step.input_ids, step.attn_metadata
    if change == "int32 ids":
        ids = ids.int()  # the copy converts: not the same bytes
    else:
        wide = torch.stack([attn.kv_start_indices, attn.kv_start_indices], dim=1)
        attn = attn.replace(kv_start_indices=wide[:, 0])  # last-dimension stride 2
    calls = _counting_fill(monkeypatch)
    with torch.inference_mode():
        graph = setup.runner(ids, step.position_ids, setup.graph_cache, attn).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2, calls  # int64 and int32 groups apart
    assert setup.caches_close()


def test_words_copy_int64_values_exactly():
    wide = torch.zeros(2, 3, dtype=torch.int64)
    narrow = torch.zeros(4, dtype=torch.int32)
    padding = torch.full((1, 3), -1, dtype=torch.int64)
    step = [torch.tensor([[2**40 + 5, -(2**35), 7]]), torch.tensor([1, -2, 3], dtype=torch.int32)]
    groups = [
        ([wide[:1], wide[1:]], [(0,)], [padding]),   # one step source, one constant (padding row)
        ([narrow[:3]], [(1,)], []),
    ]
    words, others = word_copy(groups)
    assert words is not None and others == []
    assert words.run(None, lambda inputs, index: step[index])
    assert wide.tolist() == [[2**40 + 5, -(2**35), 7], [-1, -1, -1]]
    assert narrow.tolist() == [1, -2, 3, 0]


def test_a_strided_destination_keeps_the_per_dtype_copies():
    table = torch.zeros(4, 8, dtype=torch.int32)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    groups = [([ids], [(0,)], []), ([table[:, :3]], [(1,)], [])]  # a narrower table: not contiguous
    words, others = word_copy(groups)
    assert words is None and others is groups

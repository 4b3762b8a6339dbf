"""Sleep and wake (``runner.sleep()``, ``runner.wake(cache)``;
``graphmode.families.sleep``) on the CPU emulator: sleep releases every graph
of every family, their buffers and the pool (the emulator's allocation
record is back at its value before the warm-up), wake captures the same
graphs again, steps after wake equal steps before in every execute mode,
ten cycles leak nothing, a sleeping runner refuses steps naming wake(), and
a weight replacement keeps its path. (On a GPU: ``scripts/sleep_wake.py``.)"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import graphmode
from graphmode import ReplayError
from graphmode.emulator.host import mark_host
from graphmode.graphs import DeviceGraph
from graphmode.memory import MemoryMeter
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

BLOCK = 16
ARGS = dict(max_batches=2, max_blocks_per_seq=2, block_size=BLOCK, max_q_len=2)  # 4 full graphs, 2 piecewise
MODES = ("graph", "piecewise", "full_and_piecewise", "eager")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_reference_model(ModelConfig.tiny(), device="cpu")


def _cache(model):
    return model.make_kv_cache(num_cache_blocks=32, block_size=BLOCK)


def _generate(runner, model, cache, *, host_inputs=False):
    """Greedy tokens and every step's logits of a fixed request mix: a
    prefill of two prompts, decode at batch 2, a verify step (q_len 2),
    decode at batch 1. A new engine of one seed each time: the same blocks,
    slots and prompts, so the same cache contents are read. The logits are
    kept as numpy arrays, outside the memory meter's record of torch storages."""
    engine = ReferenceEngine(num_cache_blocks=32, block_size=BLOCK, device="cpu",
                             vocab_size=model.config.vocab_size, host_inputs=host_inputs)
    seqs = [engine.add() for _ in range(2)]
    logits_seen, tokens_seen = [], []

    def run(step, ids=None):
        if ids is not None and host_inputs:
            ids = mark_host(ids.clone())  # the next tokens as the engine's host step tensors
        logits = runner(input_ids=step.input_ids if ids is None else ids, position_ids=step.position_ids,
                        past_key_values=cache, attn_metadata=step.attn_metadata)
        logits_seen.append(logits.numpy().copy())
        return logits

    step = engine.prefill(seqs, [5, 9])
    meta = step.attn_metadata
    tokens = run(step)[0, (meta.q_start_loc + meta.q_seqlens - 1).long()].argmax(-1)
    for _ in range(2):
        tokens_seen.append(tokens.tolist())
        tokens = run(engine.decode(seqs), tokens[None].to(step.input_ids.device))[0].argmax(-1)
    run(engine.decode(seqs, q_len=2))  # a verify step: its random draft tokens, logits compared
    engine.finish(seqs.pop())
    tokens = tokens[:1]
    for _ in range(2):
        tokens_seen.append(tokens.tolist())
        tokens = run(engine.decode(seqs), tokens[None].to(step.input_ids.device))[0].argmax(-1)
    return tokens_seen, logits_seen


def _same(first, second):
    """Equal tokens and bit-equal logits: the same graphs (or eager) on the same cache."""
    assert first[0] == second[0]
    assert all((a == b).all() for a, b in zip(first[1], second[1], strict=True))


def _as_eager(eager, graphs):
    """Equal tokens, logits within rounding: graph and eager kernels may round differently."""
    assert eager[0] == graphs[0]
    for a, b in zip(eager[1], graphs[1], strict=True):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-5)


def _graphs(runner):
    return [captured for family in runner.families for captured in family.captured()]


def _device_graphs() -> int:
    gc.collect()
    # type(), not isinstance(): isinstance reads an object's __class__, which torch's deprecated
    # torch.distributed.reduce_op answers with a FutureWarning.
    return sum(issubclass(type(obj), DeviceGraph) for obj in gc.get_objects())


def _warmed(model, mode):
    """A runner warmed up on a cache of its own, and the tokens and logits it generates there."""
    runner = graphmode.build_graph_runner(model, execute_mode=mode, **ARGS)
    cache = _cache(model)
    runner.warmup(cache, progress=False)
    return runner, cache, _generate(runner, model, cache)


@pytest.mark.parametrize("mode", MODES)
def test_sleep_gives_back_every_byte_the_warmup_took_and_holds_no_graph(model, mode):
    runner = graphmode.build_graph_runner(model, execute_mode=mode, **ARGS)
    cache = _cache(model)
    with MemoryMeter(CPU) as meter:
        before = meter.used()
        runner.warmup(cache, progress=False)
        _generate(runner, model, cache)  # the graphs' steps too: views, native memo, staging
        warmed = meter.used()
        runner.sleep()
        asleep = meter.used()
    assert runner.asleep
    assert _graphs(runner) == [] and runner.captured_graphs == []
    assert runner._shared.pool is None and runner.meta is None
    if mode != "eager":
        assert warmed > before
    assert asleep == before  # the input, output, break-point buffers and the pool: all of it back


@pytest.mark.parametrize("mode", MODES)
def test_steps_after_wake_equal_steps_before_and_eager(model, mode):
    eager = _generate(graphmode.build_graph_runner(model, execute_mode="eager", **ARGS), model, _cache(model))
    runner, cache, before = _warmed(model, mode)
    keys = [captured.name for captured in _graphs(runner)]
    runner.sleep()
    runner.wake(cache, progress=False)
    assert sorted(captured.name for captured in _graphs(runner)) == sorted(keys)  # the same graphs, again
    after = _generate(runner, model, cache)
    _same(before, after)
    _as_eager(eager, after)
    stats = runner.stats
    assert (stats.sleeps, stats.wakes, stats.recaptures) == (1, 1, len(keys))
    if keys:
        assert "1 sleeps, 1 wakes" in stats.summary()


def test_ten_sleep_wake_cycles_leak_nothing(model):
    runner = graphmode.build_graph_runner(model, execute_mode="full_and_piecewise", **ARGS)
    cache = _cache(model)
    with MemoryMeter(CPU) as meter:
        before = meter.used()
        runner.warmup(cache, progress=False)
        first = _generate(runner, model, cache)
        runner.sleep()
        runner.wake(cache, progress=False)
        _generate(runner, model, cache)
        awake, graphs = meter.used(), _device_graphs()
        for _ in range(10):
            runner.sleep()
            assert meter.used() == before
            runner.wake(cache, progress=False)
            last = _generate(runner, model, cache)
        assert meter.used() == awake and _device_graphs() == graphs
    _same(first, last)
    assert runner.stats.sleeps == runner.stats.wakes == 11


def test_lazily_captured_graphs_are_the_ones_wake_captures(model):
    """No warm-up: the steps captured some buckets; wake captures those, not every bucket."""
    runner = graphmode.build_graph_runner(model, execute_mode="graph", **ARGS)
    cache = _cache(model)
    before = _generate(runner, model, cache)
    captured = set(runner.captured_graphs)
    assert 0 < len(captured) < len(runner.capture_sizes) * ARGS["max_q_len"]  # not every graph
    runner.sleep()
    runner.wake(cache, progress=False)
    assert set(runner.captured_graphs) == captured
    assert runner.stats.warmup_captures == len(captured)  # inert captures, as warm-up's
    _same(before, _generate(runner, model, cache))


def test_a_sleeping_runner_refuses_steps_and_warmups_naming_wake(model):
    runner = graphmode.build_graph_runner(model, execute_mode="graph", **ARGS)
    cache = _cache(model)
    runner.warmup(cache, progress=False)
    runner.sleep()
    runner.sleep()  # sleeping while asleep does nothing
    assert runner.stats.sleeps == 1
    engine = ReferenceEngine(num_cache_blocks=32, block_size=BLOCK, device="cpu", vocab_size=model.config.vocab_size)
    step = engine.decode([engine.add()])
    with pytest.raises(ReplayError, match=r"a step on a runner that is asleep.*runner\.wake\(past_key_values\)"):
        runner(input_ids=step.input_ids, position_ids=step.position_ids, past_key_values=cache,
               attn_metadata=step.attn_metadata)
    for call in (lambda: runner.warmup(cache), lambda: runner.plan_memory(cache), runner.graph_meta):
        with pytest.raises(ReplayError, match=r"on a runner that is asleep.*wake"):
            call()
    runner.wake(cache, progress=False)
    runner.wake(cache, progress=False)  # waking an awake runner does nothing
    assert runner.stats.wakes == 1


def test_reset_while_asleep_forgets_the_sleep_and_steps_capture_again(model):
    runner, cache, before = _warmed(model, "graph")
    runner.sleep()
    runner.reset()
    assert not runner.asleep and runner.captured_graphs == []
    _same(before, _generate(runner, model, cache))  # captured at each bucket's first step
    assert runner.stats.wakes == 0


def test_a_draft_runner_sharing_the_pool_sleeps_with_its_target(model):
    config = dataclasses.replace(model.config, num_hidden_layers=1)
    draft = build_reference_model(config, device="cpu", seed=3)
    target_runner = graphmode.build_graph_runner(model, **ARGS)
    draft_runner = graphmode.build_graph_runner(draft, **ARGS, share_pool_with=target_runner)
    cache, draft_cache = _cache(model), _cache(draft)
    with MemoryMeter(CPU) as meter:
        before = meter.used()
        target_runner.warmup(cache, progress=False)
        draft_runner.warmup(draft_cache, progress=False)
        first = (_generate(target_runner, model, cache), _generate(draft_runner, draft, draft_cache))
        target_runner.sleep()  # the pool is one: both runners' graphs go
        assert draft_runner.asleep and _graphs(draft_runner) == []
        assert meter.used() == before
        with pytest.raises(ReplayError, match="asleep"):
            _generate(draft_runner, draft, draft_cache)
        target_runner.wake(cache, progress=False)
        draft_runner.wake(draft_cache, progress=False)  # each runner wakes with its own cache
    assert draft_runner._shared.pool is target_runner._shared.pool is not None
    _same(first[0], _generate(target_runner, model, cache))
    _same(first[1], _generate(draft_runner, draft, draft_cache))


def _replace_weight(model):
    """A weight reload that replaces the tensor (``module.weight = Parameter(new)``); the old one back, undone."""
    head = model.lm_head
    old = head.weight
    head.weight = torch.nn.Parameter(old.detach() * 1.5, requires_grad=False)
    return lambda: setattr(head, "weight", old)


def test_a_weight_replaced_after_wake_is_refused_until_reset(model):
    runner = graphmode.build_graph_runner(model, execute_mode="graph", **ARGS)
    cache = _cache(model)
    runner.warmup(cache, progress=False)
    runner.sleep()
    runner.wake(cache, progress=False)
    undo = _replace_weight(model)
    try:
        eager = _generate(graphmode.build_graph_runner(model, execute_mode="eager", **ARGS), model, _cache(model))
        with pytest.raises(ReplayError, match=r"lm_head\.weight.*runner\.reset\(\)"):
            _generate(runner, model, cache)
        runner.reset()
        _as_eager(eager, _generate(runner, model, cache))  # captured again, reading the new tensor
    finally:
        undo()


def test_a_weight_replaced_while_asleep_is_what_wake_captures(model):
    """The engine offloaded the weights and loaded new tensors while asleep: wake captures those."""
    runner = graphmode.build_graph_runner(model, execute_mode="full_and_piecewise", **ARGS)
    cache = _cache(model)
    runner.warmup(cache, progress=False)
    runner.sleep()
    undo = _replace_weight(model)
    try:
        eager = _generate(graphmode.build_graph_runner(model, execute_mode="eager", **ARGS), model, _cache(model))
        runner.wake(cache, progress=False)
        _as_eager(eager, _generate(runner, model, cache))
    finally:
        undo()


def test_host_staging_comes_back_after_wake(model):
    """Host staging decided on from the first step's host inputs: released at sleep, on again after wake."""
    runner = graphmode.build_graph_runner(model, execute_mode="graph", **ARGS)
    cache = _cache(model)
    before = _generate(runner, model, cache, host_inputs=True)
    assert runner.staging is not None
    runner.sleep()
    assert runner.staging is None
    runner.wake(cache, progress=False)
    assert runner.staging is not None
    _same(before, _generate(runner, model, cache, host_inputs=True))


def test_wake_takes_a_reallocated_cache(model):
    """The engine discarded the KV cache while asleep and made a new one: wake captures on it."""
    runner, cache, before = _warmed(model, "full_and_piecewise")
    runner.sleep()
    del cache
    cache = _cache(model)
    runner.wake(cache, progress=False)
    _same(before, _generate(runner, model, cache))

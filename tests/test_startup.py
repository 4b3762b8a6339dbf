"""Start-up on the CPU emulator: warm-up captures run no warm-up forward for
a shape the forward ran at before in the process (after reset, at wake, in
a second runner), fall back to one when the capture changes the model's
Python state after all, and the full graphs' shared output lives outside
the pool (the pool's bound: 1.2x its largest graph alone). Times are
``scripts/capture_time.py``'s, on a GPU."""

from __future__ import annotations

import torch
from setups import tiny_setup

import graphmode
from graphmode.families.family import FORWARDS_RUN


def _count_forwards(model) -> list[int]:
    calls = [0]

    def hook(module, args, kwargs):  # noqa: ARG001
        calls[0] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def _equal_to_eager(setup, batches=(4, 1, 3, 2)):
    seqs = setup.prefill(4)
    for batch in batches:
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")


def test_a_warmup_after_reset_runs_one_warmup_forward_not_one_per_graph():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    calls = _count_forwards(setup.model)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
        assert calls[0] == 2 * 3  # a new shape: a warm-up forward, then the capture's
        setup.runner.reset()
        calls[0] = 0
        setup.runner.warmup(setup.graph_cache, progress=False)
    # The first capture since reset still warms up (its result sizes the shared output buffer).
    assert calls[0] == 1 + 3
    _equal_to_eager(setup)


def test_a_second_runner_and_a_wake_skip_the_warmup_forwards_of_shapes_seen():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    calls = _count_forwards(setup.model)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
        second = graphmode.build_graph_runner(setup.model, max_batches=4, max_blocks_per_seq=8, block_size=16,
                                              capture_batch_sizes=[1, 2, 4])
        calls[0] = 0
        second.warmup(setup.graph_cache, progress=False)
        assert calls[0] == 1 + 3
        second.reset()
        setup.runner.sleep()
        calls[0] = 0
        setup.runner.wake(setup.graph_cache, progress=False)
        assert calls[0] == 1 + 3
    _equal_to_eager(setup)


def test_the_plans_captures_on_a_probe_cache_count_for_the_warmup_but_another_layout_does_not():
    # The number of cache blocks sizes nothing a graph holds; the cache's layout past it may
    # (a kernel specialised on a stride): a cache of another layout is another shape.
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    calls = _count_forwards(setup.model)
    with torch.inference_mode():
        setup.runner.plan_memory(setup.model.make_kv_cache(4, 16))
        calls[0] = 0
        setup.runner.warmup(setup.graph_cache, progress=False)
        assert calls[0] == 1 + 3  # three buckets: every one sampled by the plan
    shared = setup.runner._shared
    probe = setup.model.make_kv_cache(4, 16)
    other_layout = [(k.transpose(1, 2).contiguous(), v) for k, v in probe]  # [blocks, heads, block, dim]
    same = shared.forward_shape("full", 4, 1, setup.model.make_kv_cache(7, 16), {})
    assert same == shared.forward_shape("full", 4, 1, probe, {})
    assert shared.forward_shape("full", 4, 1, other_layout, {}) != same


class _LazyPerShape(torch.nn.Module):
    """Wraps the model; fills a dict per token count the first time it sees
    one (a table made lazily per shape), which only a warm-up forward before
    the capture may do."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model
        self.ops = model.ops
        self.config = model.config
        self.tables: dict[int, int] = {}

    def make_kv_cache(self, *args, **kwargs):
        return self.inner.make_kv_cache(*args, **kwargs)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, **extras):
        self.tables.setdefault(input_ids.shape[1], input_ids.shape[1])
        return self.inner(input_ids, position_ids, past_key_values, attn_metadata, **extras)


def test_a_capture_that_changes_the_model_state_without_a_warmup_forward_is_captured_again_after_one():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    lazy = _LazyPerShape(setup.model)
    runner = graphmode.build_graph_runner(lazy, max_batches=4, max_blocks_per_seq=8, block_size=16,
                                          capture_batch_sizes=[1, 2, 4])
    calls = _count_forwards(lazy)
    with torch.inference_mode():
        runner.warmup(setup.graph_cache, progress=False)
        runner.reset()
        lazy.tables.clear()  # the shapes ran before, but their lazy state is gone
        calls[0] = 0
        runner.warmup(setup.graph_cache, progress=False)
    # Bucket 4 warms up (the first capture); buckets 2 and 1: a capture, refused, then a warm-up and a capture.
    assert calls[0] == 2 + 3 + 3
    assert sorted(lazy.tables) == [1, 2, 4] and runner.stats.captures == 3 + 3  # the refused two not counted
    setup.runner = runner
    _equal_to_eager(setup)


def test_forwards_run_are_forgotten_with_their_model():
    setup = tiny_setup(capture_batch_sizes=[2], max_batches=2)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert setup.model in FORWARDS_RUN
    before = len(FORWARDS_RUN)
    setup.runner.reset()
    del setup
    import gc

    gc.collect()
    assert len(FORWARDS_RUN) == before - 1


def test_the_full_graphs_shared_output_is_a_buffer_outside_their_pool():
    # The largest graph's own result, kept as the shared buffer, stayed live in the pool and every
    # later capture needed room beside it (H100: 48 against 28 MiB, 1.71x). It now copies too.
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    largest = setup.runner.graph(4)
    output = largest.meta.output_buffers["output"]
    pool = {s.data_ptr() for s in largest.graph.allocated_storages()}
    assert output.untyped_storage().data_ptr() not in pool  # not the graph's own result
    for bucket in (1, 2):
        assert setup.runner.graph(bucket).meta.output_buffers["output"].data_ptr() == output.data_ptr()
    _equal_to_eager(setup)


def test_the_largest_piecewise_graph_keeps_its_own_result_as_the_shared_buffer():
    # Piecewise token buckets reach 32768 tokens of prefill, whose logits (2 GiB) would cost a 1.3 ms copy.
    setup = tiny_setup(capture_token_sizes=[2, 4, 8], max_batches=4, execute_mode="piecewise")
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    piecewise = setup.runner.family("piecewise")
    assert piecewise is not None
    largest = piecewise.graph(8).output
    assert largest._base is None
    assert piecewise.graph(2).output.data_ptr() == largest.data_ptr()


def test_piecewise_warmup_after_reset_takes_its_views_from_the_first_warmup_forward():
    setup = tiny_setup(capture_token_sizes=[2, 4, 8], max_batches=4, execute_mode="piecewise")
    calls = _count_forwards(setup.model)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
        assert calls[0] == 2 * 3
        setup.runner.reset()
        calls[0] = 0
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert calls[0] == 1 + 3 and setup.runner.stats.piecewise_captures == 6
    _equal_to_eager(setup)


def test_warmup_captures_without_a_warmup_forward_take_one_snapshot_of_the_model_state(monkeypatch):
    # The state a capture's check left is the next capture's before, when nothing ran the model in
    # between: one snapshot per graph rather than two (milliseconds each for the bench model).
    from graphmode.checks import model_state

    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
        setup.runner.reset()
        taken = [0]
        snapshot = model_state._Snapshot

        class Counted(snapshot):
            def __init__(self, *args, **kwargs):
                taken[0] += 1
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(model_state, "_Snapshot", Counted)
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert taken[0] == 2 + 1 + 1  # bucket 4 after its warm-up forward: before and after; then after only
    assert setup.runner._shared.last_state is None  # nothing carried out of the warm-up
    _equal_to_eager(setup)


def test_plan_memory_collects_the_whole_heap_once_and_thaws_it_after(monkeypatch):
    # The memory meter collects before every measurement; with the heap frozen each such
    # collection scans only what was made since (the 100 to 500 ms of a whole heap, four
    # times a plan, before). warmup() and wake() thaw it after too.
    import gc

    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], max_batches=4)
    gc.unfreeze()  # conftest's freeze (the first warm-up of the process thaws it anyway)
    original, whole_heap = gc.collect, []

    def collect(*args):
        whole_heap.append(gc.get_freeze_count() == 0)
        return original(*args)

    monkeypatch.setattr(gc, "collect", collect)
    with torch.inference_mode():
        setup.runner.plan_memory(setup.model.make_kv_cache(4, 16))
        assert whole_heap.count(True) == 1 and whole_heap[0], whole_heap
        assert gc.get_freeze_count() == 0
        setup.runner.warmup(setup.graph_cache, progress=False)
        assert gc.get_freeze_count() == 0
        setup.runner.sleep()
        setup.runner.wake(setup.graph_cache, progress=False)
        assert gc.get_freeze_count() == 0
    _equal_to_eager(setup)

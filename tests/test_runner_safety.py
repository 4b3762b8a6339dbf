"""Engine mistakes that would otherwise give silently wrong results: a KV
cache tensor replaced inside the captured container, two threads in one
runner, and warm-up steps counted as served tokens."""

from __future__ import annotations

import threading

import hangs
import pytest
import torch
from setups import tiny_setup

from graphmode import InputError, ReplayError


def test_a_cache_tensor_replaced_inside_the_same_container_is_refused():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(2)
    setup.decode(seqs)  # captures bucket 2 with the cache's current tensors
    key, value = setup.graph_cache[1]
    setup.graph_cache[1] = (key.clone(), value)  # same list object, a new key tensor
    with pytest.raises(InputError, match=r"tensor 2 of 4 differs.*Call runner.reset\(\)"):
        setup.decode(seqs)
    setup.runner.reset()
    graph, eager = setup.decode(seqs)  # recaptured on the new tensors
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


class _Gate(torch.nn.Module):
    """The model, paused inside its forward until released."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, *args, **kwargs):
        self.entered.set()
        hangs.wait(self.release, "the test releasing the gate")
        return self.model(*args, **kwargs)


def test_a_second_thread_calling_during_a_step_is_refused():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(2)
    gate = _Gate(setup.model)
    setup.runner.model = gate  # eager steps (and captures) now pause in the forward
    step = setup.engine.prefill([setup.engine.add()], [3])
    first = threading.Thread(
        target=lambda: setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    )
    first.start()
    hangs.wait(gate.entered, "the first call reaching the model's forward")
    decode = setup.engine.decode(seqs)
    with pytest.raises(InputError, match="another call is running"):
        setup.runner(decode.input_ids, decode.position_ids, setup.graph_cache, decode.attn_metadata)
    gate.release.set()
    hangs.join(first, "the first call")
    setup.runner(decode.input_ids, decode.position_ids, setup.graph_cache, decode.attn_metadata)  # free again


def test_warmup_captures_count_apart_from_served_tokens():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4])
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    stats = setup.runner.stats
    assert (stats.captures, stats.warmup_captures, stats.real_tokens, stats.padded_tokens) == (3, 3, 0, 0)
    seqs = setup.prefill(3)
    setup.decode(seqs)
    assert (stats.replays, stats.real_tokens, stats.padded_tokens) == (1, 3, 1)
    assert stats.summary().startswith("3 captures (3 in warm-up), 1 replays")


def test_every_graph_writes_its_result_into_one_shared_buffer():
    # One result per bucket would keep every bucket's logits in the graph pool
    # (most of the pool on a GPU); a shared buffer keeps the largest only.
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(4)
    for batch in (4, 1, 2, 4, 3, 1):  # alternate buckets: each result must be this step's
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")
    pointers = {setup.runner.graph(b).meta.output_buffers["output"].data_ptr() for b in (1, 2, 4)}
    assert len(pointers) == 1


def test_a_largest_result_that_is_a_view_is_not_adopted_as_the_shared_buffer():
    # A view may alias what the graph reads (an input buffer, say): smaller
    # graphs' copies into it would overwrite that. Such a result stays the
    # graph's own; a fresh result is adopted and later results copied into it.
    from graphmode.families.outputs import SharedOutputs

    base = torch.arange(24.0).reshape(1, 8, 3)
    viewed = SharedOutputs(max_tokens=4)
    viewed.prepare(base[:, :4], tokens=4)
    assert viewed.publish(base[:, :4], tokens=4) is not None and viewed.buffers == [None]
    assert viewed.publish(base[:, :2], tokens=2).data_ptr() == base.data_ptr()  # left as it was: no copy

    fresh = SharedOutputs(max_tokens=4)
    largest = torch.zeros(1, 4, 3)
    fresh.prepare(largest, tokens=4)
    assert fresh.publish(largest, tokens=4) is largest
    small = torch.ones(1, 2, 3)
    published = fresh.publish(small, tokens=2)
    assert published.data_ptr() == largest.data_ptr() and torch.equal(largest[:, :2], small)


class _Cycle:
    """Garbage only the cyclic collector frees; its finalizer notes whether
    a capture was under way (a device graph's finalizer calling the driver
    there invalidates the capture: seen on the H100)."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen, self.me = seen, self

    def __del__(self) -> None:
        from graphmode.emulator import current_session

        self.seen.append(current_session() is not None)


@pytest.mark.parametrize("mode", ["graph", "piecewise"])
def test_no_garbage_collection_runs_inside_a_capture(mode):
    import gc

    setup = tiny_setup(capture_batch_sizes=[1, 2, 4], execute_mode=mode, capture_token_sizes=[4, 8])
    seqs = setup.prefill(3)
    seen: list[bool] = []
    for layer in setup.model.layers:  # garbage made in every forward, the captured ones included
        layer.register_forward_pre_hook(lambda module, args: _Cycle(seen) and None)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation
    try:
        setup.decode(seqs)  # captures bucket 4 (piecewise: token bucket 4)
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert len(seen) > 2 * len(setup.model.layers) and not any(seen), f"{sum(seen)} finalizers ran in a capture"
    assert gc.isenabled()


@pytest.mark.parametrize("mode", ["graph", "piecewise"])
def test_weights_reloaded_into_new_tensors_between_steps_are_refused_until_reset(mode):
    # load_state_dict(assign=True) gives the modules new Parameter objects:
    # graphs kept the old ones, and replayed with them silently before
    # (logits 24 off eager with new random weights, debug mode off).
    setup = tiny_setup(**({} if mode == "graph" else {"execute_mode": mode}))
    before = tiny_setup().model.state_dict()  # other weights, same shapes
    setup.model.load_state_dict(before, assign=True)  # before any capture: nothing to refuse
    seqs = setup.prefill(2, [5, 6])
    for _ in range(3):  # a capture, then replays (the native step's memo on the python path's second)
        setup.decode(seqs)
    reloaded = {name: torch.randn_like(t) if t.is_floating_point() else t for name, t in before.items()}
    setup.model.load_state_dict(reloaded, assign=True)
    with pytest.raises(ReplayError, match=r"replaced the model's embed_tokens.weight, .*\(and \d+ more\) after "
                       r"graphs captured.*load_state_dict\(\.\.\., assign=True\).*Call runner.reset\(\) after "
                       r"replacing them"):
        setup.decode(seqs)
    setup.runner.reset()
    graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


def test_a_graph_the_runner_holds_for_another_bucket_is_refused_naming_the_hook():
    """A graphmode_make_graph that keeps one graph for the whole runner: the
    second bucket's capture would recapture the first's graph (the runtime
    refuses it naming no hook, or the first bucket replays the second's)."""
    from graphmode import CaptureError, hookimpl
    from graphmode.emulator import EmulatedGraph
    from graphmode.vendor_info import VendorInfo

    class OneGraph:
        @staticmethod
        @hookimpl
        def graphmode_vendor_info():
            return VendorInfo(name="onegraph", device_types=("cpu",), runtime="none", runtime_version=None,
                              detected=False, reason="test plugin")

        @staticmethod
        @hookimpl
        def graphmode_make_graph(meta):
            return meta.vendor_state.setdefault("graph", EmulatedGraph())

    setup = tiny_setup("onegraph", plugin=OneGraph(), capture_batch_sizes=[2, 4])
    seqs = setup.prefill(3)
    setup.decode(seqs)  # bucket 4: the first capture
    with pytest.raises(CaptureError, match=r"decode graph of bucket 2: graphmode_make_graph \(plugin onegraph\) "
                                           r"returned the graph object it returned for bucket 4"):
        setup.decode(seqs[:2])

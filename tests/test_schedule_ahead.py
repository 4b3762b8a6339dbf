"""An engine that schedules ahead calls step N+1 before it reads step N's
result. On the emulator's asynchronous, slowed device
(``graphmode.emulator.stream``), replays and host staging's copies stay in
flight while the host goes on: no step may read inputs written for a later
one, and a step issued one ahead of the device does not wait for it."""

from __future__ import annotations

import threading

import hangs
import pytest
import torch
from setups import slow_gpu_model, tiny_setup

import graphmode
from graphmode.context import REQUIRED_TENSORS
from graphmode.emulator import stream


def _issued_ahead(setup, seqs, batches, delay):
    """Each step's runner call, then its result read on the device (as an
    engine samples before its next call), the host never waiting; then the
    eager reference of every step, in order, on the eager cache."""
    steps, results = [], []
    with stream.asynchronous(delay=delay):
        for batch in batches:
            step = setup.engine.decode(seqs[:batch])
            with torch.inference_mode():
                output = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
            stream.launch(lambda output=output: results.append(output.clone()))
            steps.append(step)
    with torch.inference_mode():
        for index, (step, graph) in enumerate(zip(steps, results)):
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"step {index} (batch {batches[index]})")
    assert setup.caches_close()


def test_host_staged_steps_issued_ahead_on_a_slow_device_read_their_own_inputs():
    setup = tiny_setup(max_batches=8, host_inputs=True, capture_batch_sizes=[4, 8])
    seqs = setup.prefill(8)
    for batch in (8, 3):  # both graphs captured, the device synchronous
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.runner.staging is not None
    # Within a bucket and across buckets; every step's copy and replay run
    # 20 ms after the host launched them, so the host runs ahead until a
    # mirror's copy has not run yet.
    _issued_ahead(setup, seqs, [8, 7, 3, 8, 5, 2, 8, 6], delay=0.02)
    assert setup.runner.stats.replays == 8


def test_host_staged_inputs_may_be_rewritten_as_soon_as_the_call_returns():
    """An engine with persistent host buffers (vLLM's CpuGpuBuffer) writes its
    next step into the same tensors right after a call returns, while that
    step's copy and replay are still queued: the call has copied them into
    its mirror on the host (docs/engines.md, Scheduling ahead)."""
    setup = tiny_setup(max_batches=8, host_inputs=True, capture_batch_sizes=[4, 8])
    seqs = setup.prefill(6)
    for batch in (6, 3):  # both graphs captured, the device synchronous
        setup.decode(seqs[:batch])
    buffers = setup.engine.decode(seqs[:6])  # the engine's host tensors, reused by every step
    tensors = lambda step: [step.input_ids, step.position_ids,  # noqa: E731
                            *(getattr(step.attn_metadata, name) for name in REQUIRED_TENSORS)]
    steps, results = [], []
    with stream.asynchronous(delay=0.02):
        for batch in (6, 5, 6, 3, 6):
            step = setup.engine.decode(seqs[:batch])
            mine = [held[tuple(slice(0, size) for size in new.shape)] for held, new in zip(tensors(buffers), tensors(step))]
            for held, new in zip(mine, tensors(step)):
                held.copy_(new)
            attn = step.attn_metadata.replace(**dict(zip(REQUIRED_TENSORS, mine[2:])))
            with torch.inference_mode():
                output = setup.runner(mine[0], mine[1], setup.graph_cache, attn)
            stream.launch(lambda output=output: results.append(output.clone()))
            for held in mine:
                held.fill_(0)  # the engine starts on its next step at once
            steps.append(step)
    with torch.inference_mode():
        for index, (step, graph) in enumerate(zip(steps, results)):
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"step {index}")
    assert setup.caches_close() and setup.runner.stats.replays == 5


def test_a_host_staged_step_issued_one_ahead_does_not_wait_for_the_device():
    setup = tiny_setup(max_batches=4, host_inputs=True, capture_batch_sizes=[4])
    seqs = setup.prefill(4)
    setup.decode(seqs)  # the capture
    busy = threading.Event()  # the device runs nothing until the test sets it

    def two_steps() -> None:
        with torch.inference_mode():
            for _ in range(2):  # the second issued while the first is still queued
                step = setup.engine.decode(seqs)
                setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)

    with stream.asynchronous():
        stream.launch(busy.wait)
        try:  # a call that waited for the device would wait for ever: no clock decides
            hangs.returns(two_steps, "two runner calls issued ahead of a held device (a call waited for the device)")
        finally:
            busy.set()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an asynchronous device")
def test_device_inputs_from_the_previous_steps_result_on_a_gpu():
    """Each step's input ids are the previous step's result plus one, computed
    on the device and never read on the host until the end: the fill's copies
    run after the previous replay in stream order, so step N reads N-1's ids."""
    model = slow_gpu_model()
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cuda",
                                          host_staging=False, capture_batch_sizes=[4])
    attn = graphmode.AttnMetadata(
        is_decoding=True, block_offsets=torch.ones((4, 1), dtype=torch.int32, device="cuda"),
        q_start_loc=torch.arange(4, dtype=torch.int32, device="cuda"),
        q_seqlens=torch.ones(4, dtype=torch.int32, device="cuda"),
        kv_seqlens=torch.ones(4, dtype=torch.int32, device="cuda"),
        kv_start_indices=torch.full((4,), -1, device="cuda"), max_q_seq_len=1, max_kv_seq_len=1)
    positions = torch.zeros((1, 4), dtype=torch.int64, device="cuda")
    cache = [(torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))]  # the model reads none
    with torch.inference_mode():
        ids = torch.zeros((1, 4), dtype=torch.int64, device="cuda")
        runner(ids, positions, cache, attn)  # the capture
        seen = []
        for _ in range(20):
            output = runner(ids, positions, cache, attn)
            seen.append(output[0, :, 0].clone())  # launched before the next call
            ids = output[0, :, 0].long()[None] + 1  # the next step's ids, on the device
        torch.cuda.synchronize()
    assert [int(s[0]) for s in seen] == list(range(20))

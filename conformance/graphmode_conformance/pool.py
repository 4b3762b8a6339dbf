"""Every graph of a runner captured into the runner's one memory pool.

The runner passes the pool of its first graph to every later capture (full
graphs of every bucket and q_len, piecewise segments), so that their
intermediates share memory. A device graph class that drops the ``pool``
argument (``capture_begin()`` for ``capture_begin(pool)``) gives each graph a
pool of its own: outputs stay right, and graph memory grows with every bucket
(59% more on an H100 in one such slip). Outputs cannot show it; the pools
can:

- on every device, each graph's ``pool()`` token must be the runner's
  (``torch.cuda.CUDAGraph.pool()`` returns the pool the capture used: the one
  passed, or a new one when none was);
- on the CPU emulator, the runner's pool must also hold every emulated graph
  captured (an ``EmulatedPool`` records the graphs captured into it), which
  also catches a graph class whose ``pool()`` returns the token it was given
  while it captured elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest

import graphmode
from graphmode.emulator import EmulatedPool
from graphmode.graphs import DeviceGraph
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, piecewise_of
from graphmode_conformance.modes import EXECUTE_MODES, build_in_mode
from graphmode_conformance.sizes import MIN_MAX_BATCHES

__all__ = ["MemoryPoolTests", "check_one_pool", "runner_graphs"]

MiB = 2**20
PROBE_BLOCKS = 4  # the probe cache plan_memory() is given, as docs/engines.md shows
REAL_LAYER_BYTES = 32 * MiB  # on a device, the least one layer's key cache of the real cache holds


def runner_graphs(runner: graphmode.GraphRunner) -> list[tuple[str, DeviceGraph]]:
    """Every device graph the runner holds, each with its name."""
    graphs = []
    for bucket, q_len in runner.captured_graphs:
        captured = runner.graph(bucket, q_len)
        assert captured is not None
        graphs.append((f"the decode graph of bucket {bucket} (q_len {q_len})", captured.graph))
    pieces = piecewise_of(runner)
    if pieces is not None:
        for bucket in pieces.captured_buckets:
            piecewise = pieces.graph(bucket)
            assert piecewise is not None
            for index, segment in enumerate(piecewise.pieces.segments):
                graphs.append((f"segment {index + 1} of the piecewise graph of token bucket {bucket}", segment))
    return graphs


def check_one_pool(where: str, runner: graphmode.GraphRunner, *sharing: graphmode.GraphRunner) -> None:
    """Raise :class:`ConformanceFailure` unless every graph of ``runner``
    (and of the runners ``sharing`` its pool, built with ``share_pool_with``)
    was captured into one pool (see the module's doc)."""
    graphs = runner_graphs(runner) + [graph for other in sharing for graph in runner_graphs(other)]
    if len(graphs) < 2:
        return
    tokens = [graph.pool() for _, graph in graphs]
    first_name, first = graphs[0][0], tokens[0]
    elsewhere = [name for (name, _), token in zip(graphs, tokens) if token is not first and token != first]
    if elsewhere:
        raise ConformanceFailure(
            f"[memory pool] {where}: {len(elsewhere)} of {len(graphs)} graphs were captured outside the runner's "
            f"memory pool (the pool of {first_name}): {'; '.join(elsewhere[:4])}{' ...' if len(elsewhere) > 4 else ''}. "
            "Each keeps a pool of its own, so graph memory grows with every bucket though outputs are right. Hook: "
            "graphmode_make_graph: the device graph's capture_begin(pool) must capture into the pool it is given "
            "(torch: graph.capture_begin(pool=pool))"
        )
    if isinstance(first, EmulatedPool) and first.num_graphs < len(graphs):
        raise ConformanceFailure(
            f"[memory pool] {where}: every graph's pool() is the runner's pool, but the emulator recorded only "
            f"{first.num_graphs} of the {len(graphs)} captures in it: the others captured into pools of their own. "
            "Hook: graphmode_make_graph: the device graph's capture_begin(pool) must pass the pool to the capture, "
            "not only return it from pool()"
        )


class MemoryPoolTests(ConformanceFixtures):
    @pytest.mark.parametrize("mode", EXECUTE_MODES)
    def test_every_graph_is_captured_into_the_runners_pool(self, build_harness, sizes, mode):
        harness = build_in_mode(build_harness, sizes, mode)
        harness.check = "one memory pool"
        engine = harness.engine
        seqs = [engine.add() for _ in range(8)]
        harness.prefill(seqs, [4, 9, 1, 17, 5, 2, 11, 6])  # 55 tokens: token bucket 64
        for batch in (8, 3, 1):  # buckets 8, 4 and 1
            harness.decode(seqs[:batch])
        harness.prefill(seqs[:2], [3, 4])  # token bucket 8
        where = f"vendor {harness.vendor.name} on {harness.device}{harness.variant}, {mode}"
        assert len(runner_graphs(harness.runner)) >= 2, f"{where}: the steps should capture several graphs"
        check_one_pool(where, harness.runner)

    def test_the_memory_plan_on_a_probe_cache_holds_for_the_real_cache(self, build_harness, sizes):
        """``runner.plan_memory(probe)`` on a cache of a few blocks says what
        ``warmup()`` into the real cache takes (an engine sizes its KV cache
        from it): no graph memory may grow with the cache's size."""
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=None)
        harness = build_harness(sizes=small, capture_batch_sizes=[1, 4, MIN_MAX_BATCHES])
        runner, model, block = harness.runner, harness.model, harness.sizes.block
        cache, blocks = harness.graph_cache, harness.sizes.cache_blocks
        if harness.device.type != "cpu":
            # A device's figures move by allocator segments (2 MiB and more): a cache whose
            # layers hold at least REAL_LAYER_BYTES each makes a copy of one stand out.
            per_block = cache[0][0].nbytes // blocks
            blocks = max(blocks, -(-REAL_LAYER_BYTES // per_block))
            cache = model.make_kv_cache(blocks, block)
        plan = runner.plan_memory(model.make_kv_cache(PROBE_BLOCKS, block))
        runner.warmup(cache, progress=False)
        actual = runner.graph_memory
        if actual is None:
            pytest.skip(f"graph memory is not measured on {harness.device}")
        # What one layer's key cache adds from the probe to the real cache.
        grown = cache[0][0].nbytes * (1 - PROBE_BLOCKS / blocks)
        difference = actual.bytes - plan.bytes
        if abs(difference) >= grown / 2:
            raise ConformanceFailure(
                f"[graph memory] vendor {harness.vendor.name} on {harness.device}{harness.variant}: plan_memory() on a "
                f"probe cache of {PROBE_BLOCKS} blocks planned {plan.bytes / MiB:.2f} MiB, but warmup() into the real "
                f"cache of {blocks} blocks took {actual.bytes / MiB:.2f} MiB ({difference / MiB:+.2f} "
                f"MiB, {difference / grown:.1f} x what one layer's key cache grew by, {grown / MiB:.2f} MiB). Graph "
                "memory grows with the KV cache's size, so an engine sizing its cache from the plan runs out of "
                "memory at warm-up. Likely cause: a kernel of graphmode_attention_ops copies the whole cache inside "
                "the graph (.contiguous() or .to() of a cache or of its block_view, a cast for the softmax): memory "
                "of the cache's size in the graph's pool, and a copy of the whole cache at every step. Gather only "
                "the blocks of the step's block table"
            )

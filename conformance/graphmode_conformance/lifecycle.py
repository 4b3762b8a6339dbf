"""KV-cache integrity, the runner's lifecycle, eager fallbacks and vendor
parameter updates."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch

from graphmode.spec import BLOCKS
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure
from graphmode_conformance.modes import EXECUTE_MODES, build_in_mode
from graphmode_conformance.sizes import bucket_with_smaller_batches

__all__ = ["CapabilityTests", "KVCacheIntegrityTests", "LifecycleTests", "ParameterUpdateTests"]

_NAN_IN_BLOCK_0 = (
    "Block 0 may hold anything, and every table's unused columns and every padding row point at it. Likely "
    "cause: the vendor's attention kernels (graphmode_attention_ops) read block 0 and mask it by multiplying "
    "(0 * NaN is NaN); mask the scores with -inf before the softmax and zero masked probabilities with "
    "torch.where (graphmode.attention.attend does both)"
)


class KVCacheIntegrityTests(ConformanceFixtures):
    def test_padding_never_touches_the_reserved_block(self, harness):
        reserved = [harness.slot_rows(t)[: harness.sizes.block].clone() for pair in harness.graph_cache for t in pair]
        seqs = harness.start(11)
        for batch in (11, 5, 9, 2, 11, 7):
            harness.step(seqs[:batch])
        after = [harness.slot_rows(t)[: harness.sizes.block] for pair in harness.graph_cache for t in pair]
        assert all(torch.equal(a, b) for a, b in zip(reserved, after)), "the reserved block 0 changed"

    def test_live_results_never_depend_on_the_reserved_block(self, harness):
        """Block 0 may hold anything, NaN included (an engine's cache made
        with torch.empty): with NaN there, a prefill and padded decode steps
        give finite live results equal to eager's. Every table's unused
        columns point at block 0, so a kernel that gathers whole tables and
        masks by multiplying (0 * NaN is NaN) fails here, though a zeroed
        block 0 hides it everywhere else."""
        if not harness.model.config.dtype.is_floating_point:
            pytest.skip("the model's dtype has no NaN")
        head_dim = harness.model.config.head_dim
        where = f"[reserved block] vendor {harness.vendor.name} on {harness.device}{harness.variant}"
        for pair in (*harness.graph_cache, *harness.eager_cache):
            for cache in pair:
                view = harness.model.ops.block_view(cache, head_dim)
                view[0].fill_(float("nan"))
                if int(cache.isnan().sum()) != view[0].numel():
                    raise ConformanceFailure(
                        f"{where}: NaN written into block 0 of block_view(cache, head_dim) did not reach the KV "
                        f"cache: block_view returned a copy (of shape {tuple(view.shape)}; the cache's layout: "
                        f"{harness.model.ops.layout}), not a view sharing the cache's memory, so this test and "
                        "every write through it would test the copy. Fix graphmode_attention_ops' block_view: "
                        "return a view of the cache (permute, transpose, view); reshape of a permuted tensor, "
                        "contiguous() and clone() copy it"
                    )
        harness.check = "reserved block"
        seqs = [harness.engine.add() for _ in range(11)]
        step = harness.engine.prefill(seqs, [harness.engine.rng.randrange(1, 3 * harness.sizes.block) for _ in seqs])
        with torch.inference_mode():
            harness._call_runner(step)
            eager = harness._call_model(step)
        if not torch.isfinite(eager).all():
            rows = (~torch.isfinite(eager)).flatten(2).any(-1)[0].nonzero().flatten().tolist()
            raise ConformanceFailure(
                f"{where}: an eager prefill of 11 sequences gives non-finite logits at tokens "
                f"{rows[:8]}{' ...' if len(rows) > 8 else ''} with NaN in the reserved block 0. {_NAN_IN_BLOCK_0}"
            )
        for batch in (11, 5, 9, 2, 11, 7):
            try:
                harness.step(seqs[:batch])
            except ConformanceFailure as failure:
                if "= nan" not in str(failure):
                    raise
                raise ConformanceFailure(
                    f"{str(failure).split(' Likely cause:')[0].rstrip('.')}, with NaN in the reserved block 0 (a decode step "
                    f"eagerly and in its graph alike, or in the graph alone). {_NAN_IN_BLOCK_0}, or a padding row's "
                    "result reaching a live one in the graph"
                ) from failure

    def test_padding_rows_read_no_block_but_the_reserved_one(self, harness):
        """The blocks a block-table sentinel reaches when used as an index
        (-1: the cache's last block; a declared sentinel -k: the k-th from
        last), which no sequence is given here, hold NaN: padded decode
        steps keep finite padding outputs and eager's live results. A kernel
        that indexes the cache with its table's sentinel reads that block in
        PyTorch, where a device kernel reads out of range; block 0's tests
        cannot see it."""
        if not harness.model.config.dtype.is_floating_point:
            pytest.skip("the model's dtype has no NaN")
        head_dim = harness.model.config.head_dim
        blocks = harness.model.ops.block_view(harness.graph_cache[0][0], head_dim).shape[0]
        # -1, and every negative padding the vendor declares for a table (an integer buffer with a BLOCKS dimension).
        sentinels = {-1} | {spec.padding for spec in harness.runner.spec.buffers
                            if BLOCKS in spec.shape and not spec.dtype.is_floating_point and spec.dtype != torch.bool
                            and isinstance(spec.padding, int) and spec.padding < 0}
        poisoned = sorted({blocks + sentinel for sentinel in sentinels if blocks + sentinel > 0})
        handed_out = [block for block in poisoned if block not in harness.engine.free_blocks]
        if handed_out:
            pytest.skip(f"the engine has handed out blocks {handed_out}, which table sentinels {sorted(sentinels)} reach")
        for block in poisoned:
            harness.engine.free_blocks.remove(block)
        for pair in (*harness.graph_cache, *harness.eager_cache):
            for cache in pair:
                view = harness.model.ops.block_view(cache, head_dim)
                for block in poisoned:
                    view[block].fill_(float("nan"))
        seqs = harness.start(11)
        for batch in (11, 5, 9, 2, 11, 7):
            try:
                harness.step(seqs[:batch])
            except ConformanceFailure as failure:
                if "non-finite" not in str(failure) and "= nan" not in str(failure):
                    raise
                reached = ", ".join(f"{blocks + s} (sentinel {s})" for s in sorted(sentinels, reverse=True)
                                    if blocks + s in poisoned)
                raise ConformanceFailure(
                    f"{str(failure).split(' Likely cause:')[0].rstrip('.')}, with NaN in blocks {reached} of the "
                    f"cache's {blocks}, which no sequence owns. Padding rows and unused table columns may read only "
                    "the reserved block 0. Likely cause: a kernel (graphmode_attention_ops) indexing the cache with "
                    "a block-table sentinel (PyTorch's index -k is the k-th block from the end; a device kernel "
                    "reads out of range); skip the sentinel in the kernel, or pad the table with block 0"
                ) from failure

    def test_sequences_left_out_of_a_step_keep_their_cache(self, harness):
        seqs = harness.start(8)
        harness.step(seqs)
        for _ in range(3):
            harness.step(seqs[:4])  # the harness checks the other four are untouched
        harness.step(seqs)


class LifecycleTests(ConformanceFixtures):
    def test_capture_step_and_replay_steps_are_both_correct(self, harness):
        seqs = harness.start(6)
        harness.step(seqs)
        stats = harness.runner.stats
        assert (stats.captures, stats.replays) == (1, 0), stats.summary()
        harness.step(seqs)
        harness.step(seqs)
        assert (stats.captures, stats.replays) == (1, 2), stats.summary()
        bucket = harness.runner.bucket_of(6)
        assert (stats.real_tokens, stats.padded_tokens) == (18, 3 * (bucket - 6))

    def test_reset_then_recapture(self, harness):
        seqs = harness.start(4)
        harness.step(seqs)
        harness.step(seqs)
        harness.runner.reset()
        assert harness.runner.captured_buckets == []
        harness.step(seqs)
        harness.step(seqs)
        assert harness.runner.stats.captures == 2

    def test_reset_and_a_dropped_runner_free_every_graph(self, harness):
        """After ``runner.reset()``, and once the runner is dropped, no graph
        it held stays alive: a graph keeps its captured memory, so one kept
        elsewhere (a registry of every graph made) grows device memory with
        every reload, though every output is right."""
        seqs = harness.start(6)
        for batch in (6, 2, 1):
            harness.step(seqs[:batch])
        _check_graphs_freed(harness, _graphs_of(harness.runner), "runner.reset()", harness.runner.reset)
        harness.step(seqs[:3])
        _check_graphs_freed(harness, _graphs_of(harness.runner), "the runner was dropped (del runner)",
                            lambda: setattr(harness, "runner", None))

    def test_weights_updated_in_place_reach_the_graph(self, harness):
        seqs = harness.start(4)
        harness.step(seqs)
        with torch.no_grad():
            for param in harness.model.parameters():
                param.mul_(0.5)
        harness.step(seqs)
        assert harness.runner.stats.replays == 1

    def test_warmup_then_decode(self, harness):
        harness.runner.warmup(harness.graph_cache, progress=False)
        assert harness.runner.captured_buckets == list(reversed(harness.runner.capture_sizes))
        seqs = harness.start(5)
        harness.step(seqs)
        harness.step(seqs[:2])
        assert harness.runner.stats.replays == 2

    @pytest.mark.parametrize("mode", EXECUTE_MODES)
    def test_warmup_reset_and_recapture_in_every_mode(self, build_harness, sizes, mode):
        harness = build_in_mode(build_harness, sizes, mode)
        harness.check = f"graph equals eager after warm-up and after reset ({mode})"
        runner, engine = harness.runner, harness.engine
        stats = runner.stats
        runner.warmup(harness.graph_cache, progress=False)
        warmed = stats.captures + stats.piecewise_captures
        assert warmed > 0, stats.summary()
        seqs = [engine.add() for _ in range(6)]
        harness.prefill(seqs, [3, 9, 1, 17, 5, 2])
        harness.decode(seqs)
        harness.decode(seqs[:3])
        assert stats.captures + stats.piecewise_captures == warmed, f"warm-up left graphs to capture: {stats.summary()}"
        runner.reset()
        assert runner.captured_graphs == [] and (runner.family("piecewise") is None or runner.family("piecewise").captured_buckets == [])
        harness.decode(seqs)
        harness.decode(seqs)
        assert stats.captures + stats.piecewise_captures == warmed + 1, stats.summary()

    def test_prefill_runs_eagerly_with_eager_results(self, harness):
        seqs = harness.start(3)
        harness.step(seqs)
        assert harness.runner.stats.eager_steps["prefill"] == 1

    def test_batch_above_the_capture_sizes_runs_eagerly(self, build_harness):
        harness = build_harness(capture_batch_sizes=[1, 2, 4])
        seqs = harness.start(6)
        harness.step(seqs)
        harness.step(seqs[:3])
        assert harness.runner.stats.eager_steps["no_bucket"] == 1
        assert harness.runner.stats.replays + harness.runner.stats.captures == 1

    def test_eager_mode_runs_everything_eagerly(self, build_harness):
        harness = build_harness(execute_mode="eager")
        seqs = harness.start(3)
        harness.step(seqs)
        assert harness.runner.stats.eager_steps == {"eager_mode": 2}
        assert harness.runner.captured_buckets == []


def _graphs_of(runner: Any) -> list[tuple[str, str, weakref.ref]]:
    """(bucket, graph class, weak reference) of every graph the runner holds
    (what graphmode_make_graph returned, or the default device graph)."""
    refs = []
    for bucket, q_len in runner.captured_graphs:
        graph = runner.graph(bucket, q_len).graph
        kind = f"{type(graph).__module__}.{type(graph).__qualname__}"
        try:
            refs.append((f"bucket {bucket}" + (f", q_len {q_len}" if q_len > 1 else ""), kind, weakref.ref(graph)))
        except TypeError:  # a class without weak references: not checkable here
            continue
    return refs


def _holders(obj: Any) -> list[str]:
    """Module-level names whose value (or a container that is) holds ``obj``."""
    referrers = [r for r in gc.get_referrers(obj) if isinstance(r, (list, dict, set, tuple))]
    found = []
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is obj or any(value is r for r in referrers):
                found.append(f"{module.__name__}.{name}")
    return found


def _check_graphs_freed(harness: Any, refs: list, when: str, drop: Any) -> None:
    drop()
    gc.collect()
    alive = [(where, kind, ref()) for where, kind, ref in refs if ref() is not None]
    if not alive:
        return
    where, kind, graph = alive[0]
    holders = _holders(graph)
    del graph
    held = f" (held by {', '.join(holders)})" if holders else ""
    raise ConformanceFailure(
        f"[graph lifetime] vendor {harness.vendor.name} on {harness.device}{harness.variant}: after {when}, "
        f"{len(alive)} of {len(refs)} graphs the runner held are still alive after gc.collect(): the {kind} of "
        f"{where}{held}{f' and {len(alive) - 1} more' if len(alive) > 1 else ''}. Something outside the runner keeps the graphs "
        "graphmode_make_graph returned (a module-level registry, a list in a global, a cache keyed by graph): "
        "each keeps its captured memory, so device memory grows with every reset or reload though outputs are "
        "right. Hook: graphmode_make_graph must leave its graphs to the runner; a plugin that must find them "
        "keeps them in a weakref.WeakSet (Ascend's, in meta.vendor_state), never a strong list"
    )


class ParameterUpdateTests(ConformanceFixtures):
    def test_new_host_values_reach_every_replay(self, capabilities, updates_graph_params, vendor, harness):
        if "host_kv_lengths" in capabilities and not updates_graph_params:
            raise ConformanceFailure(
                f"[parameter updates] vendor {vendor.name} declares host_kv_lengths but implements no "
                "graphmode_update_graph_params: its graphs would replay the kv lengths of their capture"
            )
        if not updates_graph_params:
            pytest.skip("the vendor pushes no host values into graphs")
        # Seven steps in one bucket (shrinks and regrowths): one capture, six replays.
        bucket, smaller = bucket_with_smaller_batches(harness.runner.capture_sizes, 2)
        least = [*smaller, bucket][-1]
        batches = (bucket, bucket, [*smaller, bucket][0], bucket, least, bucket, bucket)
        seqs = harness.start(bucket, [1 + 4 * i for i in range(bucket)])
        for batch in batches:
            harness.step(seqs[:batch])
        stats = harness.runner.stats
        if stats.replays < len(batches) - 1:
            raise ConformanceFailure(
                f"[parameter updates] vendor {vendor.name} on {harness.device}{harness.variant}: the batches "
                f"{list(batches)}, all in bucket {bucket} of the capture list {harness.runner.capture_sizes}, should "
                f"capture once and replay {len(batches) - 1} times, so that new host values reach replays; the runner "
                f"reports {stats.summary()}"
            )


class CapabilityTests(ConformanceFixtures):
    def test_graph_context_passes_a_dynamic_max_length(self, capabilities, harness, vendor):
        if "positive_max_len_limits" not in capabilities:
            pytest.skip("the vendor does not declare positive_max_len_limits (a kernel that derives -1 maxima "
                        "and would honour a positive one)")
        seqs = harness.start(3)
        step = harness.engine.decode(seqs)
        meta = harness.runner.graph_meta()
        bucket = harness.runner.bucket_of(3)
        with torch.inference_mode():
            vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=3, bucket=bucket)
            attn = vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=3, bucket=bucket).attn_metadata
        assert attn.max_kv_seq_len == -1 and attn.max_q_seq_len == -1, (
            f"vendor {vendor.name}: its kernel honours positive max lengths, so graph contexts must pass -1; "
            f"got max_q_seq_len={attn.max_q_seq_len}, max_kv_seq_len={attn.max_kv_seq_len}"
        )

    def test_x_active_mask_marks_live_tokens(self, capabilities, harness, vendor):
        if "x_active_mask" not in capabilities:
            pytest.skip("the vendor sets no x_active_mask")
        seqs = harness.start(harness.runner.bucket_of(5))
        harness.step(seqs)
        step = harness.engine.decode(seqs[:5])
        meta = harness.runner.graph_meta()
        bucket = harness.runner.bucket_of(5)
        with torch.inference_mode():
            vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=5, bucket=bucket)
            attn = vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=5, bucket=bucket).attn_metadata
        expected = [True] * 5 + [False] * (bucket - 5)
        assert attn.x_active_mask.tolist() == expected, f"x_active_mask {attn.x_active_mask.tolist()}, expected {expected}"

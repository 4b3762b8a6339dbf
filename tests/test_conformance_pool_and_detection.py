"""The memory-pool and detection checks of the conformance suite, on graph
classes and declarations the broken plugins do not cover."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from broken_plugins import _PoolDroppingGraph, variant

import graphmode
import graphmode.default as cuda
from graphmode import hookimpl
from graphmode_conformance.detection import runtime_module, visible_device_types
from graphmode_conformance.harness import ConformanceFailure
from graphmode_conformance.modes import ModeHarness
from graphmode_conformance.pool import check_one_pool, runner_graphs
from graphmode_conformance.sizes import Sizes


class _PoolLyingGraph(_PoolDroppingGraph):
    """Captures into a pool of its own, but returns the pool it was given
    from pool(): the tokens agree, the emulator's record of captures does not."""

    given: Any = None

    def capture_begin(self, pool: Any = None) -> None:
        self.given = pool
        self.inner.capture_begin()

    def pool(self) -> Any:
        return self.given if self.given is not None else self.inner.pool()


@hookimpl
def _pool_lying_graph(meta):
    return _PoolLyingGraph(meta.device)


def _harness_after_three_buckets(plugin: Any) -> ModeHarness:
    vendor = graphmode.load_vendor("cuda", plugin=plugin)
    harness = ModeHarness.build(vendor, torch.device("cpu"), Sizes(max_batches=12), capture_batch_sizes=[1, 4, 8])
    engine = harness.engine
    seqs = [engine.add() for _ in range(8)]
    harness.prefill(seqs, [3, 5, 1, 7, 2, 2, 4, 6])
    for batch in (8, 3, 1):
        harness.decode(seqs[:batch])
    assert len(runner_graphs(harness.runner)) == 3
    return harness


def test_the_shared_pool_passes():
    check_one_pool("cuda", _harness_after_three_buckets(variant(cuda, "cuda_original")).runner)


def test_a_graph_whose_pool_token_lies_is_caught_by_the_emulators_record():
    harness = _harness_after_three_buckets(variant(cuda, "pool_lying", graphmode_make_graph=_pool_lying_graph))
    with pytest.raises(ConformanceFailure, match=r"the emulator recorded only 1 of the 3 captures in it"):
        check_one_pool("pool_lying", harness.runner)


def test_runtime_modules_are_told_from_stacks_named_in_words():
    assert runtime_module("torch_npu") == "torch_npu"
    assert runtime_module("torch_mlu") == "torch_mlu"
    assert runtime_module("torch CUDA") is None
    assert runtime_module("MetaX torch (MACA)") is None


def test_visible_device_types_are_those_torch_sees():
    assert visible_device_types(("cpu_does_not_exist", "mlu")) == []
    assert visible_device_types(("cuda",)) == (["cuda"] if torch.cuda.is_available() else [])

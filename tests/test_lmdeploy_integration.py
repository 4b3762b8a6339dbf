"""graphmode.integrations.lmdeploy where lmdeploy imports (CI installs its Python part, .ci/lmdeploy-cpu.txt).

What runs here: the seam check against the installed lmdeploy, and its failure on a seam
changed the ways an lmdeploy release could change it; installing and removing graphmode's
builder on lmdeploy's real backend classes; debug mode's step checks on lmdeploy's own
attention metadata. What cannot run without a GPU: an lmdeploy engine (its kernels are
Triton's), so tokens, throughput, start-up, memory and sleep/wake-up are
``scripts/lmdeploy_side_by_side.py``'s, on the GPU (docs/engines.md, "lmdeploy").
"""

from __future__ import annotations

import inspect

import hangs
import pytest
import torch

pytest.importorskip("lmdeploy.pytorch.backends.cuda.op_backend", reason="lmdeploy's PyTorch engine is not installed")

from lmdeploy.pytorch.backends.cuda.attention import TritonAttentionMetadata  # noqa: E402
from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend  # noqa: E402
from lmdeploy.pytorch.backends.dlinfer.camb.op_backend import CambOpsBackend  # noqa: E402
from lmdeploy.pytorch.engine.executor.mp_executor import ExecutorProc  # noqa: E402
from lmdeploy.pytorch.models.utils.cudagraph import CudaGraphMixin  # noqa: E402

import graphmode.integrations.lmdeploy as gm_lmdeploy  # noqa: E402
from graphmode.errors import InputError  # noqa: E402
from graphmode.integrations.lmdeploy.seam import SeamError  # noqa: E402
from graphmode.integrations.lmdeploy.step_checks import check_decode_step  # noqa: E402


@pytest.fixture(autouse=True)
def _disabled():
    gm_lmdeploy.disable()
    yield
    gm_lmdeploy.disable()


def test_the_seam_of_the_installed_lmdeploy_is_the_expected_one():
    assert gm_lmdeploy.check_seam() in gm_lmdeploy.TESTED_VERSIONS


def _refused_naming(*words: str) -> None:
    original = CudaOpsBackend.__dict__["build_graph_runner"]
    with pytest.raises(SeamError) as raised:
        gm_lmdeploy.enable()
    message = str(raised.value)
    assert "lmdeploy 0.18.0" in message and "pin lmdeploy==0.18.0" in message
    for word in words:
        assert word in message
    assert not gm_lmdeploy.enabled()
    assert CudaOpsBackend.__dict__["build_graph_runner"] is original  # nothing was replaced


def test_a_model_hook_taking_other_parameters_is_refused(monkeypatch):
    def fill_buffers_cudagraph(self, graph_meta, inputs):  # a release that bundled the step's inputs
        return inputs

    monkeypatch.setattr(CudaGraphMixin, "fill_buffers_cudagraph", fill_buffers_cudagraph)
    _refused_naming("CudaGraphMixin.fill_buffers_cudagraph takes (graph_meta, inputs)")


def test_a_model_hook_that_is_gone_is_refused(monkeypatch):
    monkeypatch.delattr(CudaGraphMixin, "update_context_cudagraph")
    _refused_naming("CudaGraphMixin.update_context_cudagraph is gone")


def test_a_backend_builder_of_another_shape_is_refused(monkeypatch):
    def build_graph_runner(model, config):
        raise AssertionError("never called")

    monkeypatch.setattr(CudaOpsBackend, "build_graph_runner", staticmethod(build_graph_runner))
    with pytest.raises(SeamError, match=r"CudaOpsBackend.build_graph_runner takes \(model, config\)"):
        gm_lmdeploy.enable()


def test_a_moved_graph_meta_builder_is_refused(monkeypatch):
    import lmdeploy.pytorch.backends.cuda.graph_runner.full_graph as full_graph

    monkeypatch.delattr(full_graph, "_make_graph_meta")
    _refused_naming("full_graph._make_graph_meta is gone")


def test_a_runner_without_the_piecewise_manager_graphmode_reads_is_refused(monkeypatch):
    # graphmode leaves cuBLAS's workspace map alone while lmdeploy's piecewise graphs hold a workspace of it
    # (runner.py); a release that renamed the attribute would have graphmode free that workspace unseen.
    from lmdeploy.pytorch.backends.cuda.graph_runner.runner import CUDAGraphRunner

    def __init__(self, model, model_config, cache_config, backend_config, device):
        self.piecewise = None

    monkeypatch.setattr(CUDAGraphRunner, "__init__", __init__)
    _refused_naming("CUDAGraphRunner.__init__ sets no self._piecewise_graph_manager")


def test_the_deepep_mode_switch_graphmode_calls_is_checked(monkeypatch):
    import lmdeploy.pytorch.backends.cuda.graph_runner.runner as runner

    monkeypatch.delattr(runner, "_update_deepep_mode")
    _refused_naming("runner._update_deepep_mode is gone")


def test_enable_replaces_the_backends_builders_and_disable_puts_them_back():
    own = {cls: cls.__dict__["build_graph_runner"] for cls in (CudaOpsBackend, CambOpsBackend)}
    device_types = gm_lmdeploy.enable()
    assert {"cuda", "camb", "maca"} <= set(device_types)
    assert gm_lmdeploy.enabled()
    for cls in own:
        assert cls.__dict__["build_graph_runner"] is not own[cls]
        # what lmdeploy's agents pass still binds
        inspect.signature(cls.build_graph_runner).bind(None, model_config=None, cache_config=None,
                                                       backend_config=None, device=None)
    assert gm_lmdeploy.enable() == device_types  # twice is once
    gm_lmdeploy.disable()
    assert not gm_lmdeploy.enabled()
    for cls, builder in own.items():
        assert cls.__dict__["build_graph_runner"] is builder


def _decode_step(q_seqlens, kv_seqlens, table):
    attn = TritonAttentionMetadata(
        is_decoding=True,
        block_offsets=torch.tensor(table, dtype=torch.int32),
        q_start_loc=torch.cumsum(torch.tensor([0, *q_seqlens[:-1]]), 0).int(),
        q_seqlens=torch.tensor(q_seqlens, dtype=torch.int32),
        kv_seqlens=torch.tensor(kv_seqlens, dtype=torch.int32),
    )
    return {"input_ids": torch.zeros(1, sum(q_seqlens), dtype=torch.int64), "attn_metadata": attn}


def test_debug_checks_accept_a_legal_decode_step():
    check_decode_step(_decode_step([1, 1], [5, 17], [[3, 0], [4, 7]]), bucket=2, q_len=1, num_blocks=8,
                      block_size=16)


@pytest.mark.parametrize(("step", "q_len", "names"), [
    (([2, 0], [5, 17], [[3, 0], [4, 7]]), 1, "q_seqlens=2"),                # a row adding another token count
    (([1, 1], [5, 40], [[3, 0], [4, 7]]), 1, "kv_seqlens=40, outside 1..32"),  # past the block table
    (([1, 1], [5, 17], [[3, 0], [0, 7]]), 1, "block ids [0]"),              # a live row in the padding block
    (([1, 1], [5, 17], [[3, 0], [4, 9]]), 1, "block ids [9]"),              # past the cache
])
def test_debug_checks_refuse_what_a_graph_would_replay_wrongly(step, q_len, names):
    with pytest.raises(InputError, match="row 1" if "q_seqlens" not in names else "row 0") as raised:
        check_decode_step(_decode_step(*step), bucket=2, q_len=q_len, num_blocks=9, block_size=16)
    assert names in str(raised.value)


class _ReportingProc(ExecutorProc):
    """lmdeploy's worker process, its main loop saying what the worker sees (a worker's real loop needs a GPU)."""

    def _main_loop(self, queue):
        from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend as WorkerBackend

        import graphmode.integrations.lmdeploy as in_worker

        queue.put((in_worker.enabled(), in_worker._settings.execute_mode,
                   WorkerBackend.__dict__["build_graph_runner"].__func__.__name__))


def test_a_tensor_parallel_worker_process_builds_graph_runners_through_graphmode_too():
    import multiprocessing

    gm_lmdeploy.enable(execute_mode="full_and_piecewise")
    context = multiprocessing.get_context("spawn")  # lmdeploy's mp executor's
    queue = context.Queue()
    worker = _ReportingProc(proc_id=0, mp_ctx=context)
    worker.start(queue=queue)  # lmdeploy's own start, through graphmode's seam
    try:
        seen = hangs.get(queue, "the spawned lmdeploy worker's report", ci_seconds=10)
        assert seen == (True, "full_and_piecewise", "graphmode_build_graph_runner")
    finally:
        hangs.join(worker._proc, "the spawned lmdeploy worker", ci_seconds=5)  # ExecutorProc.join takes no timeout
    assert worker.mp_ctx is context  # lmdeploy's context is given back
    gm_lmdeploy.disable()
    assert ExecutorProc.__dict__["start"].__name__ == "start"

"""A captured matmul keeps the address of cuBLAS's workspace; cuBLAS keeps
its workspaces in a process-wide map that anyone may clear
(``torch.compile``'s CUDA graph trees do around every recording). graphmode
gives each capture a workspace in its own graph's pool
(``graphmode.graphs.torch_graph.drop_blas_workspaces``), so a replay after
such a clearing, and after the pool of the process's first graph is gone,
still computes right. Needs a GPU: on an H100, before the fix, the decode
bench's first replay after a reduce-overhead compile failed with "an illegal
memory access" in 5 of 8 processes."""

from __future__ import annotations

import pytest
import torch

import graphmode
from graphmode.graphs.torch_graph import TorchGraph, drop_blas_workspaces, keep_blas_workspaces
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _captured_matmul(a: torch.Tensor, b: torch.Tensor) -> tuple[TorchGraph, torch.Tensor]:
    graph = TorchGraph(torch.device("cuda"))
    torch.matmul(a, b)  # warm-up outside the graph
    torch.cuda.synchronize()
    with graph.capture():
        out = torch.matmul(a, b)
    return graph, out


@needs_cuda
def test_a_graph_replays_right_after_the_blas_workspaces_are_cleared_and_the_first_pool_is_gone():
    torch.manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    expected = torch.matmul(a, b)
    for _ in range(3):
        first, _ = _captured_matmul(a, b)  # the process's capture stream's workspace, in this graph's pool
        first.reset()
        del first
        second, out = _captured_matmul(a, b)
        torch._C._cuda_clearCublasWorkspaces()  # as CUDA graph trees do
        torch.cuda.empty_cache()  # the first graph's pool goes back to the driver
        filler = [torch.full((64, 2**20), 7.0, device="cuda") for _ in range(8)]  # reuse what was freed
        second.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected)
        del second, out, filler


@needs_cuda
def test_sleep_gives_back_the_segment_of_the_last_captures_workspace():
    """The map keeps the last capture's workspace, a block of the runner's
    pool, and one live block keeps its segment from the driver: before the
    runner dropped the map at sleep, 254 MiB of the bench model's 266 MiB of
    graph memory stayed mapped on an H200. After sleep() and after reset()
    torch's allocator holds what it held before warmup(), and a second
    sleep leaves the driver's free memory where the first did. (Not checked
    against free memory before warm-up: the CUDA driver keeps memory of its
    own once a process has made graphs, docs/performance.md, "Sleep and wake".)"""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = build_reference_model(ModelConfig.tiny(torch.bfloat16), device=device)
    cache = model.make_kv_cache(num_cache_blocks=64, block_size=16)
    runner = graphmode.build_graph_runner(model, execute_mode="graph", max_batches=16, max_blocks_per_seq=4,
                                          block_size=16, device=device)
    engine = ReferenceEngine(num_cache_blocks=64, block_size=16, device=device, vocab_size=model.config.vocab_size)
    seqs = [engine.add() for _ in range(4)]
    step = engine.prefill(seqs, [5, 9, 3, 7])
    with torch.inference_mode():  # first-use work (kernels loaded, the default stream's workspace) before measuring
        model(step.input_ids, step.position_ids, cache, step.attn_metadata)

    def held() -> tuple[int, int]:  # torch's reserved bytes, the driver's free bytes
        torch.cuda.synchronize()
        drop_blas_workspaces(device)  # the eager steps' workspace too: sleep() drops it with the capture stream's
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device), torch.cuda.mem_get_info()[0]

    reserved, _ = held()
    runner.warmup(cache, progress=False)
    assert held()[0] > reserved  # the graphs took memory
    asleep = []
    for _ in range(2):
        runner.sleep()
        now, free = held()
        assert now == reserved, (now - reserved) / 2**20
        asleep.append(free)
        runner.wake(cache, progress=False)
    assert abs(asleep[1] - asleep[0]) <= 2 * 2**20, (asleep[0] - asleep[1]) / 2**20
    runner.reset()
    assert held()[0] == reserved


def test_within_keep_blas_workspaces_nothing_clears_the_map(monkeypatch):
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False)
    cuda = torch.device("cuda")
    with keep_blas_workspaces(), keep_blas_workspaces():
        drop_blas_workspaces(cuda)
    assert cleared == []
    drop_blas_workspaces(cuda)
    drop_blas_workspaces(torch.device("cpu"))
    assert cleared == [1]


@needs_cuda
def test_a_graph_captured_elsewhere_keeps_its_workspace_while_graphmode_captures_beside_it():
    # lmdeploy's piecewise graphs warm up eagerly on a stream of their own, whose cuBLAS workspace is made in
    # ordinary memory, then capture it: a graphmode capture clearing the map freed that memory, which later
    # tensors took while every replay of the other graph wrote scratch into it (the lmdeploy review, 2026-12-04).
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    theirs = torch.cuda.Stream()
    with torch.cuda.stream(theirs):
        torch.matmul(a, b)
    theirs.synchronize()
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other, stream=theirs):
        out = torch.matmul(a, b)
    with keep_blas_workspaces():
        _captured_matmul(a, b)
    tensors = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(16)]  # memory a freed workspace would give
    other.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a @ b)
    assert all(bool((t == 7.0).all()) for t in tensors)

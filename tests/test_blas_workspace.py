"""A captured matmul keeps the address of cuBLAS's workspace; cuBLAS keeps
its workspaces in a process-wide map that anyone may clear
(``torch.compile``'s CUDA graph trees do around every recording). graphmode
gives each capture a workspace in its own graph's pool
(``graphmode.graphs.torch_graph._fresh_blas_workspace``), so a replay after
such a clearing, and after the pool of the process's first graph is gone,
still computes right. Needs a GPU: on an H100, before the fix, the decode
bench's first replay after a reduce-overhead compile failed with "an illegal
memory access" in 5 of 8 processes."""

from __future__ import annotations

import pytest
import torch

from graphmode.graphs.torch_graph import TorchGraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _captured_matmul(a: torch.Tensor, b: torch.Tensor) -> tuple[TorchGraph, torch.Tensor]:
    graph = TorchGraph(torch.device("cuda"))
    torch.matmul(a, b)  # warm-up outside the graph
    torch.cuda.synchronize()
    with graph.capture():
        out = torch.matmul(a, b)
    return graph, out


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

"""The ways of running one decode step that the benchmark compares.

Each mode is a callable taking a :class:`StepInputs` and returning logits for
the live tokens; ``prepare(batch)`` does once-per-size work (capture, compile)
outside the timed steps and returns how long it took.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch

import graphmode
from graphmode.buckets import graded_sizes
from graphmode.context import AttnMetadata, StepInputs

__all__ = ["Compiled", "Eager", "GraphmodeOverCompiled", "GraphmodeRunner", "HandWrittenGraph"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Eager:
    name = "eager"

    def __init__(self, model: Any) -> None:
        self.model = model

    def prepare(self, batch: int) -> float:
        return 0.0

    @torch.inference_mode()
    def __call__(self, step: StepInputs) -> torch.Tensor:
        return self.model(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)


class GraphmodeRunner:
    """graphmode's runner with a vendor's plugin; ``options`` go to
    :func:`graphmode.build_graph_runner`."""

    def __init__(self, model: Any, workload: Any, vendor: str, **options: Any) -> None:
        self.name = f"graphmode[{vendor}]"
        self.runner = graphmode.build_graph_runner(
            model, max_batches=workload.max_batches, max_blocks_per_seq=workload.width,
            block_size=workload.block_size, device=workload.device, vendor=vendor, **options,
        )

    def prepare(self, batch: int) -> float:
        return 0.0  # the first step of a bucket captures; warm-up steps cover it

    def __call__(self, step: StepInputs) -> Any:
        return self.runner(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)


class GraphmodeOverCompiled(GraphmodeRunner):
    """graphmode's graphs around ``torch.compile`` (Inductor kernels, no CUDA
    graphs of its own): ``build_graph_runner(..., compile=True)``, compiled
    once with a symbolic batch for every bucket (its compile time is in
    ``runner.stats.compile_seconds``): how serving engines combine the two."""

    def __init__(self, model: Any, workload: Any, vendor: str) -> None:
        super().__init__(model, workload, vendor, compile=True)
        self.name = f"graphmode[{vendor}] over torch.compile"


class HandWrittenGraph:
    """What a careful engineer writes by hand for one model: static inputs,
    one ``torch.cuda.CUDAGraph`` per bucket (graphmode's default buckets) in a
    shared pool, and direct copies into the static inputs before each replay. With ``exact=True`` it
    captures a graph at every batch size measured: no padding at all."""

    def __init__(self, model: Any, workload: Any, exact: bool = False) -> None:
        self.name = "hand-written graph (exact size)" if exact else "hand-written graph"
        self.model, self.exact = model, exact
        device, rows, width = workload.device, workload.max_batches, workload.width
        self.kv_cache = workload.kv_cache
        self.ids = torch.zeros((1, rows), dtype=torch.int64, device=device)
        self.positions = torch.zeros((1, rows), dtype=torch.int64, device=device)
        self.blocks = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.q_start = torch.arange(rows, dtype=torch.int32, device=device)
        self.q_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.kv_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.sizes = graded_sizes(rows)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _bucket(self, batch: int) -> int:
        return batch if self.exact else self.sizes[bisect.bisect_left(self.sizes, batch)]

    @torch.inference_mode()
    def prepare(self, batch: int) -> float:
        bucket = self._bucket(batch)
        if bucket in self.graphs:
            return 0.0
        started = time.perf_counter()
        attn = AttnMetadata(True, self.blocks[:bucket], self.q_start[:bucket], self.q_lens[:bucket],
                            self.kv_lens[:bucket], self.slots[:bucket], 1, -1)
        args = (self.ids[:, :bucket], self.positions[:, :bucket], self.kv_cache, attn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Its matmuls' cuBLAS workspace in the graph's pool, as graphmode does
        # (graphmode.graphs.torch_graph.drop_blas_workspaces says why).
        torch._C._cuda_clearCublasWorkspaces()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.model(*args)
        self.graphs[bucket] = (graph, output)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    @torch.inference_mode()
    def __call__(self, step: StepInputs) -> torch.Tensor:
        attn, batch = step.attn_metadata, step.attn_metadata.batch_size
        bucket = self._bucket(batch)
        self.ids[:, :batch].copy_(step.input_ids)
        self.positions[:, :batch].copy_(step.position_ids)
        self.blocks[:batch].copy_(attn.block_offsets)
        self.kv_lens[:batch].copy_(attn.kv_seqlens)
        self.slots[:batch].copy_(attn.kv_start_indices)
        if bucket > batch:
            self.blocks[batch:bucket].zero_()
            self.kv_lens[batch:bucket].fill_(1)
            self.slots[batch:bucket].fill_(-1)
        graph, output = self.graphs[bucket]
        graph.replay()
        return output[:, :batch]


class Compiled:
    """``torch.compile(mode="reduce-overhead")`` of the same forward: Inductor
    kernels replayed from CUDA graph trees. The KV cache is marked as a static
    address so that the trees accept the forward writing into it.
    ``mode="default"``: Inductor kernels launched one by one, no graphs."""

    def __init__(self, model: Any, workload: Any, mode: str = "reduce-overhead") -> None:
        self.name = f"torch.compile {mode}"
        for pair in workload.kv_cache:
            for tensor in pair:
                torch._dynamo.mark_static_address(tensor)
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))  # one graph per batch size
        self.forward = torch.compile(model, mode=mode)
        self.device = workload.device
        self.prepared: set[int] = set()

    @torch.inference_mode()
    def prepare(self, batch: int) -> float:
        """Compiling (or recording a new size) happens on the first calls."""
        return 0.0

    @torch.inference_mode()
    def compile_for(self, steps: list[StepInputs]) -> float:
        """Run the first steps of a size untimed, and say how long they took:
        compilation and CUDA-graph recording for that size."""
        started = time.perf_counter()
        for step in steps:
            self(step)
        _sync(self.device)
        return time.perf_counter() - started

    @torch.inference_mode()
    def __call__(self, step: StepInputs) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return self.forward(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)

"""Where the time to capture every bucket goes, and what the graph pool
holds against the largest graph alone. Needs a GPU.

    python scripts/profile_capture.py            # bench model, default buckets to 256

Captures every bucket three times, each into a new runner (the first run
includes first-use costs: Triton's compilations, cuBLAS initialisation),
lists what the graph pool holds (its segments and live blocks, with where
each live block was allocated), then profiles a fourth capture of every
bucket with cProfile and prints the functions with the most cumulative and
own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import graph_memory
import torch

from graphmode.bench.cli import capture_cost
from graphmode.bench.workload import Workload
from graphmode.devices import require_gpu
from graphmode.model import ModelConfig


def main() -> None:
    device = require_gpu(__file__)
    workload = Workload.build(ModelConfig.bench(), device, steps=2)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for run in range(3):
        every = capture_cost(workload, None)
        print(f"run {run + 1}: {every['buckets']} buckets in {every['seconds']:.2f} s, pool "
              f"{every['graph_memory_bytes'] / 2**20:.1f} MiB")
    alone = capture_cost(workload, [workload.max_batches])
    print(f"largest bucket alone: {alone['seconds']:.2f} s, pool {alone['graph_memory_bytes'] / 2**20:.1f} MiB")
    pool_contents(workload)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    capture_cost(workload, None)
    profiler.disable()
    print(f"profiled run: {time.perf_counter() - started:.2f} s (cProfile's overhead included)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(35)
    stats.sort_stats("tottime").print_stats(20)


def pool_contents(workload: Workload) -> None:
    """The segments of the graph pool after capturing every bucket, and its
    live blocks grouped by where they were allocated (``graph_memory.py``'s
    report, over this workload)."""
    args = argparse.Namespace(max_batches=workload.max_batches, block_size=workload.block_size)
    graph_memory.pool_contents(workload.model, workload.kv_cache, workload.width, args)


if __name__ == "__main__":
    main()

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

import cProfile
import pstats
import time

import torch

import graphmode
from graphmode.bench.cli import capture_cost
from graphmode.bench.workload import Workload
from graphmode.model import ModelConfig


def main() -> None:
    device = torch.device("cuda")
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
    live blocks grouped by where they were allocated."""
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
    runner = graphmode.build_graph_runner(
        workload.model, max_batches=workload.max_batches, max_blocks_per_seq=workload.width,
        block_size=workload.block_size, device=workload.device,
    )
    runner.warmup(workload.kv_cache, progress=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    segments = [s for s in snapshot["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    total = sum(s["total_size"] for s in segments)
    print(f"graph pool after capturing {len(runner.capture_sizes)} buckets: {len(segments)} segments, "
          f"{total / 2**20:.1f} MiB")
    sites: dict[str, list[int]] = {}
    for segment in segments:
        print(f"  segment {segment['total_size'] / 2**20:6.1f} MiB ({segment['segment_type']}), "
              f"allocated {segment['allocated_size'] / 2**20:6.2f} MiB")
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if "graphmode" in f["filename"] or "llama" in f["filename"]][:3]
            sites.setdefault(" <- ".join(frames) or "(no Python frame)", []).append(block["size"])
    print("  live blocks by allocation site (count, MiB):")
    for site, sizes in sorted(sites.items(), key=lambda item: -sum(item[1])):
        print(f"    {len(sizes):4d} {sum(sizes) / 2**20:8.2f}  {site}")
    runner.reset()


if __name__ == "__main__":
    main()

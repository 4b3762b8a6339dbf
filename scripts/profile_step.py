"""Where the device time of one replayed decode step goes, kernel by kernel.
Needs a GPU.

    python scripts/profile_step.py --batches 1,256            # graphmode over torch.compile
    python scripts/profile_step.py --batches 1 --no-compile   # graphmode over the eager kernels

Captures every bucket first, as an engine does at start (a graph replays
about 15% slower on an H100 once a process holds more than one CUDA graph,
so a process with one graph would flatter the figures). For each batch
size: times the step (median of the replays, device synchronised), then
records the replays with torch.profiler (CUPTI reports
the kernels a graph launches) and prints, per step: the kernels grouped by
name (count, total and mean time), the sum of kernel time, and the step's
span minus that sum, the device idle between the graph's kernels.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from graphmode.bench.modes import GraphmodeRunner
from graphmode.bench.workload import Workload
from graphmode.devices import require_gpu
from graphmode.model import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = require_gpu(__file__)
    workload = Workload.build(ModelConfig.bench(), device, steps=args.steps)
    options = {"compile_options": {"mode": args.compile_mode}} if args.compile else {}
    mode = GraphmodeRunner(workload.model, workload, "cuda", compile=args.compile, **options)
    started = time.perf_counter()
    mode.runner.warmup(workload.kv_cache, progress=False)
    print(f"warm-up (compilation and capture of {len(mode.runner.captured_buckets)} buckets): "
          f"{time.perf_counter() - started:.1f} s")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, compile={args.compile}"
          + (f", mode {args.compile_mode}" if args.compile else ""))
    for batch in (int(b) for b in args.batches.split(",")):
        steps = workload.steps(batch, args.steps)
        for step in steps[:3]:
            mode(step)
        torch.cuda.synchronize()
        times = []
        for step in steps:
            started = time.perf_counter()
            mode(step)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for step in steps:
                mode(step)
            torch.cuda.synchronize()
        report(batch, steps, times, prof, args.top)


def report(batch: int, steps: list, times: list[float], prof: profile, top: int) -> None:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.device_time)
    n = len(steps)
    total = sum(e.device_time for e in kernels) / n
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / n
    print(f"\nbatch {batch}: step {statistics.median(times) * 1e3:.3f} ms (median of {n}, call to device done); "
          f"{len(kernels) / n:.0f} kernels per step, {total:.1f} us of kernel time per step; "
          f"profiled span {span:.1f} us per step, so {span - total:.1f} us idle between kernels")
    print(f"{'kernel':<80} {'per step':>8} {'us/step':>9} {'mean us':>8}")
    rows = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for name, durations in rows[:top]:
        print(f"{name[:80]:<80} {len(durations) / n:>8.1f} {sum(durations) / n:>9.1f} "
              f"{statistics.mean(durations):>8.2f}")
    rest = rows[top:]
    if rest:
        print(f"{f'({len(rest)} other kernels)':<80} {sum(len(d) for _, d in rest) / n:>8.1f} "
              f"{sum(sum(d) for _, d in rest) / n:>9.1f}")


if __name__ == "__main__":
    main()

"""``graphmode bench --tp N``: decode-step latency at tensor parallelism N
next to TP=1, eager and graph. It relaunches itself under torchrun, one
process per device; rank 0 measures and prints."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import graphmode
from graphmode.bench.common import add_arguments, median_step
from graphmode.bench.modes import Eager, GraphmodeRunner
from graphmode.bench.workload import Workload
from graphmode.buckets import parse_sizes
from graphmode.devices import usable_device
from graphmode.distributed import init_process_group, torchrun_rank
from graphmode.model import ModelConfig


def run_tp(args: argparse.Namespace) -> int:
    """Start ``args.tp`` ranks with torchrun running this module."""
    bench_args = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp),
               "-m", "graphmode.bench.tp", *bench_args]
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphmode bench --tp")
    add_arguments(parser)
    args = parser.parse_args(argv)
    usable_device(args.device, "graphmode bench --tp")
    rank, world, device = torchrun_rank(args.device)
    vendor = graphmode.select_vendor((args.vendors or "cuda").split(",")[0], device)
    init_process_group(vendor, device)
    config = ModelConfig.bench() if (args.config or ("bench" if device.type == "cuda" else "tiny")) == "bench" else ModelConfig.tiny()
    small = device.type == "cpu"
    batches = parse_sizes(args.batches or ("1,2,4,8" if small else "1,2,4,8,16,32,64,128,256"))
    sizes = dict(max_batches=max(batches), block_size=16 if small else 64, context=96 if small else 1024,
                 steps=args.warmup + args.steps, vendor=vendor.name)
    results: dict[str, Any] = {"tp": world, "device": torch.cuda.get_device_name(device) if not small else "CPU emulator",
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "latency_ms": {}}

    def measure(label: str, workload: Workload, process_group: Any) -> None:
        modes: dict[str, Any] = {
            "eager": Eager(workload.model),
            "graph": GraphmodeRunner(workload.model, workload, vendor.name, process_group=process_group),
        }
        for name, mode in modes.items():
            key = f"{label} {name}"
            results["latency_ms"][key] = {}
            for batch in batches:
                steps = workload.steps(batch, args.warmup + args.steps)
                for step in steps[: args.warmup]:
                    mode(step)
                latency = median_step(mode, steps[args.warmup:], device)
                results["latency_ms"][key][batch] = latency * 1e3
                if rank == 0:
                    print(f"{key:12s} batch {batch:4d}: {latency * 1e3:8.3f} ms", flush=True)

    measure(f"TP={world}", Workload.build(config, device, process_group=dist.group.WORLD, **sizes), dist.group.WORLD)
    dist.barrier()
    if rank == 0:
        measure("TP=1", Workload.build(config, device, **sizes), None)
        print_table(results, batches, world)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(results, out, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def print_table(results: dict[str, Any], batches: list[int], world: int) -> None:
    latency = results["latency_ms"]
    columns = ["TP=1 eager", "TP=1 graph", f"TP={world} eager", f"TP={world} graph"]
    print(f"\nmedian decode step, ms, on {results['device']} (torch {results['torch']})")
    print("batch " + " ".join(f"{c:>14s}" for c in columns) + "  graph speed-up at TP=1, TP=" + str(world))
    for batch in batches:
        cells = [latency[c][batch] for c in columns]
        print(f"{batch:5d} " + " ".join(f"{v:14.3f}" for v in cells)
              + f"  {cells[0] / cells[1]:.2f}x, {cells[2] / cells[3]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())

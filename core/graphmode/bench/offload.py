"""``graphmode bench --workload offload``: decode steps of the offloaded
model (seed 004, ``graphmode.model.offload.OffloadedLlama``: layer weights in
pinned host memory, loaded into a ring of device layers before each layer
runs), eagerly against per-layer piecewise graphs with the loads between
them. Also timed: the layers' loads alone, the floor a step cannot beat
while the loads are not overlapped with compute.

Per batch size, every mode runs that batch's steps before the next batch
(the steps advance the sequences, so each mode reads the cache as the one
before it left it); the logits of the first timed step are compared with
eager's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from graphmode.bench.measure import machine, measure, release
from graphmode.bench.modes import Eager, GraphmodeRunner, _sync
from graphmode.bench.prefill import size
from graphmode.bench.workload import Workload
from graphmode.buckets import parse_sizes
from graphmode.errors import ConfigError
from graphmode.model import ModelConfig
from graphmode.model.offload import OffloadedLlama

__all__ = ["load_time", "run_offload"]

GPU_BATCHES, CPU_BATCHES = "1,8,64", "1,4"


def run_offload(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config_name = args.config or ("bench" if cuda else "tiny")
    config = ModelConfig.bench() if config_name == "bench" else ModelConfig.tiny()
    batches = parse_sizes(args.batches or (GPU_BATCHES if cuda else CPU_BATCHES))
    if args.modes:
        raise SystemExit("graphmode bench --workload offload times eager and piecewise always; drop --modes")
    total = args.warmup + args.steps
    workload = Workload.build(config, device, max_batches=max(batches), block_size=64 if config_name == "bench" else 16,
                              context=1024 if config_name == "bench" else 96, steps=total, attention=args.attention)
    try:
        model = OffloadedLlama(workload.model, num_buffers=args.ring)
    except ConfigError as error:
        raise SystemExit(f"graphmode bench --workload offload: --ring {args.ring}: {error}") from None
    layer_bytes = sum(p.numel() * p.element_size() for p in model.ring[0].parameters())
    modes: list[Any] = [
        Eager(model),
        GraphmodeRunner(model, workload, "cuda", execute_mode="piecewise", capture_token_sizes=batches),
    ]
    modes[1].name = "piecewise"
    results: dict[str, Any] = {
        "workload": "offload", "machine": machine(device), "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv), "model": config_name, "ring": args.ring, "batches": batches,
        "attention": type(workload.model.ops).__name__, "warmup": args.warmup, "steps": args.steps,
        "loaded_bytes_per_step": layer_bytes * config.num_hidden_layers, "loads_ms": load_time(model, device),
        "latency_ms": {m.name: {} for m in modes}, "max_abs_diff": {"piecewise": {}}, "errors": {m.name: {} for m in modes},
    }
    print(f"graphmode bench --workload offload on {results['machine']['device']}, torch {torch.__version__}, "
          f"model {config_name} ({config.num_hidden_layers} layers), ring of {args.ring}, "
          f"{size(results['loaded_bytes_per_step'])} loaded per step; the loads alone "
          f"{results['loads_ms']:.3f} ms", flush=True)
    for batch in batches:
        steps = workload.steps(batch, total)
        rows, eager_sample = torch.arange(batch, device=device), None
        for mode in modes:
            got = measure(mode, steps, args.warmup, rows, device)
            results["latency_ms"][mode.name][batch] = got.ms
            if got.error is not None:
                results["errors"][mode.name][batch] = got.error
                print(f"{mode.name:10s} batch {batch:4d}: failed: {got.error}", flush=True)
                continue
            if isinstance(mode, Eager):
                eager_sample = got.sample
            elif eager_sample is not None and got.sample is not None:
                results["max_abs_diff"][mode.name][batch] = (got.sample - eager_sample).abs().max().item()
            print(f"{mode.name:10s} batch {batch:4d}: {got.ms:9.3f} ms", flush=True)
        release(device)
    results["stats"] = modes[1].runner.stats.summary()
    print_offload_table(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


def load_time(model: OffloadedLlama, device: torch.device, repeats: int = 10) -> float:
    """Median ms of one step's loads alone: every layer into its ring slot,
    synchronised before and after."""
    layers = len(model.host_weights)
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        for layer in range(layers):
            model.load(layer, layer % len(model.ring))
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def print_offload_table(results: dict[str, Any]) -> None:
    latency = results["latency_ms"]
    print(f"\noffloaded decode, median step ms ({results['steps']} timed after {results['warmup']} warm-up); "
          f"the loads alone {results['loads_ms']:.3f} ms")
    print(f"{'batch':>5s} {'eager':>10s} {'piecewise':>10s} {'speed-up':>9s} {'max |diff|':>11s}")
    for batch in results["batches"]:
        eager, graphs = latency["eager"].get(batch), latency["piecewise"].get(batch)
        ratio = f"{eager / graphs:8.2f}x" if eager and graphs else f"{'-':>9s}"
        diff = results["max_abs_diff"]["piecewise"].get(batch)
        cells = [f"{v:10.3f}" if v is not None else f"{'failed':>10s}" for v in (eager, graphs)]
        print(f"{batch:5d} " + " ".join(cells) + f" {ratio} " + (f"{diff:11.3g}" if diff is not None else f"{'-':>11s}"))
    print(f"piecewise: {results['stats']}")

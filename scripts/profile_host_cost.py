"""Where graphmode's host time goes on the replay path, per component, and
the kernel launches of one step (torch.profiler). Needs a GPU.

    python scripts/profile_host_cost.py --batches 1,64,100,128,256
    python scripts/profile_host_cost.py --host-bound --batches 1,8,64,256   # see host_bound.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import graphmode
from graphmode.bench.workload import Workload
from graphmode.devices import script_device
from graphmode.model import ModelConfig


def timed(function, repeats: int = 50) -> float:
    """Median host microseconds of ``function``, the device idle before each call."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,100,128,256")
    parser.add_argument("--host-bound", action="store_true",
                        help="a 2-layer model: graphmode against bare replay and hand-written graphs (host_bound.py)")
    parser.add_argument("--repeats", type=int, default=200, help="calls per measurement (--host-bound)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu (the emulator) only checks --host-bound runs")
    args = parser.parse_args()
    device = script_device(__file__, args.device)
    if args.host_bound:
        from host_bound import run

        run([int(b) for b in args.batches.split(",")], device, args.repeats)
        return
    workload = Workload.build(ModelConfig.bench(), device, steps=8)
    runner = graphmode.build_graph_runner(workload.model, max_batches=256, max_blocks_per_seq=workload.width,
                                          block_size=workload.block_size, device=device)
    hook = runner.vendor.hook
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host microseconds, median of 50, device idle")
    print("batch  check_step  fill_buffers  get_outputs  graph.replay  runner call  call - replay")
    for batch in [int(b) for b in args.batches.split(",")]:
        step = workload.steps(batch, 2)[0]
        call = lambda: runner(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)  # noqa: E731
        with torch.inference_mode():
            call()
            captured = runner.graph(runner.bucket_of(batch))
            fill = lambda: hook.graphmode_fill_buffers(meta=captured.meta, inputs=step, batch_size=batch, bucket=captured.bucket)  # noqa: E731
            outputs = lambda: hook.graphmode_get_outputs(meta=captured.meta, batch_size=batch, num_tokens=batch)  # noqa: E731
            row = [timed(lambda: runner._check_inputs(step)), timed(fill), timed(outputs),  # as the runner checks: per layout
                   timed(captured.graph.replay), timed(call)]
        print(f"{batch:5d} " + " ".join(f"{v:12.1f}" for v in row) + f" {row[4] - row[3]:13.1f}")
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            torch.cuda.synchronize()
            call()
    print("\none runner call at the last batch size, 20 calls profiled (CPU side):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    # The Python side, function by function (cProfile's overhead inflates
    # every call alike; the ranking is what it shows).
    python = cProfile.Profile()
    with torch.inference_mode():
        for _ in range(200):
            torch.cuda.synchronize()
            python.enable()
            call()
            python.disable()
    print("\n200 runner calls under cProfile, by own time:")
    pstats.Stats(python).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()

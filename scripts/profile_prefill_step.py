"""Where the device time of one replayed prefill step goes, kernel by
kernel: ``full_and_piecewise`` with ``compile=True`` over the bench model
(the prefill bench's cases, token buckets exactly their token counts).
Needs a GPU.

    python scripts/profile_prefill_step.py --cases 1x128,16x2048

Warms the runner up (every bucket captured, compiled first), times the step
(median of 10 replays, device synchronised; and when the call returns, the
host's part: a step whose call returns just before the step ends is
host-bound), then records one replay with
torch.profiler and prints the kernel count, the device's busy time within
the step's span, and the kernels grouped by name (total time, count).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from graphmode.bench.cases import PrefillWorkload, parse_cases
from graphmode.bench.modes import GraphmodeRunner
from graphmode.devices import require_gpu
from graphmode.model import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x128,16x2048")
    parser.add_argument("--mode", default="full_and_piecewise", choices=["piecewise", "full_and_piecewise"])
    args = parser.parse_args()
    device = require_gpu(__file__)
    cases = parse_cases(args.cases, decode_context=1024)
    workload = PrefillWorkload.build(ModelConfig.bench(), device, cases, block_size=64)
    mode = GraphmodeRunner(workload.model, workload, "cuda", execute_mode=args.mode, compile=True,
                           capture_token_sizes=sorted({case.tokens for case in cases}))
    started = time.perf_counter()
    mode.runner.warmup(workload.kv_cache, progress=False)
    print(f"warm-up {time.perf_counter() - started:.1f} s, of which compiling {mode.runner.stats.compile_seconds:.1f} s")
    for case in cases:
        steps, times, returns = workload.steps(case, 12), [], []
        with torch.inference_mode():
            for step in steps[:11]:
                torch.cuda.synchronize()
                begun = time.perf_counter()
                mode(step)
                returns.append(time.perf_counter() - begun)  # the host's part: every launch made
                torch.cuda.synchronize()
                times.append(time.perf_counter() - begun)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
                mode(steps[11])
                torch.cuda.synchronize()
        kernels = [event for event in recorded.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(event.device_time for event in kernels) / 1e3
        span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
        print(f"{case.name}: median step {statistics.median(times[1:]) * 1e3:.3f} ms (the call returns after "
              f"{statistics.median(returns[1:]) * 1e3:.3f} ms); {len(kernels)} kernels, "
              f"device busy {busy:.3f} ms of a {span:.3f} ms span")
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for event in kernels:
            by_name[event.name[:60]].append(event.device_time / 1e3)
        for name, values in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:14]:
            print(f"  {sum(values):9.3f} ms {len(values):5d}x  {name}")


if __name__ == "__main__":
    main()

"""A runner's replay on the device before and after other work in the same
process. Needs a GPU.

    python scripts/replay_after_captures.py

Each case runs in a new process: build the bench model's runner, capture
batch 1's graph, time its replay on the device (CUDA events around
``graph.replay()``, median of 30) and the whole step (call to device done),
do the case's work, time both again. Cases: another runner capturing every
bucket (then reset); 96 one-kernel graphs of plain PyTorch; eager forwards
of the model at four batch sizes; 2 GiB allocated and freed four times.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from graphmode.devices import require_gpu

CASES = ("another-runner", "one-kernel-graphs", "eager-forwards", "allocations")


def timed(mode, graph, steps) -> str:
    step_times, device_times = [], []
    for step in steps:
        torch.cuda.synchronize()
        started = time.perf_counter()
        mode(step)
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
    for _ in steps:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        device_times.append(start.elapsed_time(end))
    return f"step {statistics.median(step_times) * 1e3:.3f} ms, replay on the device {statistics.median(device_times):.3f} ms"


def run_case(case: str) -> None:
    from graphmode.bench.cli import capture_cost
    from graphmode.bench.modes import GraphmodeRunner
    from graphmode.bench.workload import Workload
    from graphmode.model import ModelConfig

    device = torch.device("cuda")
    workload = Workload.build(ModelConfig.bench(), device, steps=35)
    mode = GraphmodeRunner(workload.model, workload, "cuda")
    steps = workload.steps(1, 35)
    for step in steps[:5]:
        mode(step)
    graph = mode.runner.graph(1).graph
    before = timed(mode, graph, steps[5:])
    kept = []
    if case == "another-runner":
        capture_cost(workload, None)
    elif case == "one-kernel-graphs":
        x = torch.zeros(1024, device=device)
        for _ in range(96):
            kept.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(kept[-1]):
                x.add_(1)
    elif case == "eager-forwards":
        with torch.inference_mode():
            for batch in (256, 128, 64, 8):
                for step in workload.steps(batch, 3):
                    workload.model(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)
    elif case == "allocations":
        for _ in range(4):
            block = torch.empty(2 << 30, dtype=torch.uint8, device=device)
            block.fill_(1)
            del block
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    print(f"{case:18s} before: {before}\n{'':18s} after:  {timed(mode, graph, steps[5:])}", flush=True)


def main() -> None:
    require_gpu(__file__)
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bench model, batch 1, graphmode[cuda]", flush=True)
    for case in CASES:
        subprocess.run([sys.executable, __file__, case], check=True, timeout=600)


if __name__ == "__main__":
    main()

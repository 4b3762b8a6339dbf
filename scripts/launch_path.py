"""Why a replay's launch is slow behind the fill: the host time of
``graph.replay()`` alone, after different work was queued before it on the
same stream. Needs a GPU.

    python scripts/launch_path.py --batches 1,256

Per batch size, median host microseconds of the ``replay()`` call only (the
device synchronised before each trial), with before it:

- nothing (the device idle);
- the runner's fill (``graphmode_fill_buffers``: its fused copy kernels);
- the fill, then ``torch.cuda.synchronize()`` (the copies done);
- one small device copy kernel;
- one pinned host-to-device copy;
- a replay of the same graph (back to back);
- an event wait on a side stream's copy (the copy off the replay's stream).

A slow launch behind queued kernels shows up as the difference between the
first row and the others.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import graphmode
from graphmode.bench.workload import Workload
from graphmode.checks.cache_checks import check_same_objects
from graphmode.checks.validate import check_inputs
from graphmode.devices import require_gpu
from graphmode.model import ModelConfig


def replay_time(before: Callable[[], None], replay: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        before()
        started = time.perf_counter()
        replay()
        samples.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--config", choices=["bench", "host-bound"], default="bench")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.config == "bench":
        config = ModelConfig.bench()
    else:
        config = ModelConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=512, vocab_size=1024, dtype=torch.bfloat16)
    device = require_gpu(__file__)
    workload = Workload.build(config, device, max_batches=max(batches), steps=4)
    runner = graphmode.build_graph_runner(workload.model, max_batches=workload.max_batches, max_blocks_per_seq=workload.width,
                                          block_size=workload.block_size, device=device, capture_batch_sizes=batches)
    small = torch.zeros(64, device=device)
    small_source = torch.ones(64, device=device)
    pinned = torch.ones(4096, pin_memory=True)
    on_device = torch.zeros(4096, device=device)
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.config} model; host microseconds of "
          f"graph.replay() alone, median of {args.repeats}")
    with torch.inference_mode():
        for batch in batches:
            step = workload.steps(batch, 2)[0]
            runner(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)  # capture
            captured = runner.graph(batch)
            graph, meta, hook = captured.graph, captured.meta, runner.vendor.hook

            def fill() -> None:
                hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=batch)

            def fill_then_sync() -> None:
                fill()
                torch.cuda.synchronize()

            def side_copy() -> None:
                with torch.cuda.stream(side):
                    on_device.copy_(pinned, non_blocking=True)
                    event.record(side)
                torch.cuda.current_stream().wait_event(event)

            rows = {
                "nothing (idle)": lambda: None,
                "the runner's fill": fill,
                "fill, then synchronize": fill_then_sync,
                "one small copy kernel": lambda: small.copy_(small_source),
                "one pinned H2D copy": lambda: on_device.copy_(pinned, non_blocking=True),
                "a replay (back to back)": graph.replay,
                "wait on a side-stream copy": side_copy,
            }
            print(f"batch {batch}:")
            for name, before in rows.items():
                print(f"  {name:28} {replay_time(before, graph.replay, args.repeats):9.1f}")
            call = lambda: runner(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)  # noqa: E731
            print(f"  {'(the whole runner call)':28} {replay_time(lambda: None, call, args.repeats):9.1f}")
            # The runner's replay path, step by step, each part timed in place.
            parts: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                marks = [("start", time.perf_counter())]
                runner._busy.acquire(blocking=False)
                runner._busy.release()
                marks.append(("lock", time.perf_counter()))
                check_inputs(step, runner.config)
                marks.append(("check_inputs", time.perf_counter()))
                check_same_objects(captured, step)
                marks.append(("same objects", time.perf_counter()))
                fill()
                marks.append(("fill", time.perf_counter()))
                graph.replay()
                marks.append(("replay", time.perf_counter()))
                hook.graphmode_get_outputs(meta=meta, batch_size=batch, num_tokens=batch)
                marks.append(("outputs", time.perf_counter()))
                for (_, then), (name, now) in zip(marks, marks[1:]):
                    parts.setdefault(name, []).append(now - then)
            print("  the replay path in place: " + ", ".join(
                f"{name} {statistics.median(values) * 1e6:.1f}" for name, values in parts.items()))


if __name__ == "__main__":
    main()

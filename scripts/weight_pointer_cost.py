"""Host cost per graph step of the always-on check of the captured weights'
memory (graphmode.checks.weight_memory.WeightMemory: the data pointers of
the model's parameters and buffers against those at capture, which
``param.data = new`` changes), on the 24-layer bench model
(ModelConfig.bench()), beside the KV-cache pointer check that
``kv_pointer_cost.py`` measures.

    python scripts/weight_pointer_cost.py --device cuda              # the GPU figure (issue 40: at most 5 us)
    python scripts/weight_pointer_cost.py --device cpu --narrow      # the emulator: the same tensor count, tiny widths

Part 1, the check alone, median microseconds of one call on the runner's
held tensors: ``Addresses.moved()`` (the C++ loop the native step runs,
called from Python), ``WeightMemory.check()`` (the Python path's call, with
the native module; then without it, the pure-Python comparison), and, to
subtract, a bare call into the module (``len(addresses)``).

Part 2, the native step's host time per call (call to return, the device
synchronised before each), the runner's addresses held and cleared in turn,
call by call: their difference is what the check adds to the native step.
On the emulator the replay runs the model on the CPU (milliseconds), so
part 2 is skipped there; on a GPU the call is the host's launch work.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from kv_pointer_cost import median_us  # scripts/, on the path when run as a script

import graphmode
from graphmode.bench.workload import Workload
from graphmode.checks.weight_memory import WeightMemory
from graphmode.devices import script_device
from graphmode.model import ModelConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--narrow", action="store_true", help="24 layers of tiny widths (the same tensors, less memory)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000, help="native step calls per arm in part 2")
    args = parser.parse_args()
    device = script_device(__file__, args.device)
    config = ModelConfig.bench()
    if args.narrow:
        config = dataclasses.replace(config, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=256, dtype=torch.float32)
    workload = Workload.build(config, device, max_batches=max(args.batch, 1), block_size=64, context=256,
                              steps=args.steps * 2 + 8)
    runner = graphmode.build_graph_runner(workload.model, max_batches=workload.max_batches,
                                          max_blocks_per_seq=workload.width, block_size=workload.block_size,
                                          device=device, capture_batch_sizes=[args.batch])
    kv = workload.kv_cache
    steps = workload.steps(args.batch, 4)
    with torch.inference_mode():
        for step in steps:  # a capture, a Python replay that teaches the native step, native replays
            runner(step.input_ids, step.position_ids, kv, step.attn_metadata)
    sync(device)
    weights = runner._shared.weights
    addresses = weights.addresses
    if addresses is None:
        raise SystemExit("graphmode.native could not be built here (a C++ compiler?): no native step to measure")
    tensors = weights.tensors
    print(f"bench model, {config.num_hidden_layers} layers{' (narrow)' if args.narrow else ''}, on {device}, "
          f"torch {torch.__version__}: {len(tensors)} parameters and buffers held")

    python_only = WeightMemory()
    python_only._native_decided = True  # no Addresses: the pure-Python comparison
    python_only.hold(workload.model)
    bare = median_us(lambda: len(addresses), args.repeats)
    loop = median_us(addresses.moved, args.repeats)
    check = median_us(weights.check, args.repeats)
    plain = median_us(python_only.check, args.repeats)
    print(f"part 1, medians of {args.repeats} x 100 calls: Addresses.moved() {loop:.2f} us (a bare call into the "
          f"module {bare:.2f} us: the loop {loop - bare:.2f} us), WeightMemory.check() {check:.2f} us with the native "
          f"module, {plain:.2f} us without it (pure Python)")

    if device.type == "cpu":
        print("part 2 skipped on the emulator: its replays run the model on the CPU, milliseconds that drown a "
              "microsecond; run it on a GPU (--device cuda)")
        return
    step = steps[-1]
    attn, memo = step.attn_metadata, runner.family("full").native.memo

    def call() -> None:
        runner(step.input_ids, step.position_ids, kv, attn)

    samples: dict[bool, list[float]] = {True: [], False: []}
    before = memo.replays
    with torch.inference_mode():
        for _ in range(args.steps):
            for held in (True, False):
                if held:
                    addresses.hold(tensors)
                else:
                    addresses.clear()
                sync(device)
                started = time.perf_counter()
                call()
                samples[held].append(time.perf_counter() - started)
    addresses.hold(tensors)
    sync(device)
    native = memo.replays - before
    if native != 2 * args.steps:
        raise SystemExit(f"the native step took {native} of {2 * args.steps} calls: the figures would not be its")
    with_check, without = (statistics.median(samples[held]) * 1e6 for held in (True, False))
    print(f"part 2, the native step at batch {args.batch}, medians of {args.steps} calls each, in turn: "
          f"{with_check:.2f} us with the weights' addresses checked, {without:.2f} us without "
          f"(+{with_check - without:.2f} us per step)")


if __name__ == "__main__":
    main()

"""Host cost of the replay-path host-read guard on the CPU emulator, per step.

Times the runner's replay steps (tiny reference model, built-in and Ascend
vendors) with the guard the runner uses on the CPU and with no guard, and
prints the medians and their difference (a difference that noise made
negative is printed as not measurable, with the steps' spread).

    python scripts/replay_guard_cost.py --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphmode
from graphmode.bench.measure import difference_text, spread
from graphmode.checks.host_reads import NoGuard, replay_guard
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine


def step_times_us(vendor: str, guarded: bool, steps: int, batch: int) -> list[float]:
    config = ModelConfig.tiny()
    model = build_reference_model(config, vendor, "cpu")
    engine = ReferenceEngine(16 * 64 + 1, 16, "cpu", vocab_size=config.vocab_size, table_width=64, seed=7)
    runner = graphmode.build_graph_runner(model, max_batches=16, max_blocks_per_seq=64, block_size=16, device="cpu", vendor=vendor)
    runner.families[0].replay_guard = replay_guard(torch.device("cpu")) if guarded else NoGuard()
    cache = model.make_kv_cache(16 * 64 + 1, 16)
    seqs = [engine.add() for _ in range(batch)]
    samples = []
    with torch.inference_mode():
        prefill = engine.prefill(seqs, [5] * batch)
        runner(prefill.input_ids, prefill.position_ids, cache, prefill.attn_metadata)
        for index in range(steps + 1):
            step = engine.decode(seqs)
            started = time.perf_counter()
            runner(step.input_ids, step.position_ids, cache, step.attn_metadata)
            if index:  # the first decode step captures
                samples.append((time.perf_counter() - started) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for vendor in ("cuda", "ascend"):
        off_times = step_times_us(vendor, False, args.steps, args.batch)
        on_times = step_times_us(vendor, True, args.steps, args.batch)
        off, on = statistics.median(off_times), statistics.median(on_times)
        cost = difference_text(on - off, max(spread(off_times), spread(on_times)))
        print(f"{vendor:7s} median step: no guard {off:8.1f} us, guard {on:8.1f} us, guard cost {cost}")


if __name__ == "__main__":
    main()

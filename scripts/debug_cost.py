"""Per-step cost of debug mode (docs/engines.md, "Debug mode") on the CPU
emulator: the two checks it adds to a graph step, timed alone (median of 200
calls), for a few batch sizes of the tiny reference model.

    python scripts/debug_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from graphmode.checks.debug import StepChecker
from graphmode.context import StepInputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from setups import tiny_setup  # noqa: E402


def median_ms(call: Callable[[], object], repeats: int = 200) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    for batch in (4, 16, 64):
        setup = tiny_setup(max_batches=64, width=8, cache_blocks=64 * 8 + 1, capture_batch_sizes=[batch], debug=True)
        seqs = setup.prefill(batch, [5] * batch)
        with torch.inference_mode():
            step = setup.engine.decode(seqs)
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)  # captures
            step = setup.engine.decode(seqs)
            captured = setup.runner.graph(batch)
            assert captured is not None
            # A checker as the runner keeps one in debug mode, recording the graph as its capture does.
            checker = StepChecker(setup.model, setup.runner.config.block_size)
            checker.record(captured.name, captured.extras)
            inputs = StepInputs(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
            values = median_ms(lambda: checker.check_step(inputs, batch))
            addresses = median_ms(lambda: checker.check_addresses(captured.name, captured.extras))
        # The tensors check_addresses compares: the extras' and the model's parameters and buffers.
        leaves = tree_flatten(captured.extras)[0]
        count = (sum(isinstance(t, torch.Tensor) for t in leaves) + len(list(setup.model.named_parameters()))
                 + len(list(setup.model.named_buffers())))
        print(f"batch {batch:3d}: check_step {values:.3f} ms, check_addresses {addresses:.3f} ms ({count} tensors)")


if __name__ == "__main__":
    main()

"""Host cost per replay of the always-on KV-cache check
(graphmode.checks.cache_checks.CacheMemory.check: the same objects, and
their data pointers), for a cache of --layers (key, value) pairs, beside
the identity check alone, which could not see memory moved under an object.

    python scripts/kv_pointer_cost.py --layers 24 --device cuda
    python scripts/kv_pointer_cost.py --layers 24 --device cpu
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from graphmode.checks.cache_checks import CacheMemory, cache_flattener
from graphmode.devices import script_device


def median_us(function: Callable[[], Any], repeats: int) -> float:
    """Median microseconds of one call, from batches of 100 calls (weight_pointer_cost.py's too)."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(100):
            function()
        samples.append((time.perf_counter() - started) / 100)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    script_device(__file__, args.device)
    cache = [(torch.zeros(4, 16, 2, 8, device=args.device), torch.zeros(4, 16, 2, 8, device=args.device))
             for _ in range(args.layers)]
    flatten = cache_flattener(cache)
    captured = flatten(cache)
    memory = CacheMemory(captured, flatten)
    step_cache = [tuple(pair) for pair in cache]  # an engine's own list of the same tensors

    def identity() -> bool:
        now = flatten(step_cache)
        return len(now) == len(captured) and all(map(operator.is_, now, captured))

    before = median_us(identity, args.repeats)
    now = median_us(lambda: memory.check(step_cache, "bucket 1"), args.repeats)
    print(f"{args.layers} layers ({len(captured)} tensors) on {args.device}, torch {torch.__version__}: "
          f"identity and data-pointer check {now:.2f} us per replay, against the identity check's {before:.2f} us "
          f"(+{now - before:.2f} us), medians of {args.repeats} x 100 calls")


if __name__ == "__main__":
    main()

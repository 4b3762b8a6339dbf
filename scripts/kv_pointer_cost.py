"""Host cost per step of the always-on KV-cache data-pointer check
(graphmode.runner.cache_checks.CacheMemory), beside the identity check it
follows, for a cache of --layers (key, value) pairs.

    python scripts/kv_pointer_cost.py --layers 24 --device cuda
    python scripts/kv_pointer_cost.py --layers 24 --device cpu
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time

import torch

from graphmode.runner.cache_checks import CacheMemory


def median_us(function, repeats: int) -> float:
    """Median microseconds of one call, from batches of 100 calls."""
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
    cache = [(torch.zeros(4, 16, 2, 8, device=args.device), torch.zeros(4, 16, 2, 8, device=args.device))
             for _ in range(args.layers)]
    tensors = [t for pair in cache for t in pair]
    memory = CacheMemory(tensors)
    same = list(tensors)
    identity = median_us(lambda: all(map(operator.is_, same, tensors)), args.repeats)
    pointers = median_us(lambda: memory.check("bucket 1"), args.repeats)
    mutable = median_us(lambda: list(map(torch.Tensor.data_ptr, tensors)) == memory.pointers, args.repeats)
    print(f"{args.layers} layers ({len(tensors)} tensors) on {args.device}, torch {torch.__version__}: "
          f"identity check {identity:.2f} us, data-pointer check {pointers:.2f} us per step "
          f"(with data_ptr() in place of const_data_ptr(): {mutable:.2f} us), medians")


if __name__ == "__main__":
    main()

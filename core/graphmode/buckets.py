"""Batch-size buckets: which sizes get a graph, and which graph a batch uses.

A vendor chooses its capture list; the bucket of a batch is then always the
smallest captured size that holds it. Deriving the bucket from the list keeps
one bucket list per vendor, used everywhere (graph keys, padding, ranks).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = [
    "next_power_of_2",
    "parse_sizes",
    "power_of_two_sizes",
    "smallest_bucket",
    "three_stage_size",
    "three_stage_sizes",
]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def power_of_two_sizes(max_batches: int) -> list[int]:
    """The generic capture list: powers of two up to min(256, max), then
    steps of 256, then max itself."""
    sizes = []
    size = 1
    while size <= min(256, max_batches):
        sizes.append(size)
        size *= 2
    size = 512
    while size <= max_batches:
        sizes.append(size)
        size += 256
    if sizes[-1] != max_batches:
        sizes.append(max_batches)
    return sizes


def three_stage_size(n: int) -> int:
    """Ascend's compatible size: next power of two up to 16, then multiples
    of 16 up to 256, then multiples of 256."""
    if n <= 16:
        return next_power_of_2(n)
    if n <= 256:
        return -(-n // 16) * 16
    return -(-n // 256) * 256


def three_stage_sizes(max_batches: int) -> list[int]:
    """The distinct three-stage sizes of 1..max_batches, capped at and ending
    with max_batches."""
    sizes = sorted({min(three_stage_size(n), max_batches) for n in range(1, max_batches + 1)})
    return sizes


def smallest_bucket(batch_size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= batch_size, or None when none is."""
    index = bisect.bisect_left(capture_sizes, batch_size)
    return capture_sizes[index] if index < len(capture_sizes) else None


def parse_sizes(text: str) -> list[int]:
    """Batch sizes written as on a command line: "1-64,100,200"."""
    sizes: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        sizes.extend(range(int(low), int(high or low) + 1))
    return sizes

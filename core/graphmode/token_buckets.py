"""Token-count buckets of piecewise graphs.

A piecewise graph is keyed by the step's token count alone (its segments hold
no attention, so the batch's shape does not matter): a step of ``n`` tokens
replays the graph of the smallest bucket >= ``n``, its ``bucket - n`` padding
tokens computed and dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from graphmode.errors import ConfigError

__all__ = ["default_token_sizes", "clean_token_sizes", "token_bucket"]

#: vLLM's cap on its default capture list (``min(max_num_seqs * 2, 512)``).
_VLLM_CAP = 512


def default_token_sizes(max_batches: int) -> tuple[int, ...]:
    """vLLM's default capture list (vllm-project/vllm ``vllm/config/vllm.py``,
    ``VllmConfig._set_cudagraph_sizes``): 1, 2, 4, every 8 below 256, every
    16 from 256, up to ``min(2 * max_batches, 512)``; here the maximum itself
    is added when the ladder misses it, so that it is a bucket."""
    largest = min(2 * max_batches, _VLLM_CAP)
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    sizes = [size for size in ladder if size <= largest]
    if sizes[-1] != largest:
        sizes.append(largest)
    return tuple(sizes)


def clean_token_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """The user's token buckets, sorted and unique; each must be >= 1."""
    try:
        values = [int(size) for size in sizes]
    except (TypeError, ValueError):
        raise ConfigError(f"capture_token_sizes={sizes!r}: must be a list of integers") from None
    if not values:
        raise ConfigError(
            "capture_token_sizes is empty: give at least one token count, or None for the default "
            "list, or execute_mode='graph' to capture decode graphs only"
        )
    bad = [value for value in values if value < 1]
    if bad:
        raise ConfigError(f"capture_token_sizes has {bad}; every token bucket must be >= 1")
    return tuple(sorted(set(values)))


def token_bucket(tokens: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``tokens``, or None above the largest."""
    index = bisect.bisect_left(sizes, tokens)
    return sizes[index] if index < len(sizes) else None

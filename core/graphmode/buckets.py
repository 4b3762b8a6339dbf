"""Batch-size buckets: which sizes get a graph, and which graph a batch uses.

A vendor chooses its capture list; the bucket of a batch is then always the
smallest captured size that holds it. Deriving the bucket from the list keeps
one bucket list per vendor, used everywhere (graph keys, padding, ranks).

Padding waste, the measure a list is judged by: a batch of n sequences run in
bucket b computes b rows of which b - n are padding, a waste of (b - n) / b.
The mean waste of a list over 1..max_batches is the mean of that share over
every batch size n = 1..max_batches, each counted once (:func:`padding_waste`).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphmode.errors import ConfigError

if TYPE_CHECKING:
    from graphmode.plugins import Vendor

__all__ = [
    "GRADED_STEPS",
    "FixedSizes",
    "PaddingWaste",
    "bucket_table",
    "capture_list",
    "declared_max_capture_size",
    "graded_sizes",
    "largest_graph",
    "largest_graph_declaration",
    "next_power_of_2",
    "padding_waste",
    "parse_sizes",
    "power_of_two_sizes",
    "smallest_bucket",
    "three_stage_size",
    "three_stage_sizes",
]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# (up to this size, step): every size to 8, every 2nd to 16, every 4th to 64,
# every 8th to 256 (vLLM's step there), every 16th beyond (vLLM's and SGLang's).
GRADED_STEPS: tuple[tuple[int | None, int], ...] = ((8, 1), (16, 2), (64, 4), (256, 8), (None, 16))


def graded_sizes(max_batches: int) -> list[int]:
    """The default capture list: every size up to 8, then every 2 to 16,
    every 4 to 64, every 8 to 256, every 16 beyond; capped at max_batches,
    which is always the last size.

    A step s starts only at sizes >= 4 s, so a batch wastes less than a fifth
    of its bucket (worst: 15%, batch 17 in bucket 20), and the mean padding
    waste over 1..m is at most 4.0% for every m up to 1024 (the peak is at
    m = 36; 3.5% at 64, 2.7% at 256, 2.4% at 512). vLLM's list (1, 2, 4, then
    every 8 to 256) wastes 12.5% at m = 8 and 11.0% at m = 64: too few small
    buckets. The price is captures: 48 buckets up to 256, vLLM 35, powers of
    two 9."""
    if not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"max_batches={max_batches!r}: must be a positive integer")
    sizes: list[int] = []
    size = 0
    for limit, step in GRADED_STEPS:
        while size + step <= min(limit or max_batches, max_batches):
            size += step
            sizes.append(size)
    if sizes[-1] != max_batches:
        sizes.append(max_batches)
    return sizes


def power_of_two_sizes(max_batches: int) -> list[int]:
    """lmdeploy's capture list (graphmode's default until 2026-11): powers of
    two up to min(256, max), then steps of 256, then max itself. Mean padding
    waste 24.1% over 1..256, worst 49.6%."""
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


@dataclass(frozen=True)
class FixedSizes:
    """A capture policy for hardware that captures only the batch sizes of a
    fixed list (``FixedSizes((1, 2, 4, 8, 16, 32))``): at a max_batches, the
    listed sizes up to it. Its last size is the vendor's largest graph
    (``GraphSpec.max_capture_size``): batches above it run eagerly. A
    user's capture list keeps only listed sizes (``GraphSpec.capture_list``)."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes) or (
            list(sizes) != sorted(set(sizes))
        ):
            raise ConfigError(f"FixedSizes({self.sizes!r}): give ascending, unique batch sizes >= 1, e.g. (1, 2, 4, 8)")
        object.__setattr__(self, "sizes", sizes)

    def __call__(self, max_batches: int) -> list[int]:
        return [s for s in self.sizes if s <= max_batches]

    def __repr__(self) -> str:
        """Every size of a short list; a long one's first and last (``graphmode vendors`` prints it)."""
        if len(self.sizes) <= 12:
            return f"FixedSizes({self.sizes!r})"
        head, tail = ", ".join(map(str, self.sizes[:6])), ", ".join(map(str, self.sizes[-3:]))
        return f"FixedSizes(({head}, ..., {tail}): {len(self.sizes)} sizes)"


Policy = Callable[[int], list[int]]


def declared_max_capture_size(policy: Policy, max_capture_size: int | None) -> int | None:
    """A GraphSpec's ``max_capture_size``, checked: an int >= 1 or None;
    for a ``FixedSizes`` policy, its last size unless declared (never above it)."""
    largest = max_capture_size
    if largest is not None and (not isinstance(largest, int) or isinstance(largest, bool) or largest < 1):
        raise ConfigError(f"GraphSpec max_capture_size={largest!r}: use an int >= 1, or None for no limit")
    if isinstance(policy, FixedSizes):
        last = policy.sizes[-1]
        if largest is not None and largest > last:
            raise ConfigError(
                f"GraphSpec max_capture_size={largest}: the fixed capture list {list(policy.sizes)} "
                f"(capture_policy) ends at {last}; leave max_capture_size unset, or declare it <= {last}"
            )
        return last if largest is None else largest
    return largest


def largest_graph_declaration(policy: Policy, max_capture_size: int | None) -> str:
    """The declaration that sets a GraphSpec's largest graph, as messages
    name it: a ``FixedSizes`` list's last size (``max_capture_size`` is then
    derived from it), else ``GraphSpec.max_capture_size``."""
    if isinstance(policy, FixedSizes) and max_capture_size == policy.sizes[-1]:
        return f"the last size of GraphSpec.capture_policy=FixedSizes({policy.sizes})"
    return "GraphSpec.max_capture_size"


def largest_graph(policy: Policy, max_capture_size: int | None, max_batches: int) -> int:
    """The largest graph a runner of ``max_batches`` captures when the
    engine gives no capture list: max_batches, capped at
    ``max_capture_size``, and for ``FixedSizes`` the largest listed size
    within that (0 when none is)."""
    top = max_batches if max_capture_size is None else min(max_batches, max_capture_size)
    if isinstance(policy, FixedSizes):
        return max((s for s in policy.sizes if s <= top), default=0)
    return top


def capture_list(
    policy: Policy, max_capture_size: int | None, max_batches: int, given: Sequence[int] | None = None
) -> list[int]:
    """The capture list of a vendor declaring ``policy`` and
    ``max_capture_size``: the engine's list ``given`` trimmed to the sizes
    the vendor captures (none above ``max_capture_size``; only listed ones
    for ``FixedSizes``), else ``policy`` up to the largest graph. Refuses a
    list that ends up empty, naming the declaration."""
    top = max_batches if max_capture_size is None else min(max_batches, max_capture_size)
    fixed = policy.sizes if isinstance(policy, FixedSizes) else None
    if given is not None:
        sizes = [s for s in given if s <= top and (fixed is None or s in fixed)]
        if not sizes:
            takes = f"only the sizes {list(fixed)}" if fixed else f"batches of at most {top}"
            raise ConfigError(
                f"capture_batch_sizes={list(given)}: the vendor's graphs take {takes} (GraphSpec "
                "capture_policy / max_capture_size), so none of them could be captured; give sizes among "
                "those, or leave capture_batch_sizes unset for the vendor's list"
            )
        return sizes
    if fixed is not None and fixed[0] > top:
        raise ConfigError(
            f"max_batches={max_batches}: the vendor captures only the sizes {list(fixed)} (GraphSpec "
            f"capture_policy), none within it; use max_batches >= {fixed[0]}"
        )
    return list(policy(top))


def smallest_bucket(batch_size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= batch_size, or None when none is."""
    index = bisect.bisect_left(capture_sizes, batch_size)
    return capture_sizes[index] if index < len(capture_sizes) else None


@dataclass(frozen=True)
class PaddingWaste:
    """A capture list's padding over batch sizes 1..max_batches.

    graphs: capture sizes that serve some batch in 1..max_batches.
    mean: mean over n = 1..max_batches of (bucket(n) - n) / bucket(n).
    worst: the largest such share, and worst_batch the n it occurs at.
    """

    max_batches: int
    graphs: int
    mean: float
    worst: float
    worst_batch: int


def padding_waste(
    capture_sizes: Sequence[int],
    max_batches: int,
    bucket_of: Callable[[int], int | None] | None = None,
) -> PaddingWaste:
    """The padding waste of ``capture_sizes`` over batch sizes 1..max_batches.

    bucket_of: the bucket of a batch size; the smallest capture size that
    holds it by default. A batch without a bucket is an error: it would run
    eagerly, and no waste figure describes that."""
    sizes = sorted(capture_sizes)
    shares, used = [], set()
    for batch in range(1, max_batches + 1):
        bucket = bucket_of(batch) if bucket_of is not None else smallest_bucket(batch, sizes)
        if bucket is None or bucket < batch:
            raise ValueError(
                f"batch size {batch} has bucket {bucket} in {sizes}: every batch in 1..{max_batches} "
                "needs a capture size that holds it"
            )
        used.add(bucket)
        shares.append((bucket - batch) / bucket)
    worst = max(shares)
    return PaddingWaste(max_batches, len(used), statistics.mean(shares), worst, shares.index(worst) + 1)


def parse_sizes(text: str) -> list[int]:
    """Batch sizes written as on a command line: "1-64,100,200"."""
    sizes: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        sizes.extend(range(int(low), int(high or low) + 1))
    return sizes


def bucket_table(vendor: Vendor, max_batches: int, capture_sizes: tuple[int, ...]) -> list[int | None]:
    """bucket_of[batch] for every batch size, asked once and checked."""
    table: list[int | None] = [None]
    for batch in range(1, max_batches + 1):
        bucket = vendor.hook.graphmode_compatible_size(batch_size=batch, capture_sizes=capture_sizes)
        fits = bucket is None or (bucket >= batch and bucket in capture_sizes)
        if bucket is None and batch <= capture_sizes[-1]:
            fits = False
        if not fits:
            raise ConfigError(
                f"vendor {vendor.name!r}: graphmode_compatible_size({batch}) returned "
                f"{bucket}; it must be a capture size >= {batch} from "
                f"{list(capture_sizes)} (padding a batch into a smaller graph "
                "would drop sequences)"
            )
        if bucket is not None and bucket < (table[-1] or 0):
            raise ConfigError(
                f"vendor {vendor.name!r}: graphmode_compatible_size({batch}) returned {bucket}, after "
                f"graphmode_compatible_size({batch - 1}) returned {table[-1]}: buckets must not shrink as "
                f"batches grow. {_ROUNDING}"
            )
        table.append(bucket)
    for size in capture_sizes:
        if size <= max_batches and table[size] != size:
            later = [s for s in capture_sizes if s > size]
            skipped = (" (the next capture size: a search that skips a size equal to the batch, bisect_right "
                       "where bisect_left is meant)" if later and table[size] == later[0] else "")
            raise ConfigError(
                f"vendor {vendor.name!r}: graphmode_compatible_size({size}) returned {table[size]}{skipped}, but "
                f"{size} is a capture size of {list(capture_sizes)}: each capture size must be its own bucket, or "
                f"its graph is captured and never replayed. {_ROUNDING}"
            )
    return table


# Monotone, and each capture size its own bucket: the smallest capture size
# that holds the batch is then the only answer, so rounding is declared as sizes.
_ROUNDING = (
    "A vendor whose batches round up differently declares that as its capture sizes "
    "(GraphSpec.capture_policy, FixedSizes) and leaves graphmode_compatible_size to the default, "
    "the smallest capture size that holds the batch"
)

"""The suite's sizes: first the vendor's declarations, then what the user
gives (``graphmode conformance`` flags, pytest options, a ``sizes``
fixture), then the suite's defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.config import RunnerConfig
from graphmode.errors import ConfigError
from graphmode.runner.setup import configure

__all__ = ["DTYPES", "PROBED_Q_LEN", "SIZE_OPTIONS", "Sizes", "accepted_q_len", "bucket_with_smaller_batches", "parse_capture_sizes", "sizes_from_options", "vendor_capture_sizes"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BLOCK_SIZE = 16

# The suite's steps need at least this much room (twelve sequences in one
# step; five sequences growing by three blocks and more).
MIN_MAX_BATCHES = 12
MIN_TABLE_WIDTH = 6
MIN_BLOCK_SIZE = 8


@dataclass(frozen=True)
class Sizes:
    """The model, cache and bucket sizes the suite runs at.

    max_batches: the runner's max_batches (the largest batch the steps use).
    block_size: tokens per KV-cache block; None takes the vendor's first
        declared block size (``GraphSpec.block_sizes``), else 16.
    table_width: the block-table buffer's width (the runner's max_blocks_per_seq);
        each step's own table is as wide as its longest sequence needs,
        so widths vary from step to step.
    steps: decode steps per batch size in the every-batch-size test.
    capture_sizes: a user's capture list (the vendor may trim it); None
        takes the vendor's policy (``GraphSpec.capture_policy``).
    dtype: the reference model's dtype.
    """

    max_batches: int = 48
    block_size: int | None = None
    table_width: int = 8
    steps: int = 3
    capture_sizes: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        def refuse(name: str, value: Any, limit: str) -> None:
            raise ConfigError(f"conformance sizes: {name}={value!r}; {limit}")

        if self.max_batches < MIN_MAX_BATCHES:
            refuse("max_batches", self.max_batches, f"the suite's steps hold up to {MIN_MAX_BATCHES} sequences: use >= {MIN_MAX_BATCHES}")
        if self.table_width < MIN_TABLE_WIDTH:
            refuse("table_width", self.table_width, f"sequences grow by three blocks and more: use >= {MIN_TABLE_WIDTH}")
        if self.block_size is not None and self.block_size < MIN_BLOCK_SIZE:
            refuse("block_size", self.block_size, f"use >= {MIN_BLOCK_SIZE}, or None for the vendor's declared size")
        if self.steps < 1:
            refuse("steps", self.steps, "use >= 1")
        if self.dtype not in DTYPES.values():
            refuse("dtype", self.dtype, f"use one of {', '.join(DTYPES)}")
        if self.capture_sizes is not None:
            sizes = tuple(sorted(set(self.capture_sizes)))
            bad = [s for s in sizes if not 1 <= s <= self.max_batches]
            if not sizes or bad:
                refuse("capture_sizes", self.capture_sizes, f"give sizes within 1..max_batches={self.max_batches}")
            object.__setattr__(self, "capture_sizes", sizes)

    @property
    def cache_blocks(self) -> int:
        return self.max_batches * self.table_width + 1

    def resolved(self, vendor: Any) -> Sizes:
        """These sizes with every size left to the vendor filled in from its
        declarations."""
        if self.block_size is not None:
            return self
        declared = vendor.spec.block_sizes
        return dataclasses.replace(self, block_size=declared[0] if declared else DEFAULT_BLOCK_SIZE)

    @property
    def block(self) -> int:
        """The block size of resolved sizes."""
        if self.block_size is None:
            raise ConfigError("Sizes.block_size is not resolved: call sizes.resolved(vendor) first")
        return self.block_size

    def describe(self, vendor: Any) -> str:
        """One line: each size and where it came from."""
        resolved = self.resolved(vendor)
        declared = vendor.spec.block_sizes
        origin = "given" if self.block_size is not None else ("declared by the vendor" if declared else "suite default")
        largest = vendor.spec.max_capture_size
        graphs = "" if largest is None else f", largest graph {largest} (declared by the vendor)"
        return (
            f"block size {resolved.block} ({origin}), max_batches {self.max_batches}{graphs}, block-table width "
            f"{self.table_width}, model dtype {str(self.dtype).removeprefix('torch.')}"
        )


def parse_capture_sizes(text: str | None) -> tuple[int, ...] | None:
    """A capture list written "1,3,6,12"; None or "" for the vendor's policy."""
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"capture sizes {text!r}: write them as comma-separated integers, e.g. 1,3,6,12") from None


# pytest option -> (Sizes field, parse), as `graphmode conformance` forwards them.
SIZE_OPTIONS: dict[str, tuple[str, Any]] = {
    "--graphmode-block-size": ("block_size", int),
    "--graphmode-max-batches": ("max_batches", int),
    "--graphmode-table-width": ("table_width", int),
    "--graphmode-capture-sizes": ("capture_sizes", parse_capture_sizes),
    "--graphmode-dtype": ("dtype", lambda name: DTYPES[name]),
}


def sizes_from_options(config: Any) -> Sizes:
    """The sizes the pytest options give (each unset one: the default)."""
    given = {}
    for option, (name, parse) in SIZE_OPTIONS.items():
        value = config.getoption(option, default=None)
        if value is not None:
            given[name] = parse(value)
    return Sizes(**given)


def vendor_capture_sizes(
    vendor: Any, sizes: Sizes, max_batches: int | None = None, vendor_options: Any = None,
) -> tuple[int, ...]:
    """The capture list a runner of ``vendor`` takes at ``sizes`` (its
    max_batches, or ``max_batches``) under ``vendor_options``: the user's
    list as the vendor keeps it, or the vendor's policy. Checked as a
    runner checks it."""
    from graphmode.config import RunnerConfig
    from graphmode.runner.setup import capture_sizes, configure

    resolved = sizes.resolved(vendor)
    top = max_batches or resolved.max_batches
    given = resolved.capture_sizes if max_batches is None else None
    config = RunnerConfig(top, resolved.table_width, resolved.block, torch.device("cpu"), capture_batch_sizes=given,
                          vendor_options=dict(vendor_options) if vendor_options is not None else None)
    return capture_sizes(vendor, config, configure(vendor, config))


def bucket_with_smaller_batches(capture_sizes: list[int], wanted: int) -> tuple[int, list[int]]:
    """A bucket of ``capture_sizes`` and up to ``wanted`` smaller batches that
    run in it (largest first): the smallest bucket with ``wanted`` of them,
    else with fewer, else the smallest bucket and none. Tests that shrink a
    batch inside one bucket pick it here, so that they replay one graph on
    any capture policy (powers of two, graded, fixed)."""
    sizes = sorted(capture_sizes)
    below = dict(zip(sizes, [0, *sizes]))
    for room in range(wanted, -1, -1):
        bucket = next((size for size in sizes if size - below[size] > room), None)
        if bucket is not None:
            return bucket, list(range(bucket - 1, bucket - 1 - room, -1))
    raise ConfigError(f"the capture list {capture_sizes} is empty: no graph to replay")


# The most tokens per sequence asked for where nothing declares a limit:
# 32 draft tokens and the bonus token.
PROBED_Q_LEN = 33


def accepted_q_len(vendor: Any, sizes: Sizes, vendor_options: Any) -> tuple[int, str]:
    """The most tokens per sequence a runner of ``vendor`` is accepted with,
    and what sets it: ``GraphSpec.max_q_len``, or the configuration checks
    (``graphmode_check_config``) refusing one more, or the probe's end."""
    declared = vendor.spec.max_q_len
    top = declared if declared is not None else PROBED_Q_LEN
    for q_len in range(top, 0, -1):
        config = RunnerConfig(sizes.max_batches, sizes.table_width, sizes.block, torch.device("cpu"),
                              max_q_len=q_len, vendor_options=dict(vendor_options) if vendor_options else None)
        try:
            configure(vendor, config)
        except ConfigError as refusal:
            last_refusal = str(refusal)
            continue
        if q_len == top:
            origin = (f"GraphSpec.max_q_len={declared}" if declared is not None
                      else f"no limit declared up to {PROBED_Q_LEN} (GraphSpec.max_q_len None)")
        else:
            origin = f"graphmode_check_config refuses max_q_len={q_len + 1}: {_first_sentence(last_refusal)}"
        return q_len, origin
    return 0, "every max_q_len refused"


def _first_sentence(text: str) -> str:
    """The refusal's first sentence (up to its first ';' or '. ')."""
    return text.split("; ")[0].split(". ")[0]

"""Graph memory, planned before the KV cache and measured at warm-up.

An engine sizes its KV cache from the device memory left after its weights;
graphs captured afterwards need memory too (their pool's segments, the
shared output buffers, the piecewise break-point buffers, the driver's graph
objects). :func:`plan` gives that figure before any KV cache exists, by
measuring: it warms the runner up with a small probe cache (a few blocks),
reads what the graphs and their buffers took, then resets the runner, so
that the real ``warmup()`` captures the same graphs again into the real
cache. Why a measurement and not an account per bucket: the pool's size is
the caching allocator's segments, shaped by the order of captures and by
which blocks each capture finds free (docs/engines.md, "Graph memory before
the KV cache"), and the driver's graph objects are outside any allocator;
a capture of every configured graph measures all of it, for every family and
with ``compile=True`` too, at the cost of capturing twice.

The graphs read the cache by address only: no activation, buffer or output
is sized by the number of cache blocks, so a probe of a few blocks takes the
same graph memory as the real cache (``tests/test_graph_memory.py`` checks it
on the emulator; ``scripts/graph_memory.py`` measures it on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmode.errors import ConfigError
from graphmode.memory.meter import MemoryMeter

__all__ = ["GraphMemory", "MemoryPlan", "WarmupMemory", "plan"]

MiB = 2**20


@dataclass(frozen=True)
class GraphMemory:
    """The device memory one ``warmup()`` took.

    bytes: in use after the warm-up minus before it (the pool's segments,
        buffers allocated for the graphs, the driver's graph objects; on the
        CPU emulator, the live storages it allocated).
    families: each family's part, in capture order ("piecewise" first in
        full-and-piecewise mode): what was in use after its captures minus
        before them, so a later family's part is what it added to the pool
        the earlier one left.
    graphs: the graphs it captured. method: how the figures were read."""

    bytes: int
    families: dict[str, int]
    graphs: int
    method: str


@dataclass(frozen=True)
class MemoryPlan:
    """The device memory ``warmup()`` will take, known before the KV cache.

    bytes: what the graphs took in the planning warm-up and gave back at its
        ``reset()``: what the real warm-up will take from the memory free
        after planning. families: the planning warm-up's parts (as in
        :class:`GraphMemory`), which add up to ``bytes + kept``: what each
        family kept is not told apart. kept: what the planning left in use (buffers
        the runner keeps across ``reset()``: the input buffers, the
        piecewise break-point and step-input buffers, host staging's arena;
        and one-time costs of a process's first capture, such as cuBLAS's
        workspace on the capture stream): already out of the free memory an
        engine reads next. warmup: the planning warm-up itself."""

    bytes: int
    families: dict[str, int]
    kept: int
    warmup: GraphMemory
    graphs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "graphs", self.warmup.graphs)

    def compare(self, actual: GraphMemory) -> str:
        """The plan against a warm-up's figure, in words."""
        difference = actual.bytes - self.bytes
        share = f"{100 * difference / self.bytes:+.1f}%" if self.bytes else "n/a"
        parts = ", ".join(f"{name} {part / MiB:.1f} MiB" for name, part in actual.families.items())
        return (
            f"graph memory: planned {self.bytes / MiB:.1f} MiB, warm-up took {actual.bytes / MiB:.1f} MiB "
            f"({difference / MiB:+.1f} MiB, {share}); warm-up by family: {parts}; "
            f"{actual.graphs} graphs planned {self.graphs} ({actual.method})"
        )


class WarmupMemory:
    """What :class:`GraphRunner.warmup` measures: ``with WarmupMemory(device)
    as memory:`` around the warm-up, ``with memory.family(name):`` around each
    family's captures, then :meth:`result`."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.meter = MemoryMeter(device)
        self.enabled = enabled
        self._start = 0
        self._end: int | None = None
        self._families: dict[str, int] = {}

    def __enter__(self) -> WarmupMemory:
        if self.enabled:
            self.meter.__enter__()
            self._start = self.meter.used()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        try:
            if exc[0] is None:
                self._end = self.meter.used()
        finally:
            self.meter.__exit__(*exc)

    @contextlib.contextmanager
    def family(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        before = self.meter.used()
        yield
        self._families[name] = self._families.get(name, 0) + self.meter.used() - before

    def result(self, graphs: int) -> GraphMemory | None:
        """The warm-up's figure, or None when it was not measured."""
        if self._end is None:
            return None
        return GraphMemory(self._end - self._start, dict(self._families), graphs, self.meter.method)


def plan(runner: Any, past_key_values: Any, q_lens: Sequence[int] | None, extras: dict[str, Any]) -> MemoryPlan:
    """Warm ``runner`` up on ``past_key_values`` (a probe cache of a few
    blocks, in the layout of the real one), measure, and reset it: the
    :class:`MemoryPlan` of its ``warmup(q_lens=q_lens, **extras)``."""
    if any(family.captured() for family in runner.families):
        raise ConfigError(
            "plan_memory() on a runner that has captured graphs: the plan is what warmup() takes from "
            "nothing captured. Call plan_memory() before warmup() and the first step, or runner.reset() first"
        )
    if not runner.families:  # execute mode "eager": no graph, no memory
        return MemoryPlan(0, {}, 0, GraphMemory(0, {}, 0, "no graphs (execute mode 'eager')"))
    # The planning warm-up's graphs serve nothing and are dropped: leave them out of the statistics.
    stats = runner.stats
    counts = (stats.captures, stats.warmup_captures, stats.piecewise_captures)
    with MemoryMeter(runner.config.device) as meter:
        before = meter.used()
        runner.warmup(past_key_values, progress=False, q_lens=q_lens, **extras)
        warmed = meter.used()
        runner.reset()
        after = meter.used()
    stats.captures, stats.warmup_captures, stats.piecewise_captures = counts
    warmup = runner.graph_memory
    assert warmup is not None  # a runner measures the warm-ups it plans
    return MemoryPlan(warmed - after, dict(warmup.families), after - before, warmup)

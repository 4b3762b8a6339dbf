"""Graph memory, planned before the KV cache and measured at warm-up.

An engine sizes its KV cache from the device memory left after its weights;
graphs captured afterwards need memory too (their pool's segments, the
shared output buffers, the piecewise break-point buffers, the driver's graph
objects). :func:`plan` gives that figure before any KV cache exists, by
measuring a sample: on a probe cache (a few blocks) each family captures
its largest two graphs and a few more spread over its sizes, the memory
read after each capture, then the runner is reset so that the real
``warmup()`` captures every graph into the real cache. The largest two are
measured whole (the first pays for the pool's segments and the shared
buffers, the second for any segment the pool needs beside what the first
left live); every other graph's part is a straight line in its tokens
fitted through the sampled ones' parts (least squares), summed over the
graphs not sampled. Why a line: what one more graph adds is its driver
objects (a fixed cost per graph, per segment for piecewise graphs) and what
it keeps alive (piecewise graphs keep their segments' outputs for the break
points, in proportion to their tokens); its intermediates reuse the pool
the first graphs made. What the line cannot see: a pool segment that a
graph not sampled would add (the sampled second graph shows the one the
shared logits caused before the full graphs' buffer moved out of the pool,
docs/performance.md). Why a sample and not every graph: capturing every
graph on the probe cost more than the warm-up it predicted (H200, 4.9 s
against 2.9 s in graph mode, 2026-12-01); a sample of six or so per family
costs a fraction (``scripts/graph_memory.py`` prints both, and the plan
against the warm-up).

The graphs read the cache by address only: no activation, buffer or output
is sized by the number of cache blocks, so a probe of a few blocks takes the
same graph memory as the real cache (``tests/test_graph_memory.py`` checks it
on the emulator; ``scripts/graph_memory.py`` measures it on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphmode.context import KVCache
from graphmode.errors import ConfigError
from graphmode.memory.meter import MemoryMeter

if TYPE_CHECKING:
    from graphmode.families.family import GraphFamily, Report
    from graphmode.runner import GraphRunner

__all__ = ["EXACT", "FITTED", "GraphMemory", "MemoryPlan", "Sample", "WarmupMemory", "plan"]

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

    bytes: what the sampled graphs took in the planning warm-up and gave
        back at its ``reset()``, plus the estimate of the graphs not
        sampled: what the real warm-up will take from the memory free after
        planning. families: each family's part, sampled and estimated
        (their parts as in :class:`GraphMemory`), which add up to
        ``bytes + kept``: what each family kept is not told apart. sampled,
        estimated: how many graphs the plan captured, and how many it
        estimated (``graphs`` is both). kept: what the planning left in use (buffers
        the runner keeps across ``reset()``: the input buffers, the
        piecewise break-point and step-input buffers, host staging's arena;
        and one-time costs of a process's first capture, such as cuBLAS's
        workspace on the capture stream): already out of the free memory an
        engine reads next. warmup: the planning warm-up itself (its sampled graphs only)."""

    bytes: int
    families: dict[str, int]
    kept: int
    warmup: GraphMemory
    sampled: int = 0
    estimated: int = 0
    graphs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "graphs", self.sampled + self.estimated)

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


#: Graphs of a family measured whole (the largest ones), and at most how many
#: more are sampled for the fit, spread over the rest of its sizes.
EXACT, FITTED = 2, 4


class Sample:
    """The planning warm-up's captures: per family the graphs :meth:`pick`
    picks, each measured; :meth:`estimate` then adds the rest."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter
        self.families: dict[str, int] = {}  # bytes per family, sampled and estimated
        self.sampled = 0
        self.estimated = 0  # graphs not captured, whose part is the fit's
        self.estimated_bytes = 0

    @staticmethod
    def pick(todo: Sequence[Any]) -> list[Any]:
        """The keys captured of a family's ``todo`` (largest first): the
        first :data:`EXACT`, then up to :data:`FITTED` spread evenly over the
        rest, its last (the smallest) included."""
        head, rest = list(todo[:EXACT]), list(todo[EXACT:])
        if len(rest) <= FITTED:
            return head + rest
        step = (len(rest) - 1) / (FITTED - 1)
        return head + [rest[round(i * step)] for i in range(FITTED)]

    def capture(self, family: GraphFamily, past_key_values: KVCache, extras: dict[str, Any], q_lens: Sequence[int],
                report: Report) -> None:
        """Capture ``family``'s picked graphs one by one, each measured, and
        estimate the graphs left out."""
        todo = family.todo(q_lens)
        picked = self.pick(todo)
        parts: list[tuple[int, int]] = []  # (tokens, bytes) of the fitted graphs
        total = 0
        for index, key in enumerate(picked):
            before = self.meter.used()
            family.warmup(past_key_values, extras, q_lens, report, only=[key])
            part = self.meter.used() - before
            total += part
            if index >= EXACT:
                parts.append((family.tokens(key), part))
        self.sampled += len(picked)
        left = [key for key in todo if key not in picked]
        estimate = sum(max(0, round(_line(parts, family.tokens(key)))) for key in left)
        self.estimated += len(left)
        self.estimated_bytes += estimate
        self.families[family.name] = self.families.get(family.name, 0) + total + estimate


def _line(points: list[tuple[int, int]], x: int) -> float:
    """The least-squares line through ``points`` at ``x`` (their mean for one
    distinct x; 0 for none)."""
    if not points:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((v - mean_x) ** 2 for v in xs)
    if spread == 0:
        return mean_y
    slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(xs, ys)) / spread
    return mean_y + slope * (x - mean_x)


def plan(runner: GraphRunner, past_key_values: KVCache, q_lens: Sequence[int] | None, extras: dict[str, Any]) -> MemoryPlan:
    """Capture a sample of ``runner``'s graphs on ``past_key_values`` (a
    probe cache of a few blocks, in the layout of the real one), measure,
    estimate the rest, and reset it: the :class:`MemoryPlan` of its
    ``warmup(q_lens=q_lens, **extras)``."""
    if any(family.captured() for family in runner.families):
        raise ConfigError(
            "plan_memory() on a runner that has captured graphs: the plan is what warmup() takes from "
            "nothing captured. Call plan_memory() before warmup() and the first step, or runner.reset() first"
        )
    if not runner.families:  # execute mode "eager": no graph, no memory
        return MemoryPlan(0, {}, 0, GraphMemory(0, {}, 0, "no graphs (execute mode 'eager')"))
    # The planning warm-up's graphs serve nothing and are dropped: leave them out of the statistics.
    stats = runner.stats
    counts = {name: (family.captures, family.warmup_captures) for name, family in stats.families.items()}
    with MemoryMeter(runner.config.device) as meter:
        before = meter.used()
        sample = Sample(meter)
        runner._warmup(past_key_values, False, q_lens, extras, sample)
        warmed = meter.used()
        runner.reset()
        after = meter.used()
    for name, family in stats.families.items():
        family.captures, family.warmup_captures = counts.get(name, (0, 0))
    warmup = runner.graph_memory
    assert warmup is not None  # a runner measures the warm-ups it plans
    measured = GraphMemory(warmup.bytes, warmup.families, warmup.graphs,
                           f"{warmup.method}; {sample.sampled} graphs captured, {sample.estimated} estimated")
    return MemoryPlan(warmed - after + sample.estimated_bytes, dict(sample.families), after - before, measured,
                      sampled=sample.sampled, estimated=sample.estimated)

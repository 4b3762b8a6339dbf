"""Where start-up time goes: plan_memory() and warmup(), graph by graph and
phase by phase, with the memory each took.

    python scripts/capture_time.py                                   # bench model, graph and full_and_piecewise, compile off
    python scripts/capture_time.py --modes graph --compile off,on --per-graph
    python scripts/capture_time.py --device cpu --model tiny --max-batches 8   # the CPU emulator (its times say nothing of a GPU)

For each execute mode and compile setting, in one process: a new runner's
``plan_memory(probe)`` (a probe cache of 4 blocks), ``warmup(cache)``, then
``reset()`` and a second ``warmup(cache)`` (what a process that has
captured before pays: after sleep, a reset, a second runner). Each is timed
whole, device-synchronised, and split into phases by wrapping the calls
that make them up (exclusive time: a phase nested in another is not counted
in the outer one):

- ``warm-up forward``: a capture's forward outside the graph (``RunnerContext.warm_up``);
- ``forward in capture``: between ``capture_begin`` and ``capture_end``,
  the forward recorded (for piecewise graphs, one segment's part of it);
- ``capture_begin`` / ``capture_end``: the runtime's (``capture_end``
  instantiates the graph), less what is timed apart below;
- ``synchronize``, ``empty_cache``, ``gc.collect``: every call, anywhere;
- ``cuBLAS workspace``: clearing cuBLAS's workspaces before a CUDA capture;
- ``model state``: the two snapshots of the model's Python state per capture;
- ``memory reads``: the warm-up's and the plan's memory meter (less the
  synchronize, empty_cache and gc.collect inside it);
- ``other``: the rest (input fills, checks, bookkeeping, break points).

Then the allocator: segments the caching allocator mapped (``cudaMalloc``
calls) during each run, and the plan against each warm-up's graph memory
(the issue's bound: within 5% or 32 MiB, whichever is larger).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import graphmode
from graphmode.bench.workload import Workload
from graphmode.devices import usable_device
from graphmode.model import ModelConfig

MiB = 2**20
PHASES = ("warm-up forward", "forward in capture", "capture_begin", "capture_end", "synchronize", "empty_cache",
          "gc.collect", "cuBLAS workspace", "model state", "memory reads", "other")


class Clock:
    """Exclusive time per (graph, phase): a phase entered inside another
    stops the outer one's clock until it returns."""

    def __init__(self) -> None:
        self.seconds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.calls: collections.Counter[str] = collections.Counter()
        self.graph = "outside graphs"
        self._stack: list[list[Any]] = []
        self._patched: list[tuple[Any, str, Any]] = []

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self._charge(self._stack[-1], now)
        self._stack.append([phase, now])
        self.calls[phase] += 1

    def leave(self, phase: str) -> None:
        now = time.perf_counter()
        while self._stack:  # an exception may have skipped a leave: unwind to the phase
            top = self._stack.pop()
            self._charge(top, now)
            if top[0] == phase:
                break
        if self._stack:
            self._stack[-1][1] = now

    def _charge(self, entry: list[Any], now: float) -> None:
        self.seconds[self.graph][entry[0]] += now - entry[1]
        entry[1] = now

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        self.enter(phase)
        try:
            yield
        finally:
            self.leave(phase)

    def wrap(self, owner: Any, name: str, phase: str, after: Callable[[], None] | None = None,
             before: Callable[[], None] | None = None) -> None:
        """Time ``owner.name`` as ``phase``; ``before``/``after`` run around it (outside its time)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            with self.phase(phase):
                result = original(*args, **kwargs)
            if after is not None:
                after()
            return result

        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def label(self, owner: Any, name: str, family: str) -> None:
        """Charge what ``owner.name(self, ..., bucket, ...)`` does to the graph it captures."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def labelled(family_self: Any, past_key_values: Any, extras: Any, bucket: int, *args: Any, **kwargs: Any) -> Any:
            q_len = args[0] if family == "full" and args and isinstance(args[0], int) else 1
            previous, self.graph = self.graph, f"{family} {bucket}" + (f" q{q_len}" if q_len > 1 else "")
            try:
                with self.phase("other"):
                    return original(family_self, past_key_values, extras, bucket, *args, **kwargs)
            finally:
                self.graph = previous

        setattr(owner, name, labelled)
        self._patched.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def totals(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for phases in self.seconds.values():
            total.update(phases)
        return total


def instrument(clock: Clock, device: torch.device) -> None:
    """Wrap every call the phases are made of (see the module's doc)."""
    from graphmode.checks.model_state import ModelState
    from graphmode.emulator import EmulatedGraph
    from graphmode.families.family import RunnerContext
    from graphmode.families.full import FullGraphs
    from graphmode.families.piecewise.graphs import PiecewiseGraphs
    from graphmode.graphs import torch_graph
    from graphmode.memory.meter import MemoryMeter

    clock.label(FullGraphs, "_capture_inert", "full")
    clock.label(PiecewiseGraphs, "_capture_inert", "piecewise")
    clock.wrap(RunnerContext, "warm_up", "warm-up forward")
    for graph_class in (torch_graph.TorchGraph, torch_graph.AcceleratorGraph, EmulatedGraph):
        clock.wrap(graph_class, "capture_begin", "capture_begin", after=lambda: clock.enter("forward in capture"))
        clock.wrap(graph_class, "capture_end", "capture_end", before=lambda: clock.leave("forward in capture"))
    clock.wrap(torch_graph, "drop_blas_workspaces", "cuBLAS workspace")
    clock.wrap(ModelState, "__init__", "model state")
    clock.wrap(ModelState, "check", "model state")
    clock.wrap(MemoryMeter, "used", "memory reads")
    clock.wrap(gc, "collect", "gc.collect")
    if device.type == "cuda":
        clock.wrap(torch.cuda, "synchronize", "synchronize")
        clock.wrap(torch.cuda, "empty_cache", "empty_cache")


def segments_mapped() -> int:
    """cudaMalloc calls of the caching allocator so far (0 off CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(name: str, device: torch.device, call: Callable[[], Any], per_graph: bool) -> dict[str, Any]:
    clock = Clock()
    instrument(clock, device)
    segments = segments_mapped()
    sync(device)
    started = time.perf_counter()
    try:
        with clock.phase("other"):
            call()
        sync(device)
    finally:
        clock.restore()
    seconds = time.perf_counter() - started
    totals = clock.totals()
    graphs = [graph for graph in clock.seconds if graph != "outside graphs"]
    print(f"  {name}: {seconds:.3f} s, {len(graphs)} graphs, {segments_mapped() - segments} segments mapped "
          f"(cudaMalloc)", flush=True)
    shown = [phase for phase in PHASES if totals[phase] > 0]
    print("    " + ", ".join(f"{phase} {totals[phase]:.3f} s ({clock.calls[phase]} calls)" if phase != "other"
                             else f"other {totals[phase]:.3f} s" for phase in shown), flush=True)
    by_family: dict[str, list[str]] = collections.defaultdict(list)
    for graph in graphs:
        by_family[graph.split()[0]].append(graph)
    for family, names in by_family.items():
        each = [sum(clock.seconds[graph].values()) for graph in names]
        first = each[0]
        rest = sorted(each[1:])
        median = rest[len(rest) // 2] if rest else 0.0
        print(f"    {family}: {len(names)} graphs, {sum(each):.3f} s; first ({names[0]}) {first * 1e3:.1f} ms, "
              f"the others' median {median * 1e3:.1f} ms", flush=True)
        if per_graph:
            for graph, total in zip(names, each):
                parts = ", ".join(f"{phase} {clock.seconds[graph][phase] * 1e3:.1f}" for phase in PHASES
                                  if clock.seconds[graph][phase] > 0)
                print(f"      {graph:16s} {total * 1e3:7.1f} ms: {parts}", flush=True)
    return {"seconds": seconds, "phases": dict(totals)}


def one_configuration(workload: Workload, mode: str, compiled: bool, args: argparse.Namespace) -> None:
    device = workload.device
    print(f"\n{mode}, compile {'on' if compiled else 'off'}", flush=True)
    runner = graphmode.build_graph_runner(
        workload.model, execute_mode=mode, compile=compiled, max_batches=workload.max_batches,
        max_blocks_per_seq=workload.width, block_size=workload.block_size, device=device,
    )
    probe = workload.model.make_kv_cache(4, workload.block_size)
    plan = timed_run("plan_memory", device, lambda: runner.plan_memory(probe), args.per_graph)
    first = timed_run("warmup", device, lambda: runner.warmup(workload.kv_cache, progress=False), args.per_graph)
    memory = runner.graph_memory
    runner.reset()
    again = timed_run("warmup again (after reset)", device, lambda: runner.warmup(workload.kv_cache, progress=False),
                      args.per_graph)
    memory_again = runner.graph_memory
    planned = runner.memory_plan
    assert planned is not None
    for label, taken in (("warmup", memory), ("warmup again", memory_again)):
        if taken is None:
            continue
        difference = taken.bytes - planned.bytes
        limit = max(0.05 * planned.bytes, 32 * MiB)
        print(f"  memory: planned {planned.bytes / MiB:.1f} MiB, {label} took {taken.bytes / MiB:.1f} MiB "
              f"({difference / MiB:+.1f} MiB, {'within' if abs(difference) <= limit else 'OUTSIDE'} "
              f"{limit / MiB:.0f} MiB); by family {', '.join(f'{k} {v / MiB:.1f}' for k, v in taken.families.items())}",
              flush=True)
    print(f"  plan / warm-up time: {plan['seconds'] / first['seconds']:.2f} (first), "
          f"{plan['seconds'] / again['seconds']:.2f} (again); the issue's bound: 0.25", flush=True)
    runner.reset()  # its memory back before the next configuration
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="bench (default on a GPU) or tiny (default on the CPU)")
    parser.add_argument("--modes", default="graph,full_and_piecewise")
    parser.add_argument("--compile", default="off", help="off, on, or off,on")
    parser.add_argument("--max-batches", type=int, default=None, help="default 256 on a GPU, 8 on the CPU")
    parser.add_argument("--per-graph", action="store_true", help="every graph's phases, not only the totals")
    args = parser.parse_args()
    device = usable_device(args.device, "scripts/capture_time.py")
    cpu = device.type == "cpu"
    name = args.model or ("tiny" if cpu else "bench")
    config = ModelConfig.bench() if name == "bench" else ModelConfig.tiny()
    workload = Workload.build(config, device, max_batches=args.max_batches or (8 if cpu else 256),
                              block_size=16 if name == "tiny" else 64, context=96 if name == "tiny" else 1024,
                              steps=2)
    what = torch.cuda.get_device_name() if device.type == "cuda" else "CPU emulator"
    print(f"{what}, torch {torch.__version__}, model {name}, max batches {workload.max_batches}", flush=True)
    for mode in args.modes.split(","):
        for setting in args.compile.split(","):
            one_configuration(workload, mode, setting == "on", args)


if __name__ == "__main__":
    main()

"""The host path, in one process: graphmode's host time per call against the
hand-written floor, and an engine loop that schedules ahead against one
that does not, on the host-bound model (``host_bound.py``'s 2-layer model).

    python scripts/host_path.py --batches 1,64,256                 # H100: the issue-24 figures
    python scripts/host_path.py --device cpu --batches 1,8 --steps 20  # the emulator: runs the code, times nothing useful

Part 1, per batch size, median host microseconds of one call (call to
return), with the device idle before each call (synchronised) and busy (a
``torch.cuda._sleep`` of about 1 ms queued before it, so the call's launches
queue behind work, as in a served loop):

- ``replay``: a bare ``graph.replay()`` of the hand-written graph;
- ``hand pinned``: the floor, one packed pinned host-to-device copy and the
  replay (the host packs the step into the pinned buffer first);
- ``graphmode dev``: the runner with device inputs (device-side fill);
- ``graphmode host``: the runner with host inputs (host staging: the same
  packed copy and replay, plus graphmode's checks).

The paths take turns call by call. The graphmode calls are the native step
where it is built (``graphmode.native``); ``GRAPHMODE_NATIVE=0`` times the
Python path instead.

Part 3 (printed after part 1): the Python replay path part by part, timed
in place, idle and busy, and the rest of the call beyond the parts.

Part 2, per batch size, an engine loop of ``--steps`` steps. Each step
samples on the device (argmax of the logits) and the engine reads the
tokens on the host. ``--engine-us`` of host work per step (a busy wait: the
scheduler's stand-in; default: the step's device time, so the loop is
host-bound with host and device time about equal) schedules the next step.

- plain: schedule, call, read the result (the host waits), repeat: a step
  costs host time + device time;
- ahead: call step N, launch its sampling and the copy of its tokens to
  pinned memory, then read step N-1's tokens and schedule step N+1 while
  step N runs: a step should cost max(host time, device time).

Each loop runs ``--loop-repeats`` times, the two loops in turn; the median
run counts, and ``worst`` shows the slowest run of the loop that schedules
ahead.

Two input kinds: ``dev``, the next step's input ids are the tokens sampled
on the device (as vLLM's async scheduling passes them), the rest of the step
on the device; ``host``, host-built steps through host staging (the tokens
given, as in teacher forcing: host staging cannot take device tokens).
Printed: H (the host's work in one iteration, the device idle: the
engine's time, the runner call and the sampling launch, the hand-off of the
sampled tokens to pinned memory with its event, and the read of a finished
step's tokens), Hb (the same with the call and the hand-off launched behind
queued device work, as the loop that schedules ahead launches them), D
(device time of one step's work, measured between events with the device
kept busy, so without launch gaps), the loops' step times, and ahead /
max(H, D) and ahead / max(Hb, D). The tokens of
the two loops are compared at every step (same inputs, same graphs), and
one step's logits against eager.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from host_bound import HOST_BOUND, HandWritten

import graphmode
from graphmode.bench.workload import Workload
from graphmode.devices import script_device
from graphmode.model import ModelConfig
from graphmode.staging import to_host


class Device:
    """Synchronisation, a busy device and device timing: CUDA, or the
    emulator (where "busy" is nothing and device time is wall time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._cycles_per_us = self._calibrate() if self.cuda else 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def busy(self, us: float) -> None:
        """Queue about ``us`` microseconds of device work (CUDA only)."""
        if self.cuda:
            torch.cuda._sleep(int(us * self._cycles_per_us))

    def device_us(self, work: Callable[[], Any]) -> float:
        """Device microseconds of the work ``work`` launches, the device kept
        busy while it is launched (no launch gaps); wall time on the emulator."""
        self.sync()
        if not self.cuda:
            started = time.perf_counter()
            work()
            return (time.perf_counter() - started) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.busy(2000)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def _calibrate(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # warm
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) * 1e3)


def host_us_each(calls: dict[str, Callable[[], Any]], device: Device, repeats: int, busy: bool) -> dict[str, float]:
    """Median host microseconds of each call, the device idle (or busy)
    before each; the calls taken in turn, so that a slow spell of the host
    falls on every path alike rather than on whichever ran then."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            device.sync()
            if busy:
                device.busy(1000)
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    device.sync()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def host_us(call: Callable[[], Any], device: Device, repeats: int, busy: bool) -> float:
    """Median host microseconds of ``call``, the device idle (or busy) before each."""
    return host_us_each({"call": call}, device, repeats, busy)["call"]


def spin(us: float) -> None:
    """``us`` microseconds of host work (the engine's scheduler, stood in)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def per_call(workload: Workload, runners: dict[str, Any], batches: list[int], device: Device, repeats: int) -> None:
    print(f"\nPart 1: host microseconds per call, median of {repeats}; idle: device synchronised before each call, "
          "busy: ~1 ms of device work queued before it")
    print(f"{'batch':>5} {'path':15} {'idle':>8} {'busy':>8} {'idle/hand':>10} {'busy/hand':>10}")
    kv = workload.kv_cache
    for batch in batches:
        step = workload.steps(batch, 2)[0]
        host_step = to_host(step, device.device)
        attn, host_attn = step.attn_metadata, host_step.attn_metadata
        hand = HandWritten(workload.model, step, kv, in_graph=False)
        dev, host = runners["dev"], runners["host"]
        calls = {
            "replay": hand.graph.replay,
            "hand pinned": lambda: hand(host_step),
            "graphmode dev": lambda: dev(step.input_ids, step.position_ids, kv, attn),
            "graphmode host": lambda: host(host_step.input_ids, host_step.position_ids, kv, host_attn),
        }
        for call in calls.values():  # captures, first-use work
            call()
        device.sync()
        results = [hand(host_step).clone(), dev(step.input_ids, step.position_ids, kv, attn).clone(),
                   host(host_step.input_ids, host_step.position_ids, kv, host_attn).clone()]
        device.sync()
        differs = max(float((r.float() - results[0].float()).abs().max()) for r in results)
        idle, busy = host_us_each(calls, device, repeats, False), host_us_each(calls, device, repeats, True)
        rows = {name: (idle[name], busy[name]) for name in calls}
        floor = rows["hand pinned"]
        for name, (idle, busy) in rows.items():
            print(f"{batch:5d} {name:15} {idle:8.1f} {busy:8.1f} {idle / floor[0]:10.2f} {busy / floor[1]:10.2f}")
        print(f"{'':5} outputs of hand pinned and both graphmode paths differ by at most {differs:.3g}")


def in_place(workload: Workload, runners: dict[str, Any], batches: list[int], device: Device, repeats: int) -> None:
    """The runner's Python replay path part by part, timed in place, the
    same calls in the same order as a runner call; what the call costs
    beyond their sum is printed as "rest" (the call's own glue: keyword
    binding, inference mode, the family lookup). The whole call is timed
    with the native step set aside, so that it is the path the parts are
    of: the path a step takes when the native step declines it."""
    from graphmode.checks.cache_checks import check_same_objects
    from graphmode.checks.validate import uniform_q_len
    from graphmode.context import StepInputs

    print(f"\nPart 3: the replay path in place, host microseconds, median of {repeats} "
          "(idle / busy as in part 1)")
    kv = workload.kv_cache
    for batch in batches:
        for kind, runner in runners.items():
            step = workload.steps(batch, 2)[0]
            step = to_host(step, device.device) if kind == "host" else step
            attn = step.attn_metadata
            runner(step.input_ids, step.position_ids, kv, attn)
            family = runner.family("full")
            captured = runner.graph(runner.bucket_of(batch))
            meta, bucket, staging = captured.meta, captured.bucket, family.staging
            for busy in (False, True):
                parts: dict[str, list[float]] = {}
                for _ in range(repeats):
                    device.sync()
                    if busy:
                        device.busy(1000)
                    marks = [("start", time.perf_counter())]
                    inputs = StepInputs(step.input_ids, step.position_ids, kv, attn, {})
                    runner._busy.acquire(blocking=False)
                    marks.append(("lock, inputs", time.perf_counter()))
                    runner._check_inputs(inputs)
                    marks.append(("checks", time.perf_counter()))
                    runner._cache_fit(kv)
                    uniform_q_len(attn, batch, inputs.num_tokens)
                    family.refusal(inputs, batch, 1)
                    marks.append(("cache fit, q_len, family", time.perf_counter()))
                    check_same_objects(captured, inputs)
                    marks.append(("same cache and extras", time.perf_counter()))
                    if staging is not None:
                        staging.begin()
                        marks.append(("next mirror", time.perf_counter()))
                    family._fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
                    marks.append(("fill", time.perf_counter()))
                    if staging is not None:
                        staging.launch(bucket)
                        marks.append(("packed copy + event", time.perf_counter()))
                    captured.graph.replay()
                    marks.append(("replay", time.perf_counter()))
                    family.result(captured, batch)
                    runner._busy.release()
                    marks.append(("outputs, unlock", time.perf_counter()))
                    for (_, then), (name, now) in zip(marks, marks[1:]):
                        parts.setdefault(name, []).append(now - then)
                medians = {name: statistics.median(values) * 1e6 for name, values in parts.items()}
                native, family.native_step = family.native_step, None
                try:
                    whole = host_us(lambda: runner(step.input_ids, step.position_ids, kv, attn), device, repeats, busy)
                finally:
                    family.native_step = native
                listed = ", ".join(f"{name} {value:.1f}" for name, value in medians.items())
                print(f"{batch:5d} {kind:4} {'busy' if busy else 'idle'}: call {whole:.1f} = {listed}, "
                      f"rest {whole - sum(medians.values()):.1f}")


class Loop:
    """One input kind's engine loop: the runner, its steps, how a step's
    input ids come from the previous step's sampled tokens."""

    def __init__(self, kind: str, runner: Any, workload: Workload, batch: int, count: int, device: Device) -> None:
        self.kind, self.runner, self.device = kind, runner, device
        steps = workload.steps(batch, count + 1)
        self.steps = [to_host(s, device.device) for s in steps] if kind == "host" else steps
        self.kv = workload.kv_cache
        pin = device.cuda
        self.pinned = [torch.zeros(batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if device.cuda else None for _ in range(2)]

    def call(self, index: int, sampled: torch.Tensor | None) -> torch.Tensor:
        """Step ``index``: the runner call and the sampling (launched)."""
        step = self.steps[index]
        ids = sampled[None] if (self.kind == "dev" and sampled is not None) else step.input_ids
        logits = self.runner(ids, step.position_ids, self.kv, step.attn_metadata)
        return logits[0].argmax(-1)

    def plain(self, count: int, engine_us: float) -> tuple[float, list[list[int]]]:
        tokens: list[list[int]] = []
        sampled = None
        self.device.sync()
        started = time.perf_counter()
        for index in range(count):
            spin(engine_us)  # schedule this step
            sampled = self.call(index, sampled)
            tokens.append(sampled.tolist())  # read the result: the host waits for the step
        return (time.perf_counter() - started) / count * 1e6, tokens

    def ahead(self, count: int, engine_us: float) -> tuple[float, list[list[int]]]:
        tokens: list[list[int]] = []
        sampled = None
        self.device.sync()
        started = time.perf_counter()
        spin(engine_us)  # schedule the first step
        for index in range(count):
            sampled = self.call(index, sampled)
            slot = index % 2
            self.hand_off(slot, sampled)
            if index:
                tokens.append(self._read(1 - slot))  # the previous step's tokens, done by now or soon
            spin(engine_us)  # schedule the next step while this one runs
        tokens.append(self._read((count - 1) % 2))
        return (time.perf_counter() - started) / count * 1e6, tokens

    def hand_off(self, slot: int, sampled: torch.Tensor) -> None:
        """The sampled tokens copied to pinned memory on the device, before
        the next call, and the event the host will wait on to read them."""
        self.pinned[slot].copy_(sampled, non_blocking=True)
        event = self.events[slot]
        if event is not None:
            event.record()

    def _read(self, slot: int) -> list[int]:
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        return self.pinned[slot].tolist()


def loops(workload: Workload, runners: dict[str, Any], batches: list[int], device: Device, count: int,
          engine_us: float | None, repeats: int, loop_repeats: int) -> None:
    print(f"\nPart 2: engine loops of {count} steps, microseconds per step, median of {loop_repeats} runs of each "
          "loop; H: host time of one iteration (device idle), Hb: the same behind queued device work, D: device time "
          "of one step; max: max(H, D); worst: the slowest ahead run / max")
    print(f"{'batch':>5} {'inputs':6} {'engine':>7} {'H':>8} {'Hb':>8} {'D':>8} {'H+D':>8} {'max':>8} {'plain':>8} "
          f"{'ahead':>8} {'ahead/max':>10} {'/max(Hb,D)':>11} {'worst':>6} {'same tokens':>12}")
    for batch in batches:
        for kind in ("dev", "host"):
            loop = Loop(kind, runners[kind], workload, batch, count, device)
            for index in range(3):  # captures, first-use work
                loop.call(index, None)
            device.sync()
            step_device = statistics.median(device.device_us(lambda: loop.call(1, None)) for _ in range(repeats))
            engine = step_device if engine_us is None else engine_us
            # H: the host's work in one iteration of the loop that schedules ahead,
            # the device idle: the engine's part, the call and the sampling launch,
            # the hand-off (the copy to pinned memory and its event), and the read
            # of a step already done (in the loop, the previous one).
            sampled = loop.call(1, None)

            def work(busy: bool) -> float:
                return (host_us(lambda: loop.call(1, None), device, repeats, busy)
                        + host_us(lambda: loop.hand_off(0, sampled), device, repeats, busy)
                        + host_us(lambda: loop._read(0), device, repeats, False))

            # Hb: the same work launched behind queued device work, as the loop
            # that schedules ahead launches it (a launch then costs the host more).
            host, host_busy = engine + work(False), engine + work(True)
            # Each loop runs loop_repeats times in turn, and the median counts: a
            # single run is one figure, and one pause of the host in its 200 steps
            # moved it by up to half on the H100 (2026-11-26, one row per run).
            plains, aheads, same = [], [], True
            for _ in range(loop_repeats):
                plain, plain_tokens = loop.plain(count, engine)
                ahead, ahead_tokens = loop.ahead(count, engine)
                plains.append(plain)
                aheads.append(ahead)
                same = same and plain_tokens == ahead_tokens
            plain, ahead = statistics.median(plains), statistics.median(aheads)
            top, top_busy = max(host, step_device), max(host_busy, step_device)
            print(f"{batch:5d} {kind:6} {engine:7.1f} {host:8.1f} {host_busy:8.1f} {step_device:8.1f} "
                  f"{host + step_device:8.1f} {top:8.1f} {plain:8.1f} {ahead:8.1f} {ahead / top:10.2f} "
                  f"{ahead / top_busy:11.2f} {max(aheads) / top:6.2f} {str(same):>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=200, help="calls per host-time median")
    parser.add_argument("--steps", type=int, default=200, help="steps per engine loop")
    parser.add_argument("--loop-repeats", type=int, default=5, help="runs of each engine loop (the median counts)")
    parser.add_argument("--engine-us", type=float, default=None,
                        help="host work per step in the loops (default: the step's device time)")
    parser.add_argument("--model", choices=("host-bound", "bench"), default="host-bound")
    args = parser.parse_args()
    device = Device(script_device(__file__, args.device))
    batches = [int(b) for b in args.batches.split(",")]
    config = HOST_BOUND if args.model == "host-bound" else ModelConfig.bench()
    workload = Workload.build(config, device.device, max_batches=max(batches), steps=args.steps + 8)

    def runner(host_staging: bool) -> graphmode.GraphRunner:
        return graphmode.build_graph_runner(workload.model, max_batches=workload.max_batches,
                                            max_blocks_per_seq=workload.width, block_size=workload.block_size,
                                            device=device.device, capture_batch_sizes=batches, host_staging=host_staging)

    name = torch.cuda.get_device_name(device.device) if device.cuda else "CPU emulator"
    print(f"{name}, torch {torch.__version__}; {args.model} model; graphmode {graphmode.__version__}")
    with torch.inference_mode():
        runners = {"dev": runner(False), "host": runner(True)}
        per_call(workload, runners, batches, device, args.repeats)
        in_place(workload, runners, batches, device, args.repeats)
        loops(workload, runners, batches, device, args.steps, args.engine_us, max(10, args.repeats // 10),
              args.loop_repeats)
        # Graph against eager, one step of each kind at the largest batch.
        step = workload.steps(batches[-1], 2)[1]
        eager = workload.model(step.input_ids, step.position_ids, workload.kv_cache, step.attn_metadata).float()
        for kind, placed in (("dev", step), ("host", to_host(step, device.device))):
            graph = runners[kind](placed.input_ids, placed.position_ids, workload.kv_cache, placed.attn_metadata)
            print(f"graph ({kind}) against eager at batch {batches[-1]}: max difference "
                  f"{float((graph.float() - eager).abs().max()):.3g}")


if __name__ == "__main__":
    main()

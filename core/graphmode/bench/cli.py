"""``graphmode bench``: measure one decode step every way, side by side.

Per batch size and mode: the median wall time of a decode step, each step
with new inputs, the device synchronised before and after (warm-up, capture
and compilation excluded). Every mode is built once and keeps its graphs for
the whole run; at each batch size the modes take turns, five runs of the
timed steps each. Also: graphmode's host-side cost per step, the time
and device memory to capture every bucket, start-up per execute mode
(``graphmode.bench.startup``: plan, warm-up, first step, wake, graph memory
by family), compile times, and each vendor's padding waste.
Prints a table, and writes a JSON file and a plot when asked.
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
import time
from typing import Any

import torch

import graphmode
from graphmode.bench.common import CPU_BATCHES, DEFAULT_BATCHES, MODES, chosen_modes, taking_turns
from graphmode.bench.floor import bandwidth, step_bytes
from graphmode.bench.measure import machine, release, spread
from graphmode.bench.modes import Compiled, Eager, GraphmodeOverCompiled, GraphmodeRunner, HandWrittenGraph, _sync
from graphmode.bench.offload import run_offload
from graphmode.bench.packed import HandPacked
from graphmode.bench.prefill import run_prefill
from graphmode.bench.report import WASTE_UP_TO, plot, print_table
from graphmode.bench.startup import measure_startup, startup_modes
from graphmode.bench.tp import run_tp
from graphmode.bench.workload import Workload
from graphmode.buckets import padding_waste, parse_sizes
from graphmode.devices import usable_device
from graphmode.families.full import FullGraphs
from graphmode.model import ModelConfig
from graphmode.native import native_module
from graphmode.plugins import installed_vendor_names, load_vendor
from graphmode.runner.setup import default_capture_sizes
from graphmode.staging import to_host

# The timed steps of a batch size come in this many runs, the modes taking
# turns (bench.common.taking_turns): no mode is timed minutes after another.
ROUNDS = 5
# Calls of each path that a host-cost median takes (scripts/host_path.py's default).
HOST_CALLS = 200


def host_cost(runner: graphmode.GraphRunner, steps: list, workload: Workload) -> dict[str, Any]:
    """graphmode's host work per step (checks, fill, replay, output view),
    as ``scripts/host_path.py`` times it: host microseconds of one call, the
    device synchronised before each, the paths in turns call by call (a slow
    spell of the host falls on all alike): the runner call (its native step
    where built), the bare ``graph.replay()`` of its graph, and the
    hand-packed floor (:class:`~graphmode.bench.packed.HandPacked`: the step
    written into one pinned buffer, one copy, the replay) fed the same steps
    as host tensors, :data:`HOST_CALLS` calls each, cycling through ``steps``
    (each step new tensors, as an engine passes them).
    ``native``: how many of the timed calls the native step took (the rest
    took the Python path)."""
    batch = steps[0].attn_metadata.batch_size
    bucket = runner.bucket_of(batch)
    captured = runner.graph(bucket) if bucket is not None else None
    if captured is None:
        raise ValueError(f"batch {batch} has no captured graph to time (bucket {bucket})")
    device = workload.device
    graph = captured.graph
    floor = HandPacked(workload.model, steps[0], workload.kv_cache, in_graph=False)
    host_steps = [to_host(step, device) for step in steps]
    full = next((family for family in runner.families if isinstance(family, FullGraphs)), None)

    def native_replays() -> int:
        return full.native.replays if full is not None and full.native is not None else 0

    calls, launches, floors = [], [], []
    before = native_replays()
    # HOST_CALLS calls of each path, the steps taken in turn: with the bench's 30 steps alone a
    # slow spell of the host moved the ratio from 1.0 to 1.6 between neighbouring batch sizes
    # (an H200, 2026-12-03), where host_path.py's 200 calls gave 1.08 to 1.23.
    turns = [(steps[i % len(steps)], host_steps[i % len(steps)]) for i in range(max(HOST_CALLS, len(steps)))]
    for step, host_step in turns:
        _sync(device)
        started = time.perf_counter()
        runner(step.input_ids, step.position_ids, step.past_key_values, step.attn_metadata)
        calls.append(time.perf_counter() - started)
        _sync(device)
        started = time.perf_counter()
        graph.replay()
        launches.append(time.perf_counter() - started)
        _sync(device)
        started = time.perf_counter()
        floor(host_step)
        floors.append(time.perf_counter() - started)
    _sync(device)
    native = native_replays() - before
    call, launch, hand = statistics.median(calls), statistics.median(launches), statistics.median(floors)
    return {"runner_call_us": call * 1e6, "graph_launch_us": launch * 1e6, "host_cost_us": (call - launch) * 1e6,
            "floor_us": hand * 1e6, "floor_ratio": call / hand, "native_calls": native, "calls": len(turns),
            "noise_us": max(spread(calls), spread(launches)) * 1e6}


def capture_cost(workload: Workload, buckets: list[int] | None) -> dict[str, float]:
    """Seconds and device memory to capture ``buckets`` (all when None)."""
    runner = graphmode.build_graph_runner(
        workload.model, max_batches=workload.max_batches, max_blocks_per_seq=workload.width,
        block_size=workload.block_size, device=workload.device, capture_batch_sizes=buckets,
    )
    runner.graph_meta()
    cuda = workload.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(workload.device)
    started = time.perf_counter()
    runner.warmup(workload.kv_cache, progress=False)
    _sync(workload.device)
    seconds = time.perf_counter() - started
    if cuda:
        torch.cuda.empty_cache()  # keep what the graphs hold, drop the warm-up forwards' cache
    memory = (torch.cuda.memory_reserved(workload.device) - before) if cuda else 0
    result = {"buckets": len(runner.capture_sizes), "seconds": seconds, "graph_memory_bytes": memory}
    runner.reset()
    return result


def vendor_padding_waste(names: list[str], max_batches: int) -> dict[str, dict[str, Any]]:
    """The padding waste of each named vendor's default capture list over
    batch sizes 1..max_batches (see graphmode.buckets.padding_waste). A
    vendor whose largest graph is below max_batches (a fixed capture list,
    a declared ``max_capture_size``) runs the batches above it eagerly:
    those are counted as eager, and the waste is over the batches its
    graphs hold (1..graphed). A vendor whose list cannot be taken is
    reported as failed, not fatal: the timings are already measured."""
    waste: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            vendor = load_vendor(name)
            sizes = default_capture_sizes(vendor, max_batches)
            graphed = min(max(sizes), max_batches)

            def bucket_of(batch: int, hook: Any = vendor.hook, sizes: tuple[int, ...] = sizes) -> int | None:
                return hook.graphmode_compatible_size(batch_size=batch, capture_sizes=sizes)

            result = padding_waste(sizes, graphed, bucket_of)
        except Exception as error:  # reported in the summary and the JSON
            waste[name] = {"failed": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
            continue
        waste[name] = {"graphs": result.graphs, "mean": result.mean, "worst": result.worst,
                       "graphed": graphed, "eager": max_batches - graphed}
    return waste


def bench_device(text: str) -> torch.device:
    """``--device`` as a torch device, or a stop naming what is missing:
    torch cannot make that device, or has none of its kind here."""
    return usable_device(text, "graphmode bench", hint=(
        "the bench times a real device: run it where one is visible, or pass --device cpu for the CPU graph "
        "emulator (the tiny model; its times say nothing about a GPU)"))


def bench_vendors(requested: str | None, model: Any, device: torch.device) -> tuple[list[str], list[str]]:
    """The vendors ``graphmode[...]`` columns time, and a line per installed
    vendor left out and why. Every vendor runs the one bench model, so only
    vendors whose attention ops follow the model's contract (and whose graphs
    run on ``device``) can be timed. Without ``--vendors`` the others are
    left out with their reason; a vendor named in ``--vendors`` that cannot
    run stops the command with the reason."""
    contract = getattr(model.ops, "contract", None)
    installed = installed_vendor_names()
    names = [name for name in (requested or "").split(",") if name] or installed
    for name in names:
        if name not in installed:
            close = difflib.get_close_matches(name, installed, n=1)
            raise SystemExit(f"graphmode bench: --vendors {name}: no vendor of that name is installed"
                             f"{f'; did you mean {close[0]}?' if close else ''} (installed: {', '.join(installed)}; "
                             "`graphmode vendors` lists them)")
    timed, skipped = [], []
    for name in names:
        try:
            vendor = load_vendor(name)
            usable, why = vendor.info.runs_on(device)
            wanted = getattr(vendor.attention_ops(), "contract", None)
        except Exception as error:  # a broken plugin is reported, not fatal
            usable, why = False, f"cannot load: {error}".splitlines()[0]
        else:
            if usable and wanted != contract:
                usable, why = False, (f"its attention ops follow the {wanted!r} contract, the bench model's "
                                      f"({type(model.ops).__name__}) the {contract!r} one")
        if usable:
            timed.append(name)
        elif requested:
            raise SystemExit(f"graphmode bench: --vendors {name}: it cannot time the bench model on {device}: "
                             f"{why}. Leave it out of --vendors, or leave --vendors out to time every vendor "
                             "that can")
        else:
            skipped.append(f"{name}: {why}")
    return timed, skipped


# The decode modes that run on CUDA only, and why.
CUDA_MODES = {
    "hand": "a hand-written CUDA graph", "hand-exact": "a hand-written CUDA graph",
    "compile": "torch.compile's CUDA graphs", "graphmode-compile": "graphmode over torch.compile's kernels",
}
COMPILE_MODES = ("compile", "graphmode-compile")
def untimed_modes(wanted: list[str], device: torch.device, no_compile: bool) -> list[str]:
    """A line per wanted decode mode that this run leaves out, and why."""
    lines = []
    if device.type != "cuda":
        off = [mode for mode in wanted if mode in CUDA_MODES]
        if off:
            why = "; ".join(f"{mode}: {CUDA_MODES[mode]}" for mode in off)
            lines.append(f"{', '.join(off)}: CUDA only, not on {device.type} ({why}); pass --device cuda on a GPU")
    elif no_compile:
        off = [mode for mode in wanted if mode in COMPILE_MODES]
        if off:
            lines.append(f"{', '.join(off)}: --no-compile")
    return lines


def native_ready() -> str:
    """The native step loaded, and built first where this torch has none yet
    (half a minute), before anything is timed: else the first runner's
    first replay step pays for the build (11 s for batch 1 with --warmup 1)."""
    started = time.perf_counter()
    if native_module() is None:
        return "off (GRAPHMODE_NATIVE=0, or it cannot be built here): every step takes the Python path"
    return f"loaded in {time.perf_counter() - started:.1f} s, before any timing"


def run(args: argparse.Namespace) -> int:
    bench_device(args.device)
    print(f"native step: {native_ready()}", flush=True)
    if args.tp > 1:
        if args.workload != "decode":
            raise SystemExit(f"graphmode bench: --tp {args.tp} measures the decode workload only, not "
                             f"--workload {args.workload}; drop one of the two")
        return run_tp(args)
    if args.workload == "prefill":
        return run_prefill(args)
    if args.workload == "offload":
        return run_offload(args)
    device = torch.device(args.device)
    config_name = args.config or ("bench" if device.type == "cuda" else "tiny")
    config = ModelConfig.bench() if config_name == "bench" else ModelConfig.tiny()
    batches = parse_sizes(args.batches or (DEFAULT_BATCHES if device.type == "cuda" else CPU_BATCHES))
    total = args.warmup + args.steps
    wanted = chosen_modes(args.modes, MODES, "decode")
    workload = Workload.build(config, device, max_batches=max(256 if device.type == "cuda" else 8, *batches),
                              block_size=64 if config_name == "bench" else 16,
                              context=1024 if config_name == "bench" else 96, steps=total,
                              attention=args.attention)
    attention = type(workload.model.ops).__name__
    bw, copy = bandwidth(device, args.hbm_tbps)
    results: dict[str, Any] = {
        "machine": machine(device), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
        "model": config_name, "batches": batches, "attention": attention, "latency_ms": {}, "prepare_s": {},
        "host": {}, "floor": None, "compile_s": {},
    }
    print(f"graphmode bench on {results['machine']['device']}, torch {torch.__version__}, model {config_name} "
          f"({config.num_hidden_layers} layers, {str(config.dtype).replace('torch.', '')}), attention {attention}",
          flush=True)
    if bw is not None:
        results["floor"] = {"bandwidth_Bps": bw.bytes_per_s, "source": bw.source, "measured_copy_Bps": copy, "ms": {}}
        copied = f"; a device copy measured {copy / 1e12:.2f} TB/s" if copy else ""
        print(f"HBM floor at {bw.bytes_per_s / 1e12:.2f} TB/s ({bw.source}){copied}", flush=True)
        for batch in batches:
            timed = workload.steps(batch, total)[args.warmup:]
            floor = statistics.mean(step_bytes(workload.model, step) for step in timed) / bw.bytes_per_s
            results["floor"]["ms"][batch] = floor * 1e3

    if device.type == "cuda":
        # The process's first capture also pays first-use work (Triton compiling or loading its
        # kernels, cuBLAS's workspace): timed apart from a second, which is what a new runner costs.
        first = capture_cost(workload, None)
        results["capture"] = {"first_in_process": first, "all_buckets": capture_cost(workload, None),
                              "largest_alone": capture_cost(workload, [workload.max_batches])}
    # After the capture figures: the first mode here is not the process's first capture on a device.
    results["startup_batch"] = batches[0]
    results["startup"] = measure_startup(workload, startup_modes(args.startup_modes, device), batches[0])

    modes: list[Any] = [Eager(workload.model)] if "eager" in wanted else []
    vendors: list[str] = []
    if "graphmode" in wanted:
        vendors, skipped = bench_vendors(args.vendors, workload.model, device)
        for line in skipped:
            print(f"not timed: {line}", flush=True)
        modes += [GraphmodeRunner(workload.model, workload, v) for v in vendors]
    for line in untimed_modes(wanted, device, args.no_compile):
        print(f"not timed: {line}", flush=True)
    if device.type == "cuda":
        if "hand" in wanted:
            modes.append(HandWrittenGraph(workload.model, workload))
        if "hand-exact" in wanted:
            modes.append(HandWrittenGraph(workload.model, workload, exact=True))
        if not args.no_compile:
            if "compile" in wanted:
                modes.append(Compiled(workload.model, workload))
            if "graphmode-compile" in wanted:
                modes.append(GraphmodeOverCompiled(workload.model, workload, "cuda"))
    first_runner = next((m for m in modes if type(m) is GraphmodeRunner), None)
    for mode in modes:
        results["latency_ms"][mode.name] = {}
        results["prepare_s"][mode.name] = {}
    for batch in batches:
        steps = workload.steps(batch, total)
        ready = []
        for mode in modes:
            try:
                prepare = mode.prepare(batch)
                if isinstance(mode, Compiled):
                    prepare += mode.compile_for(steps[: args.warmup])
                    results["compile_s"][mode.name] = results["compile_s"].get(mode.name, 0.0) + prepare
                else:
                    for step in steps[: args.warmup]:
                        mode(step)
            except Exception as error:  # a mode that cannot run a size is reported, not fatal
                results["latency_ms"][mode.name][batch] = None
                results["prepare_s"][mode.name][batch] = f"failed: {type(error).__name__}: {error}".splitlines()[0][:300]
                print(f"{mode.name} batch {batch}: {results['prepare_s'][mode.name][batch]}", flush=True)
                continue
            results["prepare_s"][mode.name][batch] = prepare
            ready.append(mode)
        times, errors = taking_turns(ready, steps[args.warmup:], device, ROUNDS)
        for mode in ready:
            if mode in errors:
                results["latency_ms"][mode.name][batch] = None
                results["prepare_s"][mode.name][batch] = errors[mode]
                print(f"{mode.name} batch {batch}: {errors[mode]}", flush=True)
                continue
            latency = statistics.median(times[mode])
            results["latency_ms"][mode.name][batch] = latency * 1e3
            against = f" ({latency * 1e3 / results['floor']['ms'][batch]:.1f}x the HBM floor)" if results["floor"] else ""
            print(f"{mode.name:36s} batch {batch:4d}: {latency * 1e3:8.3f} ms{against}", flush=True)
        if first_runner is not None and first_runner in ready:
            results["host"][batch] = host_cost(first_runner.runner, steps[args.warmup:], workload)
    for mode in modes:
        if isinstance(mode, GraphmodeOverCompiled):
            results["compile_s"][mode.name] = mode.runner.stats.compile_seconds
        if mode.name in results["compile_s"]:
            print(f"{mode.name}: compile {results['compile_s'][mode.name]:.1f} s", flush=True)
    del modes, first_runner
    release(device)
    results["padding_waste"] = vendor_padding_waste(vendors, WASTE_UP_TO)
    if args.json:  # before the table: a summary that fails to print loses no measurement
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1, default=str)
    print_table(results)
    if args.plot:
        plot(results, args.plot)
    return 0

"""What a server spends on graphs before its first token, per execute mode,
as ``graphmode bench`` measures and prints it (its start-up table).

For each execute mode a new runner on the bench workload's model:
``plan_memory`` on a probe cache of four blocks (the plan's own warm-up and
reset), ``warmup()`` into the workload's cache, the first decode step after
it (the first replay, its one-time decisions included), then ``sleep()`` and
``wake()`` (what capturing every graph again costs, ``wake``; and whether the
memory came back, on a device that reports it). Graph memory is what
``runner.graph_memory`` measured per family (the driver's free memory on a
GPU, the emulator's allocation record on the CPU). Each timing synchronises
the device before and after. Modes run in the order given, in one process:
the first pays the process's first-use work (kernels loaded, cuBLAS's
workspace), so the bench's capture figures run before it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import graphmode
from graphmode.bench.measure import release
from graphmode.bench.workload import Workload
from graphmode.memory.meter import device_module

__all__ = ["STARTUP_MODES", "measure_startup", "print_startup", "startup_modes"]

STARTUP_MODES = ("graph", "piecewise", "full_and_piecewise")
MiB = 2**20


def startup_modes(text: str | None, device: torch.device) -> list[str]:
    """``--startup-modes`` as a list: every mode by default on a device, only
    "graph" on the CPU (the emulator's captures take seconds each), none for "none"."""
    if text is None:
        return list(STARTUP_MODES) if device.type != "cpu" else ["graph"]
    if text == "none":
        return []
    modes = [mode for mode in text.split(",") if mode]
    unknown = [mode for mode in modes if mode not in STARTUP_MODES]
    if unknown or not modes:
        raise SystemExit(f"graphmode bench: --startup-modes {text!r}: {unknown or 'nothing'} is not an execute mode "
                         f"with graphs; pass some of {','.join(STARTUP_MODES)}, or none")
    return modes


def _timed(device: torch.device, call: Any) -> float:
    """Seconds ``call()`` took, the device synchronised before and after."""
    module = device_module(device)
    if module is not None:
        module.synchronize(device)
    started = time.perf_counter()
    call()
    if module is not None:
        module.synchronize(device)
    return time.perf_counter() - started


def _free(device: torch.device) -> int | None:
    """The driver's free bytes after ``empty_cache()``, or None off a device that reports it."""
    module = device_module(device)
    if module is None:
        return None
    module.synchronize(device)
    module.empty_cache()
    return int(module.mem_get_info(device)[0])


def measure_startup(workload: Workload, modes: Sequence[str], batch: int) -> dict[str, dict[str, Any]]:
    """Each execute mode's start-up figures (seconds, bytes), the first step at ``batch``."""
    step = workload.steps(batch, 1, seed=7)[0]
    results = {}
    for mode in modes:
        results[mode] = _one_mode(workload, mode, step)
        release(workload.device)  # the runner is gone: its memory back before the next mode
    return results


def _one_mode(workload: Workload, mode: str, step: Any) -> dict[str, Any]:
    device = workload.device
    runner = graphmode.build_graph_runner(
        workload.model, execute_mode=mode, max_batches=workload.max_batches,
        max_blocks_per_seq=workload.width, block_size=workload.block_size, device=device,
    )
    probe = workload.model.make_kv_cache(4, workload.block_size)
    free_before = _free(device)
    plan_s = _timed(device, lambda: runner.plan_memory(probe))
    warmup_s = _timed(device, lambda: runner.warmup(workload.kv_cache, progress=False))
    with torch.inference_mode():
        first_s = _timed(device, lambda: runner(step.input_ids, step.position_ids, step.past_key_values,
                                                step.attn_metadata))
    memory, plan = runner.graph_memory, runner.memory_plan
    graphs = runner.stats.captures + runner.stats.piecewise_captures
    sleep_s = _timed(device, runner.sleep)
    free_asleep = _free(device)
    wake_s = _timed(device, lambda: runner.wake(workload.kv_cache, progress=False))
    runner.reset()
    return {
        "graphs": graphs, "plan_s": plan_s, "warmup_s": warmup_s, "first_step_ms": first_s * 1e3,
        "sleep_s": sleep_s, "wake_s": wake_s,
        "graph_memory_bytes": memory.bytes if memory is not None else None,
        "families_bytes": dict(memory.families) if memory is not None else {},
        "planned_bytes": plan.bytes if plan is not None else None,
        "memory_method": memory.method if memory is not None else None,
        # On a device: what sleep() left in use against before plan_memory() (the probe cache held in both reads).
        "asleep_left_bytes": free_before - free_asleep if free_before is not None and free_asleep is not None else None,
    }


def print_startup(startup: dict[str, dict[str, Any]], batch: int) -> None:
    """The start-up table: one row per execute mode."""
    if not startup:
        return
    print(f"\nstart-up per execute mode (s, device-synchronised; first step at batch {batch}; "
          "wake: every graph captured again after sleep)")
    print(f"{'mode':20s} {'graphs':>6s} {'plan s':>8s} {'warm-up s':>10s} {'first ms':>9s} {'wake s':>8s} "
          f"{'planned MiB':>12s}  graph memory by family, MiB")
    for mode, row in startup.items():
        planned = f"{row['planned_bytes'] / MiB:12.1f}" if row["planned_bytes"] is not None else f"{'-':>12s}"
        families = ", ".join(f"{name} {part / MiB:.1f}" for name, part in row["families_bytes"].items()) or "-"
        total = f" (total {row['graph_memory_bytes'] / MiB:.1f})" if row["graph_memory_bytes"] is not None else ""
        print(f"{mode:20s} {row['graphs']:6d} {row['plan_s']:8.2f} {row['warmup_s']:10.2f} "
              f"{row['first_step_ms']:9.2f} {row['wake_s']:8.2f} {planned}  {families}{total}")
    left = {mode: row["asleep_left_bytes"] for mode, row in startup.items() if row["asleep_left_bytes"] is not None}
    if left:
        print("  after sleep(), against before plan_memory(): "
              + ", ".join(f"{mode} {value / MiB:+.1f} MiB in use" for mode, value in left.items()))
    method = next((row["memory_method"] for row in startup.values() if row["memory_method"]), None)
    if method:
        print(f"  graph memory: {method}")

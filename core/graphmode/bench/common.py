"""What ``graphmode bench`` and its tensor-parallel mode (``bench/tp.py``)
share: the command's arguments and the timing of one step. Its own module,
so that the command can import the tensor-parallel mode and that mode the
arguments without an import cycle."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from graphmode.bench.modes import _sync
from graphmode.kernels import ATTENTION_CHOICES

__all__ = ["CPU_BATCHES", "CPU_CASES", "DEFAULT_BATCHES", "GPU_CASES", "MODES", "PREFILL_MODES", "WORKLOADS",
           "add_arguments", "chosen_modes", "median_step", "step_times", "taking_turns"]

DEFAULT_BATCHES = "1,2,3,4,8,16,24,32,64,100,128,200,256"
CPU_BATCHES = "1,2,3,4,8"  # the decode workload off CUDA: the tiny model
MODES = ("eager", "graphmode", "hand", "hand-exact", "compile", "graphmode-compile")
WORKLOADS = ("decode", "prefill", "offload")
PREFILL_MODES = ("eager", "piecewise", "full_and_piecewise", "piecewise+compile", "full_and_piecewise+compile",
                 "compile")
GPU_CASES = "1x128,1x512,1x2048,4x128,4x512,4x2048,16x128,16x512,16x2048,mix512+64,decode64"
CPU_CASES = "1x8,1x32,4x8,4x32,mix16+4,decode4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=["bench", "tiny"], default=None,
                        help="model size (default: bench on a GPU, tiny on the CPU)")
    parser.add_argument("--batches", default=None,
                        help=f"batch sizes (default {DEFAULT_BATCHES}; {CPU_BATCHES} on the CPU)")
    parser.add_argument("--vendors", default=None,
                        help="graphmode vendors to time, comma-separated (default: every installed vendor whose "
                             "graphs run the bench model on --device; the others are listed as not timed, "
                             "with the reason; --tp: the first, default cuda)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per batch size and mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (capture, compile)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--workload", choices=WORKLOADS, default="decode",
                        help="decode: decode steps per batch size (default); prefill: prefill, chunked-prefill "
                             "and decode steps per case, eager against piecewise graphs (--cases); offload: "
                             "decode of the offloaded model, eager against per-layer graphs (--batches)")
    parser.add_argument("--modes", default=None,
                        help=f"modes to time (default all): decode {','.join(MODES)} (graphmode: one per vendor; "
                             f"graphmode-compile: graphmode over torch.compile); prefill {','.join(PREFILL_MODES)}")
    parser.add_argument("--cases", default=None,
                        help=f"prefill cases (default {GPU_CASES}; {CPU_CASES} on the CPU): NxL is N sequences "
                             "of L tokens, mixC+D one C-token chunk after C cached tokens plus D decodes, "
                             "decodeB B decodes")
    parser.add_argument("--compile-mode", choices=["reduce-overhead", "default"], default="reduce-overhead",
                        help="torch.compile mode of the prefill workload's compile column (default "
                             "reduce-overhead: Inductor kernels in CUDA graphs between the attention calls)")
    parser.add_argument("--ring", type=int, default=2, help="offload workload: device layers in the weight ring")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default=None,
                        help="CUDA attention kernels: triton, reference, or auto (Triton when it imports "
                             "on a CUDA device); default: the plugin's choice ($GRAPHMODE_ATTENTION, else auto)")
    parser.add_argument("--hbm-tbps", type=float, default=None,
                        help="HBM bandwidth for the floor, TB/s (default: the datasheet figure of a known "
                             "device, else a measured device copy)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (see docs/tensor-parallel.md)")
    parser.add_argument("--startup-modes", default=None,
                        help="decode workload: the execute modes of the start-up table (plan_memory, warm-up, "
                             "first step, wake, graph memory by family), some of graph,piecewise,full_and_piecewise, "
                             "or none (default all three; graph on the CPU)")
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument("--plot", help="write a PNG plot of latency against batch size here")


def step_times(call: Any, steps: list, device: torch.device) -> list[float]:
    """Seconds of each step, synchronised before and after."""
    times = []
    for step in steps:
        _sync(device)
        started = time.perf_counter()
        call(step)
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def taking_turns(modes: list[Any], steps: list, device: torch.device,
                 rounds: int) -> tuple[dict[Any, list[float]], dict[Any, str]]:
    """Each mode's step times, the steps split into ``rounds`` runs and the
    modes taking turns at each: a drift over the run (clocks, temperature,
    a busy host) falls on every mode alike, instead of on whichever was
    timed last. A mode that raises is left out from then on, its error
    (one line) in the second dict."""
    times: dict[Any, list[float]] = {mode: [] for mode in modes}
    errors: dict[Any, str] = {}
    size = max(1, -(-len(steps) // rounds))
    for first in range(0, len(steps), size):
        for mode in [mode for mode in modes if mode not in errors]:
            try:
                times[mode] += step_times(mode, steps[first:first + size], device)
            except Exception as error:  # reported beside the others' figures, not fatal
                errors[mode] = f"failed: {type(error).__name__}: {error}".splitlines()[0][:300]
    return times, errors


def median_step(call: Any, steps: list, device: torch.device) -> float:
    """Median seconds of one step, synchronised before and after."""
    return statistics.median(step_times(call, steps, device))


def chosen_modes(text: str | None, known: tuple[str, ...], workload: str) -> list[str]:
    """The modes of ``--modes`` (all of ``known`` when not given); an unknown
    one stops the command with the list to choose from."""
    wanted = [mode for mode in (text or ",".join(known)).split(",") if mode]
    unknown = sorted(set(wanted) - set(known))
    if unknown or not wanted:
        raise SystemExit(f"graphmode bench --workload {workload}: --modes {text!r} names "
                         f"{','.join(unknown) or 'nothing'}; choose from {','.join(known)}")
    return wanted

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

__all__ = ["DEFAULT_BATCHES", "MODES", "add_arguments", "median_step"]

DEFAULT_BATCHES = "1,2,3,4,8,16,24,32,64,100,128,200,256"
MODES = ("eager", "graphmode", "hand", "hand-exact", "compile", "graphmode-compile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=["bench", "tiny"], default=None,
                        help="model size (default: bench on a GPU, tiny on the CPU)")
    parser.add_argument("--batches", default=None, help=f"batch sizes (default {DEFAULT_BATCHES}; 1,2,4,8 on the CPU)")
    parser.add_argument("--vendors", default="cuda,maca,ppu", help="graphmode vendors to time")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per batch size and mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (capture, compile)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"modes to time, of {','.join(MODES)} (graphmode: one per vendor; "
                             "graphmode-compile: graphmode over torch.compile; default all)")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default=None,
                        help="CUDA attention kernels: triton, reference, or auto (Triton when it imports "
                             "on a CUDA device); default: the plugin's choice ($GRAPHMODE_ATTENTION, else auto)")
    parser.add_argument("--hbm-tbps", type=float, default=None,
                        help="HBM bandwidth for the floor, TB/s (default: the datasheet figure of a known "
                             "device, else a measured device copy)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (see docs/tensor-parallel.md)")
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument("--plot", help="write a PNG plot of latency against batch size here")


def median_step(call: Any, steps: list, device: torch.device) -> float:
    """Median seconds of one step, synchronised before and after."""
    times = []
    for step in steps:
        _sync(device)
        started = time.perf_counter()
        call(step)
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)

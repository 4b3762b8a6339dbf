"""Timing one mode over one kind of step, for the prefill and offload
workloads: warm-up steps untimed (capture, compilation), then the median of
the timed steps, each synchronised before and after; the logits of the first
timed step's sampled rows kept to compare the modes; the device's peak
memory. A mode that cannot run a case is reported, not fatal."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from graphmode.bench.modes import Compiled, _sync

__all__ = ["Measured", "difference_text", "machine", "measure", "release", "spread"]


@dataclass
class Measured:
    """ms: median step; prepare_s: the warm-up steps' seconds (capture,
    compilation); sample: float32 logits of the first timed step at ``rows``
    (on the host); peak_bytes: the device's peak allocation while the case
    ran (CUDA), the graphs of modes built before included; error: why the
    mode could not run the case (then the rest is empty)."""

    ms: float | None = None
    prepare_s: float | None = None
    sample: torch.Tensor | None = None
    peak_bytes: int | None = None
    error: str | None = None


def measure(mode: Any, steps: list, warmup: int, rows: torch.Tensor, device: torch.device) -> Measured:
    """``steps[:warmup]`` untimed, then the median of the others."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            release(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        if isinstance(mode, Compiled):
            mode.compile_for(steps[:warmup])
        else:
            for step in steps[:warmup]:
                mode(step)
        _sync(device)
        prepare = time.perf_counter() - started
        times, sample = [], None
        for step in steps[warmup:]:
            _sync(device)
            started = time.perf_counter()
            output = mode(step)
            _sync(device)
            times.append(time.perf_counter() - started)
            if sample is None:  # outside the timed window; the output is valid until the next step
                sample = output[0, rows].float().cpu()
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        return Measured(statistics.median(times) * 1e3, prepare, sample, peak)
    except Exception as error:  # reported in the table and the JSON, the other modes go on
        release(device)
        return Measured(error=f"{type(error).__name__}: {error}".splitlines()[0][:300])


def spread(samples: list[float]) -> float:
    """How far timings of one thing scatter: their interquartile range (0
    for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4)
    return high - low


def difference_text(difference: float, noise: float, unit: str = "us") -> str:
    """A cost measured as the difference of two timings (``difference``, in
    ``unit``), as printed: the figure, or where noise made it negative,
    "not measurable (noise: ...)" rather than a negative cost. ``noise``:
    the timings' spread in ``unit``, e.g. the larger :func:`spread`."""
    if difference < 0:
        return f"not measurable (noise: came out {difference:+.1f} {unit}, timings scatter by {noise:.1f} {unit})"
    return f"{difference:.1f} {unit}"


def release(device: torch.device) -> None:
    """Return cached device memory, so that one mode's leftovers do not
    count against the next."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def machine(device: torch.device) -> dict[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}), emulated graphs"
    return {"device": name, "torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version()}

"""Steps issued back to back, with no host wait between them.

Every other test reads each step's outputs on the host before the next step,
which waits for the device: the device is idle whenever the host writes
anything. An engine does not wait; it issues the next step while the device
still runs the last. Two classes of vendor bug are right when steps are
synchronised and wrong then: a graph class that replays on a stream not
ordered after the step's input copies (the replay reads the previous step's
inputs), and one pinned host buffer reused for every step's values while the
copy from it is still in flight (the earlier step reads the later one's).

On a GPU the test makes the device busy first (a sleep kernel, then every
step queued behind it), issues every step, and compares each with eager. On
the emulator, which runs everything at once, the same steps run with copies
from pinned host memory tracked as in flight (``graphmode.emulator.in_flight``),
and replays checked for stream order (``graphmode.emulator.stream_order``,
always on): each bug is refused where it happens, naming the hook.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphmode.emulator import in_flight
from graphmode.emulator.capture import call_site
from graphmode_conformance.compare import compare_outputs
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure

__all__ = ["BackToBackTests"]

BATCHES = (8, 7, 3, 8, 5, 2, 8, 6)  # within a bucket and across buckets
# About half a second of a GPU's time: every step's work is issued while it runs.
SLEEP_CYCLES = 1_000_000_000


def _device_busy(device: torch.device) -> Any:
    """Keep the device busy while the block issues work: a sleep kernel on
    CUDA (everything issued next queues behind it); on the emulator, copies
    from pinned host memory tracked as in flight until the host waits."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda._sleep(SLEEP_CYCLES)
        return contextlib.nullcontext()
    return in_flight.tracked()


class _PinnedSources(TorchFunctionMode):
    """On a device, the pinned host memory each step's non-blocking copies
    read, and where they were issued: to tell the two causes apart after a
    mismatch (the emulator refuses either where it happens)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.sources: dict[int, tuple[int, str]] = {}  # storage -> (last step copying from it, where)
        self.reused: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor) \
                and (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) \
                and args[1].device.type == "cpu" and args[1].is_pinned() and args[0].device.type != "cpu":
            key = args[1].untyped_storage().data_ptr()
            last = self.sources.get(key)
            if last is not None and last[0] == self.step - 1 and self.reused is None:
                self.reused = last[1]
            self.sources[key] = (self.step, call_site(os.path.abspath(__file__)))  # the vendor's line, not this mode's
        return func(*args, **kwargs)


class BackToBackTests(ConformanceFixtures):
    def test_steps_issued_back_to_back_read_their_own_inputs(self, harness):
        """Decode steps of batches 8, 7, 3, 8, 5, 2, 8, 6, every graph
        captured first, then issued with no host wait between them (their
        inputs built beforehand, as an engine's are, each output copied on
        the device): each equals its eager step."""
        harness.check = "steps back to back"
        seqs = harness.start(max(BATCHES))
        for batch in sorted(set(BATCHES)):  # the captures, synchronised
            harness.step(seqs[:batch])
        engine, runner, device = harness.engine, harness.runner, harness.device
        steps = [engine.decode(seqs[:batch]) for batch in BATCHES]
        where = f"[{harness.check}] vendor {harness.vendor.name} on {device}{harness.variant}"
        results = []
        pinned = _PinnedSources()
        with torch.inference_mode():
            with _device_busy(device), pinned if device.type != "cpu" else contextlib.nullcontext():
                for index, step in enumerate(steps):
                    pinned.step = index
                    try:
                        output = runner(step.input_ids, step.position_ids, harness.graph_cache, step.attn_metadata)
                    except Exception as error:
                        raise ConformanceFailure(
                            f"{where}, step {index + 1} of {len(steps)} (batch {BATCHES[index]}, issued while the "
                            f"steps before it may still run): {harness.describe_error(error)}"
                        ) from error
                    results.append(output.clone())  # on the device, in stream order: no host wait
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for index, (step, graph) in enumerate(zip(steps, results)):
                eager = harness.model(step.input_ids, step.position_ids, harness.eager_cache, step.attn_metadata)
                batch = BATCHES[index]
                try:
                    compare_outputs(f"{where}, step {index + 1} of {len(steps)} (batch {batch}, bucket "
                                    f"{runner.bucket_of(batch)}, replay, issued back to back)",
                                    graph, eager, seqs[:batch], "replay", None, harness.model.ops)
                except ConformanceFailure as failure:
                    cause = _PINNED.format(where=pinned.reused) if pinned.reused else _STREAM
                    raise ConformanceFailure(str(failure).split(" Likely cause: ")[0] + f" Likely cause: {_SAME}"
                                             f"{cause}") from None


_SAME = ("the same steps are right when each is synchronised (every other test), so this replay read another "
         "step's inputs: ")
_PINNED = (
    "one pinned host buffer rewritten for every step while the copy from it is still in flight: consecutive steps "
    "issued non-blocking copies from the same pinned memory (the last at {where}), and the host wrote the later "
    "step's values there before the earlier copy ran. Hook: graphmode_fill_buffers or "
    "graphmode_update_graph_params must give every step in flight a pinned buffer of its own, reused only after "
    "an event recorded after its copy completed (graphmode.ring)"
)
_STREAM = (
    "a graph class replaying on a stream not ordered after the step's input copies (no step copied from the same "
    "pinned host memory as the step before it). Hook: graphmode_make_graph: the graph's replay must run on the "
    "current stream, or make its stream wait for the current one first (replay_stream.wait_stream("
    "torch.cuda.current_stream())) and the current one wait for it after"
)

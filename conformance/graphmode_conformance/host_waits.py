"""No host waits on the replay path.

A replay step prepares the next while the device runs the last: the fill,
the parameter update, the replay launch and the outputs return at once. A
hook that waits on the host for the device (``stream.synchronize()``,
``event.synchronize()``, ``torch.npu.synchronize()``, an ``event.query()``
polled until it is done) gives right results and stalls the host every
step, until the previous replay finishes: what a parameter update must do
instead is order its work after that replay on the device (the update
stream waits on an event recorded after the replay). Host reads of device
memory (``.item()``, ``.tolist()``) are refused on the emulator as they
run (``graphmode.emulator.replay``); waits read nothing and pass there.

:class:`HostWaitTests` runs replay steps with every Python call watched
(``sys.setprofile``): a call of a function named ``synchronize``, of any
runtime (torch's, a vendor's, the emulator's stand-ins), or a second
``query`` of one step, made inside a vendor hook of the replay path
(``graphmode_fill_buffers``, ``graphmode_update_graph_params``,
``graphmode_get_outputs``) or the replay of the graph class
``graphmode_make_graph`` returned, fails, naming the hook, the call and
where it was made; waits graphmode's own code makes (host staging's ring)
are its design and not counted. On a device the same calls are watched.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import pytest

import graphmode
from graphmode.graphs import DeviceGraph
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.sizes import MIN_MAX_BATCHES
from graphmode_conformance.structure import ConformanceFailure
from graphmode_conformance.watched import ProfileWatch, WatchedHarness

__all__ = ["HOST_WAITS", "HostWaitTests"]

# Hooks run at every replay step, the vendor's code in them.
REPLAY_HOOKS = ("graphmode_fill_buffers", "graphmode_update_graph_params", "graphmode_get_outputs")
# The names host waits have in every runtime (torch.cuda, torch_npu,
# torch_mlu, the emulator's): a wait of the host for the device.
HOST_WAITS = ("synchronize",)
# graphmode's own code: the waits it makes are its design, not the vendor's.
_GRAPHMODE_CODE = os.path.dirname(str(graphmode.__file__)) + os.sep
# The replay steps watched: a batch of 4 in its bucket, shrinking, regrowing.
_BUCKET = 4
# A call that asks whether the device is done: once is a question, twice in
# one step a busy wait.
POLLS = ("query",)


@dataclass(frozen=True)
class HostWait:
    """A host wait seen: the function called, where, and in which hook."""

    called: str
    site: str
    inside: str


class _WatchedWaits(ProfileWatch):
    """``with watched:`` (reusable, one runner step per entry) records every
    host wait (and repeated poll) made inside the code objects of ``hooks``
    (name per code object) or inside a ``DeviceGraph.replay`` that is not
    graphmode's."""

    def __init__(self, hooks: dict[Any, str]) -> None:
        self.hooks = hooks
        self.waits: list[HostWait] = []
        self._polls: dict[str, int] = {}

    def _inside(self, frame: Any) -> str | None:
        """The hook (or graph replay) ``frame`` runs in, innermost first."""
        while frame is not None:
            named = self.hooks.get(frame.f_code)
            if named is not None:
                return named
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "replay" else None
            if isinstance(owner, DeviceGraph) and not type(owner).__module__.startswith("graphmode."):
                return f"{type(owner).__qualname__}.replay() (the graph class graphmode_make_graph returned)"
            frame = frame.f_back
        return None

    def _seen(self, name: str, caller: Any, owner: str) -> None:
        if caller.f_code.co_filename.startswith(_GRAPHMODE_CODE):
            return  # graphmode's own (host staging's ring waits for a copy several steps back, by design)
        if name in POLLS:
            self._polls[owner] = self._polls.get(owner, 0) + 1
            if self._polls[owner] < 2:
                return
        inside = self._inside(caller)
        if inside is None:
            return
        code = caller.f_code
        site = f"{os.path.basename(code.co_filename)}:{caller.f_lineno} in {code.co_name}"
        self.waits.append(HostWait(f"{owner}{name}()", site, inside))

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name in HOST_WAITS + POLLS and frame.f_back is not None:
            if frame.f_back.f_code.co_name in HOST_WAITS + POLLS:
                return  # inside a wait or poll already seen (the emulator's query() synchronises)
            owner = frame.f_locals.get("self")
            prefix = f"{type(owner).__qualname__}." if owner is not None else f"{frame.f_globals.get('__name__')}."
            self._seen(frame.f_code.co_name, frame.f_back, prefix)
        elif event == "c_call" and getattr(arg, "__name__", "") in HOST_WAITS + POLLS:
            owner = getattr(arg, "__self__", None)
            prefix = f"{type(owner).__qualname__}." if owner is not None and not isinstance(owner, type(sys)) else ""
            self._seen(arg.__name__, frame, prefix)

    def __enter__(self) -> _WatchedWaits:
        self._polls.clear()  # one runner step per entry
        super().__enter__()
        return self



def _replay_hooks(vendor: Any) -> dict[Any, str]:
    """The code of each replay-path hook implementation, named."""
    hooks = {}
    for name in REPLAY_HOOKS:
        for impl in getattr(vendor.hook, name).get_hookimpls():
            code = getattr(impl.function, "__code__", None)
            if code is not None:
                hooks[code] = f"{name} (plugin {impl.plugin_name})"
    return hooks


class HostWaitTests(ConformanceFixtures):
    def test_replay_steps_never_wait_on_the_host(self, vendor, build_harness, sizes):
        """Replay steps of one bucket, growing and shrinking: no replay-path
        hook, and no replay of the vendor's graph class, waits on the host
        for the device."""
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=(1, _BUCKET))
        harness = build_harness(WatchedHarness, small)
        assert isinstance(harness, WatchedHarness)
        runner = harness.runner
        bucket = runner.bucket_of(_BUCKET)
        if bucket is None:
            pytest.skip(f"no graph holds a batch of {_BUCKET} (capture list {list(runner.capture_sizes)})")
        seqs = harness.start(bucket)
        harness.step(seqs)  # the capture, outside the watch: captures may wait
        watched = harness.watch = _WatchedWaits(_replay_hooks(vendor))
        for batch in (bucket, bucket - 1, bucket - 2, bucket):
            harness.step(seqs[:batch])
            if watched.waits:
                wait = watched.waits[0]
                raise ConformanceFailure(
                    f"[host waits] vendor {vendor.name} on {harness.device}{harness.variant}, batch {batch}, "
                    f"bucket {bucket} (replay): {wait.inside} waited on the host for the device: "
                    f"{wait.called} called at {wait.site}"
                    + (f" ({len(watched.waits)} waits this step)" if len(watched.waits) > 1 else "")
                    + ". Results are right, but on a device the host stalls there at every step until the "
                    "previous replay has finished, so the next step cannot be prepared while this one runs. "
                    "Order the work after the previous replay on the device instead: record an event on the "
                    "replay stream after each replay and make the stream that issues the update wait on it "
                    "(update_stream.wait_event(event)); never stream.synchronize(), event.synchronize(), "
                    "torch.<device>.synchronize() or a polled event.query() on the replay path"
                )
        if not runner.stats.replays:
            pytest.skip("no step replayed a graph")

"""Which stream a replay launched its device graph on: the diagnosis of a
replay that read stale inputs on a real device.

graphmode's fill copies a step's inputs into the graph's buffers on the
stream current when the runner is called; a graph launched there runs after
them. A graph class that launches on a stream of its own, never made to wait
for that one, races the copies: on the emulator ``graphmode.emulator.stream_order``
refuses the replay where it happens, naming the class; on a device the replay
just reads whatever the buffers held, usually the previous step's inputs, and
the comparison with eager fails with no more to say. So after a replay
mismatch on a device the suite issues the same step once more with the
runtime's graph class (``torch.cuda.CUDAGraph`` and the like:
``torch.<type>.<TYPE>Graph``) recording the current stream at every launch;
a launch on another stream than the caller's is the likely cause, named with
the vendor's graph class.

A class that launches on another stream and orders it correctly (its stream
waits for the caller's first) is right, and never reaches this diagnosis:
it runs only after a mismatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["launch_stream_cause"]


@contextlib.contextmanager
def _launches_recorded(device: torch.device) -> Iterator[list[Any] | None]:
    """The current stream at each launch of the runtime's graph class inside
    the block; None where the runtime has no graph class or streams."""
    module: Any = getattr(torch, device.type, None)
    graph_class = getattr(module, f"{device.type.upper()}Graph", None)
    if graph_class is None or not hasattr(module, "current_stream"):
        yield None
        return
    launches: list[Any] = []
    own = "replay" in graph_class.__dict__
    original: Callable[..., Any] = graph_class.replay

    def recording_replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(module.current_stream(device))
        return original(graph, *args, **kwargs)

    graph_class.replay = recording_replay
    try:
        yield launches
    finally:
        if own:
            graph_class.replay = original
        else:
            del graph_class.replay


def launch_stream_cause(call_runner: Callable[[], Any], device: torch.device, graph: Any) -> str | None:
    """Issue the step again (``call_runner``) with launches recorded; the
    likely cause, naming ``graph``'s class (the object graphmode_make_graph
    returned for the step's bucket), when a launch ran on a stream other than
    the caller's; else None (no launch seen: the step took no graph of the
    runtime's class, or the cause is elsewhere)."""
    module: Any = getattr(torch, device.type, None)
    with _launches_recorded(device) as launches:
        if launches is None:
            return None
        caller = module.current_stream(device)
        with torch.inference_mode():
            call_runner()
        module.synchronize(device)
    foreign = [stream for stream in launches if stream != caller]
    if not foreign:
        return None
    name = type(graph).__qualname__ if graph is not None else "the vendor's graph class"
    return (
        f"the device graph was launched on {foreign[0]}, not on the stream current when the runner was called "
        f"({caller}), where graphmode's fill copied the step's inputs: {name}.replay() (the graph class "
        "graphmode_make_graph returned) switches streams, so its replay runs concurrently with those copies and "
        "reads the buffers before they land, usually the previous step's inputs (on the emulator this is refused "
        "where it happens). Hook: graphmode_make_graph: replay on the current stream, or make the replay stream "
        f"wait for the caller's first (replay_stream.wait_stream(torch.{device.type}.current_stream())) and the "
        "caller's wait for it after"
    )

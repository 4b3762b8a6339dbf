"""EmulatedGraph: a device graph for the CPU, with a device graph's semantics.

Capture records the operator stream (see ``capture.py``); replay re-runs it on
the very same tensors. What a captured forward read at fixed addresses is read
live at replay, host values are frozen at capture, outputs keep their identity,
random operators draw fresh numbers, and a capture leaves no side effect.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from graphmode.device_graph import DeviceGraph
from graphmode.emulator import in_flight
from graphmode.emulator.capture import CaptureSession, named_arguments
from graphmode.emulator.recording import OpRecord, compile_steps
from graphmode.emulator.stream import launch, synchronize
from graphmode.emulator.stream_order import check_replay_ordered
from graphmode.errors import CaptureError, ReplayError

__all__ = ["EmulatedGraph", "EmulatedPool"]


class EmulatedPool:
    """A memory-pool token. Graphs captured into one pool share ownership of
    the memory their captures allocated: it lives while any of them holds it."""

    def __init__(self) -> None:
        self._graphs: weakref.WeakSet[EmulatedGraph] = weakref.WeakSet()

    def add(self, graph: EmulatedGraph) -> None:
        self._graphs.add(graph)

    def discard(self, graph: EmulatedGraph) -> None:
        self._graphs.discard(graph)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def nbytes(self) -> int:
        """Bytes of the memory the pool's captures allocated and still hold."""
        storages = {}
        for graph in list(self._graphs):
            for storage in graph.allocated_storages():
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def __repr__(self) -> str:
        return f"<EmulatedPool {id(self):#x}: {self.num_graphs} graphs>"


class EmulatedGraph(DeviceGraph):
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` and other device graphs.

    Extension point: a vendor's emulated graph subclasses it and overrides
    :meth:`record_call` (how a capture records an operator call) and, for
    state around replays, :meth:`replay` (see ``capture.py``).
    """

    def __init__(self) -> None:
        self._session: CaptureSession | None = None
        self._steps: list = []
        self._compiled: list = []
        self._allocated: list[torch.Tensor] = []
        self._pool: EmulatedPool | None = None
        self._state = "empty"
        self.replays = 0

    # -- capture ------------------------------------------------------------

    def capture_begin(self, pool: Any = None) -> None:
        if self._state != "empty":
            raise CaptureError(
                f"this graph is {self._state}; call reset() before capturing it again"
            )
        if pool is not None and not isinstance(pool, EmulatedPool):
            raise CaptureError(f"pool={pool!r} is not a token from EmulatedGraph.pool()")
        synchronize()  # as torch.cuda.graph does on entry: no launched work runs during a capture
        session = CaptureSession(self)
        session.start()
        self._session = session
        self._pool = pool or EmulatedPool()
        self._pool.add(self)
        self._state = "capturing"

    def capture_end(self) -> None:
        session = self._session
        if session is None:
            raise CaptureError("capture_end without capture_begin")
        self._session = None
        session.stop()
        if session.error is not None:
            self._state = "invalidated"
            raise CaptureError(
                "the capture was invalidated by an earlier error "
                f"({session.error.__class__.__name__}); reset() and capture again"
            ) from session.error
        self._steps = session.steps
        self._allocated = [
            tensor
            for step in _walk(self._steps)
            if isinstance(step, OpRecord)
            for tensor in _output_tensors(step.outputs)
            if tensor.untyped_storage().data_ptr() in session.allocated
        ]
        self._compiled = compile_steps(self._steps)
        self._state = "captured"

    # -- replay and updates -------------------------------------------------

    def replay(self) -> None:
        if self._state != "captured":
            raise ReplayError(f"replay of a graph that is {self._state}; capture it first")
        check_replay_ordered(self)  # on a stream that waited for the step's inputs
        in_flight.check()  # no copy it may read from pinned memory rewritten while in flight
        launch(functools.partial(_run, self._compiled))  # at once, or on the device thread (emulator.stream)
        self.replays += 1

    def record_call(self, session: CaptureSession, func: Any, args: tuple, kwargs: dict) -> Any:
        """Record one operator call of this graph's capture and return its
        outputs. The extension point for a vendor's graph: by default,
        :meth:`CaptureSession.record`."""
        return session.record(func, args, kwargs)

    # -- lifetime -----------------------------------------------------------

    def reset(self) -> None:
        if self._session is not None:
            raise CaptureError("reset() during capture; end the capture first")
        if self._pool is not None:
            self._pool.discard(self)
        self._steps, self._compiled, self._allocated = [], [], []
        self._pool = None
        self._state = "empty"
        self.replays = 0

    def pool(self) -> EmulatedPool:
        if self._pool is None:
            raise CaptureError("pool() of a graph that was never captured")
        return self._pool

    def allocated_storages(self) -> list[Any]:
        return [tensor.untyped_storage() for tensor in self._allocated]

    def host_arguments(self) -> list[tuple[str, str, list]]:
        """The host values this graph's kernels read at replay, as
        (operator, argument, values): every argument that is a list of
        numbers, of every recorded call of an operator outside ``aten`` (a
        vendor's kernel). What a parameter update pushed shows here after it."""
        found = []
        for step in _walk(self._steps):
            if not isinstance(step, OpRecord) or getattr(step.func, "namespace", "aten") in ("aten", "prims"):
                continue
            for name, value in named_arguments(step.func, step.args, step.kwargs).items():
                if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
                    found.append((str(step.func), name, list(value)))
        return found

    def held_arguments(self) -> list[tuple[str, str, torch.Tensor]]:
        """The tensors this graph's kernels (every recorded call of an
        operator outside ``aten``) read at replay that its capture did not
        allocate, as (operator, argument, tensor), each a view of the memory
        the call reads: memory that existed before the capture or beside it
        (declared buffers, the KV cache, weights, a runtime's own parameter
        memory that its updates write, as a device runtime keeps a launch's
        arguments). Read live: what the last update wrote shows here."""
        allocated = {storage.data_ptr() for storage in self.allocated_storages()}
        found = []
        for step in _walk(self._steps):
            if not isinstance(step, OpRecord) or getattr(step.func, "namespace", "aten") in ("aten", "prims"):
                continue
            for name, value in named_arguments(step.func, step.args, step.kwargs).items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in allocated:
                    found.append((str(step.func), name, value))
        return found

    def host_scalars(self) -> list[tuple[str, str, int]]:
        """The host integers this graph's kernels read at replay, as
        (operator, argument, value): every int argument of every recorded
        call of an operator outside ``aten`` (a vendor's kernel: a length
        bound such as ``max_seqlen_k``). Frozen at capture unless an update
        replaced the record; what an update pushed shows here after it."""
        found = []
        for step in _walk(self._steps):
            if not isinstance(step, OpRecord) or getattr(step.func, "namespace", "aten") in ("aten", "prims"):
                continue
            for name, value in named_arguments(step.func, step.args, step.kwargs).items():
                if isinstance(value, int) and not isinstance(value, bool):
                    found.append((str(step.func), name, value))
        return found

    @property
    def num_ops(self) -> int:
        """Operators recorded (views and host answers included)."""
        return sum(1 for step in _walk(self._steps) if isinstance(step, OpRecord))

    def debug_dump(self, path: str) -> None:
        """Write the recorded operators, one per line, with how each replays."""
        replayed = {id(s) for s in _walk(self._steps) if s.replay_step() is not None}
        with open(path, "w") as out:
            for index, step in enumerate(_walk(self._steps)):
                how = "replay" if id(step) in replayed else "skip"
                out.write(f"{index:5d} {how:6s} {_describe(step)}\n")


def _run(compiled: list) -> None:
    # A device replays without Python: no torch function mode (the
    # runner's replay guard, a user's) sees the replayed operators.
    with torch.inference_mode(), torch._C.DisableTorchFunction():
        for step in compiled:
            step()


def _output_tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    return []


def _walk(steps: list) -> Iterator[Any]:
    """Every step, and the steps nested in it (a step's ``steps``)."""
    for step in steps:
        yield step
        nested: list = getattr(step, "steps", [])
        yield from _walk(nested)


def _describe(step: Any) -> str:
    describe = getattr(step, "describe", None)
    return describe() if describe is not None else repr(step)

"""What an emulated NPU graph records beyond operators: external-event waits,
ACL task groups and updatable calls, built on the core emulator's extension
point (steps with ``replay_step()``, see ``graphmode.emulator.recording``).

- :class:`EventWait` / :class:`EventReset`: the captured graph waits on an
  ``ExternalEvent`` that a parameter update records; a replay reaching an
  unrecorded event would hang on the device, so here it raises.
- :class:`TaskGroup`: the records between ``graph_task_group_begin`` and
  ``_end``; a task update (:class:`UpdateSession`) replaces them.
- :class:`DispatchRecord`: one call captured by ``NPUGraph``'s dispatch mode,
  which ``NPUGraph.update`` re-issues with new host arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.emulator.recording import OpRecord, compile_steps, is_mutating, is_view, written_tensors
from graphmode.errors import ReplayError

__all__ = ["DispatchRecord", "EventReset", "EventWait", "TaskGroup", "UpdateSession"]


@dataclass
class EventWait:
    """The graph waits until the event is recorded (by a parameter update)."""

    event: Any
    where: str = ""

    def replay_step(self) -> Callable[[], None]:
        event = self.event

        def wait() -> None:
            if not event.recorded:
                raise ReplayError(
                    "replay reached an ExternalEvent wait that no parameter update "
                    "recorded since the last replay; on the device this replay would "
                    "hang. Update the graph's captured parameters (graph.update or a "
                    f"task update ending in event.record) before every replay. Captured at {self.where}"
                )

        return wait

    def describe(self) -> str:
        return f"wait external event {id(self.event):#x}"


@dataclass
class EventReset:
    event: Any

    def replay_step(self) -> Callable[[], None]:
        event = self.event

        def reset() -> None:
            event.recorded = False

        return reset

    def describe(self) -> str:
        return f"reset external event {id(self.event):#x}"


@dataclass(eq=False)
class TaskGroup:
    """Records captured between ``graph_task_group_begin`` and ``_end`` of
    ``graph`` (held weakly); a task update replaces them."""

    graph: weakref.ref
    steps: list = field(default_factory=list)
    compiled: list = field(default_factory=list)

    def replace(self, steps: list) -> None:
        self.steps = steps
        self.compiled = compile_steps(steps)

    def replay_step(self) -> Callable[[], None]:
        self.compiled = compile_steps(self.steps)

        def run_group() -> None:
            for step in self.compiled:
                step()

        return run_group

    def describe(self) -> str:
        return f"task group ({len(self.steps)} operators)"


class UpdateSession(TorchDispatchMode):
    """Between ``graph_task_update_begin`` and ``_end``: operators are not run
    but recorded, to replace a captured task group's records, as an ACL task
    update rewrites the captured tasks' parameters."""

    def __init__(self, group: TaskGroup) -> None:
        super().__init__()
        self.group = group
        self.steps: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_view(func):
            return func(*args, **kwargs)
        if not is_mutating(func):
            raise ReplayError(
                f"{func} was issued inside a task update but allocates its result, "
                "which the captured graph never reads. Re-issue the captured operator "
                "in its out= form, writing into the captured output."
            )
        self.steps.append(OpRecord(func, args, dict(kwargs), None))
        if not func._schema.returns:
            return None
        written = written_tensors(func, args, kwargs)
        return written[0] if len(written) == 1 else tuple(written)

    def finish(self) -> None:
        self.group.replace(self.steps)


class DispatchRecord:
    """One updatable call captured by ``NPUGraph``'s dispatch mode."""

    def __init__(self, func: Any, kwargs: dict, outputs: Any, event: Any, group: TaskGroup) -> None:
        self.func, self.outputs, self.event, self.group = func, outputs, event, group
        # The arguments as recorded: bound to the memory captured, as
        # torch_npu's records hold weak aliases of it, not the tensor objects.
        self.kwargs = dict(group.steps[-1].kwargs)
        self.targets = group.steps[-1].targets

    def update(self, changes: dict[str, Any]) -> None:
        unknown = sorted(set(changes) - set(self.kwargs))
        if unknown:
            raise ReplayError(
                f"update names {unknown}, which {self.func} does not take; "
                f"its arguments are {sorted(self.kwargs)}"
            )
        for name, value in changes.items():
            # The update is issued now: a host tensor is read now.
            self.kwargs[name] = value.tolist() if isinstance(value, torch.Tensor) else value
        self.group.replace([OpRecord(self.func, (), dict(self.kwargs), self.outputs, self.targets)])
        self.event.recorded = True

"""The Ascend device graph and the two ways kv lengths reach a captured graph.

FIA takes the kv lengths as host values, which a captured graph freezes.
Before every replay the new lengths are pushed into each captured attention
task:

- torch_npu >= 2.8.0.post1 ("graph_update"): capture with
  ``auto_dispatch_capture``; torch_npu records every FIA call and
  ``graph.update(cpu_update_input=[{"actual_seq_lengths_kv": ...}])``
  re-issues it with the new lengths inside a task update;
- older torch_npu ("task_group"): graphmode does that itself. During capture
  each FIA call is wrapped in ``graph_task_group_begin/end`` behind an
  ``ExternalEvent`` wait; before a replay it is re-issued on an update stream
  between ``graph_task_update_begin(handle)`` and ``graph_task_update_end``,
  and the event is recorded, which releases the replay's attention task.

Ordering: the previous replay must be done reading a task's parameters before
they change, so the update waits for the replay stream; and each replay's
attention tasks wait on the event recorded after their update, so a replay
never overtakes its update.

On the CPU the same code drives the emulator's NPU-like runtime
(:mod:`graphmode.emulator.npu`), so both paths run in CI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import InvalidVersion, Version
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.emulator import EmulatedGraph
from graphmode.emulator import npu as emulated_npu
from graphmode.errors import ConfigError
from graphmode.graphs import DeviceGraph, TorchGraph

__all__ = ["GRAPH_UPDATE_SINCE", "UPDATE_PATHS", "AscendGraph", "TaskGroupCapture", "resolve_update_path", "uses_graph_update"]

GRAPH_UPDATE_SINCE = Version("2.8.0.post1")
UPDATE_PATHS = ("auto", "graph_update", "task_group")
ENV_UPDATE_PATH = "GRAPHMODE_ASCEND_UPDATE_PATH"


def uses_graph_update(torch_npu_version: str) -> bool:
    """Whether this torch_npu has ``NPUGraph.update``; unparsable means old."""
    try:
        return Version(torch_npu_version) >= GRAPH_UPDATE_SINCE
    except InvalidVersion:
        return False


def resolve_update_path(requested: str | None, torch_npu_version: str | None) -> str:
    """"graph_update" or "task_group": ``$GRAPHMODE_ASCEND_UPDATE_PATH``, else
    the requested path, else by torch_npu's version (the emulator, having no
    torch_npu, mirrors the current API)."""
    path = os.environ.get(ENV_UPDATE_PATH) or requested or "auto"
    if path not in UPDATE_PATHS:
        raise ConfigError(
            f"Ascend update_path={path!r} is not one of {', '.join(UPDATE_PATHS)}; set "
            f"vendor_options={{'update_path': ...}} or ${ENV_UPDATE_PATH} to one of them"
        )
    if path != "auto":
        return path
    if torch_npu_version is None:
        return "graph_update"
    return "graph_update" if uses_graph_update(torch_npu_version) else "task_group"


@dataclass
class _Task:
    handle: Any
    event: Any
    kwargs: dict
    out: Any


class _AttentionCalls:
    """The fused attention operator of a device: the functional form a model
    calls, and how to issue it writing into given outputs."""

    def __init__(self, device_type: str) -> None:
        self.on_npu = device_type == "npu"
        if self.on_npu:
            self.functional = torch.ops.npu.npu_fused_infer_attention_score.default
        else:
            self.functional = torch.ops.graphmode_ascend.fused_infer_attention_score.default

    def named(self, args: tuple, kwargs: dict) -> dict:
        named = dict(kwargs)
        for argument, value in zip(self.functional._schema.arguments, args):
            named[argument.name] = value
        return named

    def allocate(self, kwargs: dict) -> Any:
        query = kwargs["query"]
        if not self.on_npu:
            return torch.empty_like(query)
        import torch_npu

        kwargs["workspace"] = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
        return [torch.empty_like(query), torch.empty(1, dtype=query.dtype, device=query.device)]

    def issue(self, kwargs: dict, out: Any) -> None:
        if self.on_npu:
            torch.ops.npu.npu_fused_infer_attention_score.out(**kwargs, out=out)
        else:
            torch.ops.graphmode_ascend.fused_infer_attention_score_out(**kwargs, out=out)

    def result(self, out: Any) -> Any:
        return tuple(out) if self.on_npu else out


class TaskGroupCapture(TorchDispatchMode):
    """Active during capture on the "task_group" path: puts every fused
    attention call in its own task group behind an external-event wait, and
    re-issues them all with new kv lengths in :meth:`update`."""

    def __init__(self, runtime: Any, calls: _AttentionCalls) -> None:
        super().__init__()
        self.runtime = runtime
        self.calls = calls
        self.update_stream = runtime.Stream()
        self.tasks: list[_Task] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not self.calls.functional:
            return func(*args, **kwargs)
        runtime, stream = self.runtime, self.runtime.current_stream()
        event = runtime.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        named = self.calls.named(args, kwargs)
        out = self.calls.allocate(named)
        runtime.graph_task_group_begin(stream)
        self.calls.issue(named, out)
        handle = runtime.graph_task_group_end(stream)
        self.tasks.append(_Task(handle, event, named, out))
        return self.calls.result(out)

    def update(self, lengths: list[int]) -> None:
        runtime, stream = self.runtime, self.update_stream
        with runtime.stream(stream):
            for task in self.tasks:
                runtime.graph_task_update_begin(stream, task.handle)
                self.calls.issue({**task.kwargs, "actual_seq_lengths_kv": lengths}, task.out)
                runtime.graph_task_update_end(stream)
                task.event.record(stream)


class AscendGraph(DeviceGraph):
    """``torch.npu.NPUGraph`` on an NPU, the emulator on the CPU, plus
    :meth:`push_kv_lengths` on the configured update path."""

    def __init__(self, device: torch.device, update_path: str) -> None:
        if update_path not in ("graph_update", "task_group"):
            raise ConfigError(f"AscendGraph needs a resolved update path, not {update_path!r}")
        self.device = torch.device(device)
        self.update_path = update_path
        self.calls = _AttentionCalls(self.device.type)
        if self.device.type == "npu":
            self.runtime = torch.npu
            self.inner: DeviceGraph = TorchGraph(self.device)
            self.npu_graph = self.inner.graph
        else:
            self.runtime = emulated_npu
            self.inner = EmulatedGraph()
            self.npu_graph = self.inner
        self._dispatch_mode: Any = None
        self._task_groups: TaskGroupCapture | None = None

    def capture_begin(self, pool: Any = None) -> None:
        if self.update_path == "graph_update":
            self.npu_graph.auto_dispatch_capture = True
            # torch_npu records FIA calls through its own dispatch mode, entered
            # around the capture as torch.npu.graph does; the emulator's
            # recorder plays that part itself.
            self._dispatch_mode = getattr(self.npu_graph, "graph_dispatch_mode", None)
            if self._dispatch_mode is not None:
                self._dispatch_mode.__enter__()
        self.inner.capture_begin(pool)
        if self.update_path == "task_group":
            self._task_groups = TaskGroupCapture(self.runtime, self.calls)
            self._task_groups.__enter__()

    def capture_end(self) -> None:
        try:
            if self._task_groups is not None:
                self._task_groups.__exit__(None, None, None)
            self.inner.capture_end()
        finally:
            if self._dispatch_mode is not None:
                self._dispatch_mode.__exit__(None, None, None)
                self._dispatch_mode = None

    def push_kv_lengths(self, lengths: list[int]) -> None:
        """Give every captured attention task this step's kv lengths."""
        # The last replay must be done with the tasks' parameters first.
        self.runtime.current_stream().synchronize()
        if self.update_path == "graph_update":
            self.npu_graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])
        else:
            self._task_groups.update(lengths)

    def replay(self) -> None:
        self.inner.replay()

    def reset(self) -> None:
        self.inner.reset()
        self._task_groups = None

    def pool(self) -> Any:
        return self.inner.pool()

    def debug_dump(self, path: str) -> None:
        self.inner.debug_dump(path)

"""The Ascend device graph and the two ways kv lengths reach a captured graph.

FIA takes the kv lengths as host values, which a captured graph freezes.
Before every replay the new lengths are pushed into each captured attention
task:

- torch_npu with ``NPUGraph.update`` recording the functional FIA call
  (2.8.0.post1, 2.7.1.post1, 2.6.0.post3, 2.1.0.post17, 2.9.0 and later in
  their lines: :data:`GRAPH_UPDATE_SINCE`) ("graph_update"): capture with
  ``auto_dispatch_capture``; torch_npu records every FIA call and
  ``graph.update(cpu_update_input=[{"actual_seq_lengths_kv": ...}])``
  re-issues it with the new lengths inside a task update;
- older torch_npu ("task_group"): graphmode does that itself. During capture
  each FIA call is wrapped in ``graph_task_group_begin/end`` behind an
  ``ExternalEvent`` wait; before a replay it is re-issued on an update stream
  between ``graph_task_update_begin(handle)`` and ``graph_task_update_end``,
  and the event is recorded, which releases the replay's attention task.

Only ``npu_fused_infer_attention_score.default`` is updated, on both paths.
The other forms that take kv lengths as host values (FIA's ``.out``, FIA v2,
``_npu_paged_attention``) are refused at capture, naming the operator: a
graph whose captured lengths nothing updates never replays. On the
graph_update path, torch_npu must also have recorded every FIA call (one
before its ``.default`` fix records none); that is checked after capture.

Ordering: the previous replay must be done reading a task's parameters before
they change, so the update stream waits (on the device) for an event recorded
on the replay stream after that replay; the host does not wait (a
synchronisation before every update, as vllm-ascend has, would give up
host/device overlap: the next step could not be prepared while this one
runs). Each replay's attention tasks wait on the event recorded after their
update, so a replay never overtakes its update.

Memory: the task-group state holds the tensors of each call weakly (as
torch_npu's records do) and the calls of one graph share one workspace (as
vllm-ascend's backends do): the graph, not the update state, owns them.

On the CPU the same code drives the emulator's NPU-like runtime
(:mod:`graphmode_ascend.emulated_npu`), so both paths run in CI.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import InvalidVersion, Version
from torch.utils._python_dispatch import TorchDispatchMode

from graphmode.errors import CaptureError, ConfigError, ReplayError
from graphmode.graphs import DeviceGraph, TorchGraph
from graphmode_ascend import emulated_npu

__all__ = ["GRAPH_UPDATE_SINCE", "UPDATE_PATHS", "AscendGraph", "AttentionCapture", "resolve_update_path", "uses_graph_update"]

# Per torch_npu release line (major, minor), the first build whose
# NPUGraph.update records the functional FIA call: the fix (Ascend/pytorch
# ee80bff67, 2025-09-12) was cherry-picked into each line and first shipped
# in that line's 7.2.0 release (tags v7.2.RC1.alpha003-pytorch* and
# v7.2.0-pytorch*). "2.7.1" and "2.8.0" name builds both before (7.1 and
# 7.2 alphas 1 and 2) and after it, so those lines start at their .post1;
# 2.9.0 shipped only after it. Lines newer than the last listed have it from
# their first build (on 26.x in the handler registry); older lines (2.2 to
# 2.5) never got it.
GRAPH_UPDATE_SINCE = {
    (2, 1): Version("2.1.0.post17"),
    (2, 6): Version("2.6.0.post3"),
    (2, 7): Version("2.7.1.post1"),
    (2, 8): Version("2.8.0.post1"),
    (2, 9): Version("2.9.0"),
}
UPDATE_PATHS = ("auto", "graph_update", "task_group")
ENV_UPDATE_PATH = "GRAPHMODE_ASCEND_UPDATE_PATH"


def uses_graph_update(torch_npu_version: str) -> bool:
    """Whether this torch_npu's ``NPUGraph.update`` re-issues the functional
    FIA call (:data:`GRAPH_UPDATE_SINCE`); unparsable means old."""
    try:
        version = Version(torch_npu_version)
    except InvalidVersion:
        return False
    line = (version.major, version.minor)
    if line > max(GRAPH_UPDATE_SINCE):
        return True
    since = GRAPH_UPDATE_SINCE.get(line)
    return since is not None and version >= since


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


@dataclass(frozen=True)
class _Form:
    """An attention operator that takes kv lengths as host values."""

    upstream: str  # its name in torch_npu
    lengths: str  # its kv-length argument (op-plugin's schema)


# By "namespace::name.overload" of the operator a capture sees.
_NPU_FORMS = {
    "npu::npu_fused_infer_attention_score.default": _Form("npu_fused_infer_attention_score", "actual_seq_lengths_kv"),
    "npu::npu_fused_infer_attention_score.out": _Form("npu_fused_infer_attention_score.out", "actual_seq_lengths_kv"),
    "npu::npu_fused_infer_attention_score_v2.default": _Form("npu_fused_infer_attention_score_v2", "actual_seq_kvlen"),
    "npu::npu_fused_infer_attention_score_v2.out": _Form("npu_fused_infer_attention_score_v2.out", "actual_seq_kvlen"),
    "atb::_npu_paged_attention.default": _Form("_npu_paged_attention", "context_lens"),
}
# The emulator's stand-ins for the same operators (graphmode_ascend.ops).
_EMULATED_FORMS = {
    "graphmode_ascend::fused_infer_attention_score.default": _NPU_FORMS["npu::npu_fused_infer_attention_score.default"],
    "graphmode_ascend::fused_infer_attention_score_out.default": _NPU_FORMS["npu::npu_fused_infer_attention_score.out"],
    "graphmode_ascend::fused_infer_attention_score_v2.default": _NPU_FORMS["npu::npu_fused_infer_attention_score_v2.default"],
    "graphmode_ascend::paged_attention.default": _NPU_FORMS["atb::_npu_paged_attention.default"],
}


def _key(func: Any) -> str:
    return f"{func.namespace}::{func.__name__}"


class _AttentionCalls:
    """The fused attention operator of a device: the functional form a model
    calls and graphmode updates, the forms it refuses, and how to issue the
    functional form writing into given outputs."""

    def __init__(self, device_type: str) -> None:
        self.on_npu = device_type == "npu"
        if self.on_npu:
            self.functional = torch.ops.npu.npu_fused_infer_attention_score.default
            self.forms = _NPU_FORMS
        else:
            self.functional = torch.ops.graphmode_ascend.fused_infer_attention_score.default
            self.forms = _EMULATED_FORMS

    def refused(self, func: Any) -> _Form | None:
        """The form ``func`` is, if it takes host kv lengths and is not the functional form."""
        if func is self.functional:
            return None
        return self.forms.get(_key(func))

    def named(self, args: tuple, kwargs: dict) -> dict:
        named = dict(kwargs)
        for argument, value in zip(self.functional._schema.arguments, args):
            named[argument.name] = value
        return named

    def allocate(self, kwargs: dict) -> Any:
        query = kwargs["query"]
        if not self.on_npu:
            return torch.empty_like(query)
        return [torch.empty_like(query), torch.empty(1, dtype=query.dtype, device=query.device)]

    def workspace(self, kwargs: dict) -> Any:
        """The most workspace this call may need (None on the emulator)."""
        if not self.on_npu:
            return None
        import torch_npu

        return torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)

    def issue(self, kwargs: dict, out: Any) -> None:
        if self.on_npu:
            torch.ops.npu.npu_fused_infer_attention_score.out(**kwargs, out=out)
        else:
            torch.ops.graphmode_ascend.fused_infer_attention_score_out(**kwargs, out=out)

    def result(self, out: Any) -> Any:
        return tuple(out) if self.on_npu else out


class _Weak:
    """A tensor held without keeping its memory alive, as torch_npu's records
    hold theirs (``torch_npu._C._weak_ref_tensor``: an alias that does not own
    the memory). The emulator has no such alias: there it is a weak reference,
    and the graph's recording keeps the tensor alive while it is captured."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._alias: torch.Tensor | None = None
        self._ref: weakref.ref[torch.Tensor] | None = None
        if tensor.device.type == "npu":
            import torch_npu

            self._alias = torch_npu._C._weak_ref_tensor(tensor)
        else:
            self._ref = weakref.ref(tensor)

    def get(self) -> torch.Tensor:
        if self._alias is not None:
            return self._alias
        assert self._ref is not None
        tensor = self._ref()
        if tensor is None:
            raise ReplayError(
                "a tensor of a captured attention call was freed while its graph is still in use; "
                "reset() the graph and capture it again"
            )
        return tensor


def _weak(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Weak(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_weak(v) for v in value)
    return value


def _strong(value: Any) -> Any:
    if isinstance(value, _Weak):
        return value.get()
    if isinstance(value, (list, tuple)):
        return type(value)(_strong(v) for v in value)
    return value


@dataclass
class _Task:
    handle: Any
    event: Any
    kwargs: dict  # tensors held weakly
    out: Any  # held weakly


class AttentionCapture(TorchDispatchMode):
    """Active during every Ascend capture, above any other mode: refuses the
    attention forms nothing would update, counts the functional FIA calls,
    and on the "task_group" path puts each in its own task group behind an
    external-event wait, re-issuing them all with new kv lengths in
    :meth:`update`."""

    def __init__(self, runtime: Any, calls: _AttentionCalls, path: str, update_stream: Any) -> None:
        super().__init__()
        self.runtime = runtime
        self.calls = calls
        self.path = path
        self.update_stream = update_stream
        self.seen = 0
        self.tasks: list[_Task] = []
        self._workspaces: dict[tuple, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        form = self.calls.refused(func)
        if form is not None:
            raise CaptureError(
                f"the captured forward calls {form.upstream} ({_key(func)}), whose kv lengths "
                f"({form.lengths}) a graph freezes at capture; graphmode updates the kv lengths of "
                f"npu_fused_infer_attention_score.default only (on the {self.path} path), so replays would "
                "attend over the capture-time lengths. Call torch_npu.npu_fused_infer_attention_score "
                "(its functional form, lengths as actual_seq_lengths_kv), or run with execute_mode='eager'"
            )
        if func is not self.calls.functional:
            return func(*args, **kwargs)
        self.seen += 1
        if self.path == "graph_update":
            return func(*args, **kwargs)  # torch_npu's dispatch mode records it
        runtime, stream = self.runtime, self.runtime.current_stream()
        event = runtime.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        named = self.calls.named(args, kwargs)
        workspace = self._shared_workspace(named)
        if workspace is not None:
            named["workspace"] = workspace
        out = self.calls.allocate(named)
        runtime.graph_task_group_begin(stream)
        self.calls.issue(named, out)
        handle = runtime.graph_task_group_end(stream)
        if not self.calls.on_npu:
            # The arguments as the emulator recorded them, bound to the memory
            # captured, as torch_npu's weak aliases are (not the tensor objects).
            named = runtime.recorded_arguments(handle)
            out = named.pop("out")
        self.tasks.append(_Task(handle, event, {k: _weak(v) for k, v in named.items()}, _weak(out)))
        return self.calls.result(out)

    def _shared_workspace(self, kwargs: dict) -> Any:
        """One workspace for every call of the graph with the same shapes, as
        vllm-ascend shares one per capture size: the calls run one after the other."""
        shapes = tuple((k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))
        if shapes not in self._workspaces:
            self._workspaces[shapes] = self.calls.workspace(kwargs)
        return self._workspaces[shapes]

    def __exit__(self, *exc: Any) -> None:
        self._workspaces.clear()  # the graph owns them now
        super().__exit__(*exc)

    def update(self, lengths: list[int]) -> None:
        runtime, stream = self.runtime, self.update_stream
        with runtime.stream(stream):
            for task in self.tasks:
                kwargs = {name: _strong(value) for name, value in task.kwargs.items()}
                runtime.graph_task_update_begin(stream, task.handle)
                self.calls.issue({**kwargs, "actual_seq_lengths_kv": lengths}, _strong(task.out))
                runtime.graph_task_update_end(stream)
                task.event.record(stream)


class AscendGraph(DeviceGraph):
    """``torch.npu.NPUGraph`` on an NPU, the emulator's on the CPU, plus
    :meth:`push_kv_lengths` on the configured update path.

    ``captured``: a set this graph is in while captured (the plugin counts
    them for its advice on stream exhaustion)."""

    def __init__(self, device: torch.device, update_path: str, captured: weakref.WeakSet | None = None) -> None:
        if update_path not in ("graph_update", "task_group"):
            raise ConfigError(f"AscendGraph needs a resolved update path, not {update_path!r}")
        self.device = torch.device(device)
        self.update_path = update_path
        self.calls = _AttentionCalls(self.device.type)
        self.inner: DeviceGraph
        self.npu_graph: Any  # torch.npu.NPUGraph, or the emulator's
        if self.device.type == "npu":
            self.runtime: Any = torch.npu  # type: ignore[attr-defined]  # added by torch_npu
            torch_graph = TorchGraph(self.device)
            self.inner, self.npu_graph = torch_graph, torch_graph.graph
        else:
            self.runtime = emulated_npu
            self.inner = self.npu_graph = emulated_npu.NPUGraph()
        self.captured = captured if captured is not None else weakref.WeakSet()
        self.piece = False  # a piece of a piecewise graph (the plugin sets it)
        self._open: contextlib.ExitStack | None = None
        self._capture: AttentionCapture | None = None
        self._records_before = 0
        self._replayed: Any = None  # an event recorded on the replay stream after the last replay

    def capture_begin(self, pool: Any = None) -> None:
        with contextlib.ExitStack() as stack:
            if self.update_path == "graph_update":
                # As torch.npu.graph does: torch_npu records FIA calls through
                # its dispatch mode, entered around the capture and left after
                # capture_end, however the capture ends.
                self.npu_graph.auto_dispatch_capture = True
                mode = self.npu_graph.graph_dispatch_mode
                stack.enter_context(mode)
                self._records_before = len(mode.graph_dispatch_records)
            self.inner.capture_begin(pool)
            stack.callback(self.inner.capture_end)
            # Shared by every graph, as torch_npu's update stream is.
            update_stream = _update_stream(self.runtime)
            self._capture = stack.enter_context(
                AttentionCapture(self.runtime, self.calls, self.update_path, update_stream)
            )
            self._open = stack.pop_all()

    def capture_end(self) -> None:
        stack, self._open = self._open, None
        if stack is None:
            raise CaptureError("capture_end without capture_begin")
        stack.close()
        self._check_recorded()
        self.captured.add(self)

    def _check_recorded(self) -> None:
        """On the graph_update path torch_npu must have recorded every FIA
        call, or graph.update would leave some with their capture-time lengths."""
        assert self._capture is not None
        if self.update_path != "graph_update":
            return
        seen = self._capture.seen
        recorded = len(self.npu_graph.graph_dispatch_mode.graph_dispatch_records) - self._records_before
        if recorded != seen:
            self.inner.reset()
            raise CaptureError(
                f"torch_npu recorded {recorded} of the {seen} npu_fused_infer_attention_score calls "
                f"captured, so graph.update would leave {seen - recorded} of them with their "
                "capture-time kv lengths. torch_npu records the functional (.default) form since its "
                "September 2025 fix (2.1.0.post17, 2.6.0.post3, 2.7.1.post1, 2.8.0.post1, 2.9.0 and later "
                "in each line): upgrade torch_npu, or set vendor_options={'update_path': 'task_group'}"
            )

    def push_kv_lengths(self, lengths: list[int]) -> None:
        """Give every captured attention task this step's kv lengths."""
        if self._capture is None:
            raise ReplayError("push_kv_lengths on an Ascend graph that was never captured")
        if self._capture.seen == 0:
            return  # no attention call: nothing holds kv lengths
        # The last replay must be done with the tasks' parameters first: the
        # update stream waits for it on the device, the host goes on.
        if self.update_path == "graph_update":
            self._after_last_replay(self.npu_graph.graph_dispatch_mode.update_stream)
            self.npu_graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])
        else:
            self._after_last_replay(self._capture.update_stream)
            self._capture.update(lengths)

    def _after_last_replay(self, update_stream: Any) -> None:
        """Order the work issued next on ``update_stream`` after the last
        replay (its attention tasks have read their lengths), without a
        host wait."""
        if self._replayed is not None:
            update_stream.wait_event(self._replayed)

    def replay(self) -> None:
        self.inner.replay()
        if self._capture is not None and self._capture.seen:  # a later update waits for this replay
            if self._replayed is None:
                self._replayed = self.runtime.Event()
            self._replayed.record(self.runtime.current_stream())

    def reset(self) -> None:
        self.inner.reset()
        self._capture = None
        self._replayed = None
        self.captured.discard(self)

    def pool(self) -> Any:
        return self.inner.pool()

    def debug_dump(self, path: str) -> None:
        self.inner.debug_dump(path)

    def enable_debug_mode(self) -> None:
        self.inner.enable_debug_mode()


_update_streams: dict[int, Any] = {}


def _update_stream(runtime: Any) -> Any:
    """One update stream per runtime, created on first use."""
    key = id(runtime)
    if key not in _update_streams:
        _update_streams[key] = runtime.Stream()
    return _update_streams[key]

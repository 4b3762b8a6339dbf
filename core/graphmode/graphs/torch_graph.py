"""Adapters from PyTorch's graph classes to :class:`DeviceGraph`.

``torch.accelerator.Graph`` (PyTorch 2.12+) is used where the device is the
current accelerator and torch registered a graph implementation for its type
(in 2.12 to 2.15, XPU only); otherwise the device module's own class, found by name
(``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``, ``torch.mlu.MLUGraph``,
``torch.xpu.XPUGraph``). Capture always runs on a side stream, one per device,
shared by all graphs so that they can share one memory pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

from graphmode.device_graph import DeviceGraph
from graphmode.errors import CaptureError

__all__ = [
    "AcceleratorGraph",
    "TorchGraph",
    "accelerator_graph_available",
    "any_stream_capturing",
    "give_back_memory",
    "make_device_graph",
    "stream_capturing",
]

_capture_streams: dict[torch.device, Any] = {}

# The capture modes of torch.accelerator.Graph (and of CUDAGraph.capture_begin).
CaptureErrorMode = Literal["default", "global", "thread_local", "relaxed"]


def _capture_stream(device: torch.device, make: Any) -> Any:
    if device not in _capture_streams:
        _capture_streams[device] = make()
    return _capture_streams[device]


def drop_blas_workspaces(device: torch.device) -> None:
    """Drop cuBLAS's cached workspaces: before a CUDA capture, so that the
    capture's first matmul allocates its workspace in the graph's own pool;
    and once a runner's graphs are dropped (``runner.sleep()``,
    ``runner.reset()``), because the map still holds the last capture's
    workspace, a block of that pool, and one live block keeps its whole
    segment from the driver: on an H200 (2026-12-02) 254 MiB of the bench
    model's 266 MiB of graph memory stayed mapped after ``sleep()``. Safe
    with other runners' graphs alive: a workspace freed from its pool is
    scratch memory that only captures into the same pool reuse, as they
    reuse each other's intermediates (their replays never overlap).

    cuBLAS keeps one workspace per (handle, stream), owned by a process-wide
    map, and a captured matmul keeps its address. The capture stream is one
    per device for the process, so without this every graph would use the
    workspace made at the process's first capture, in the first graph's pool.
    Anyone may clear the map (``torch.compile``'s CUDA graph trees do, around
    every recording): the workspace is then freed, and once its pool is
    released (that first runner reset) or the memory reused, every graph's
    matmuls write into memory that is gone or holds other tensors. Seen on an
    H100: "an illegal memory access" at the first replay after a
    reduce-overhead compile, in 5 of 8 processes. A workspace in this graph's
    pool stays mapped while the graph lives, whoever clears the map.

    torch 2.15 caches no workspace by default: each cuBLAS(Lt) call takes its
    workspace from the caching allocator (in a capture, from the graph's
    pool), the map stays empty and this clears nothing. It still matters on
    torch < 2.15 and with ``TORCH_CUBLAS_WORKSPACE_CACHE=1``, which brings the
    cache back (docs/vendors/cuda.md, "torch 2.14 and 2.15")."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type == "cuda" and clear is not None and not _workspaces_kept:
        clear()


def give_back_memory(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back to the driver, cuBLAS's
    cached workspace (the last capture's, in a pool just released) first:
    after a runner dropped its graphs (``reset()``, ``sleep()``)."""
    drop_blas_workspaces(device)
    empty = getattr(getattr(torch, device.type, None), "empty_cache", None)
    if device.type != "cpu" and callable(empty):
        empty()


_workspaces_kept = 0  # keep_blas_workspaces blocks entered and not left


@contextlib.contextmanager
def keep_blas_workspaces() -> Iterator[None]:
    """Within: :func:`drop_blas_workspaces` clears nothing. For a process
    where graphs graphmode did not capture hold cuBLAS workspaces outside any
    pool (lmdeploy's piecewise graphs warm up eagerly on their own stream,
    then capture that stream's workspace): clearing the map would free memory
    those graphs write into at every replay. graphmode's captures then reuse
    the capture stream's workspace, which the map keeps alive."""
    global _workspaces_kept
    _workspaces_kept += 1
    try:
        yield
    finally:
        _workspaces_kept -= 1


def stream_capturing(device_type: str) -> bool:
    """Whether a graph capture is under way on the current stream of
    ``device_type``'s runtime, asked of that runtime: its device module's
    ``is_current_stream_capturing`` (``torch.cuda``'s for cuda, and so for
    MACA and PPU; ``torch.npu``'s from torch_npu, ``torch.mlu``'s from
    torch_mlu). Each runtime sees only its own streams. False where torch has
    no such module (its extension not imported), the module has no such
    function, or no device of the type is available."""
    module: Any = getattr(torch, device_type, None)
    check = getattr(module, "is_current_stream_capturing", None)
    if check is None or not module.is_available():
        return False
    return bool(check())


#: Device types whose runtimes are asked by :func:`any_stream_capturing`,
#: besides the out-of-tree backend's (``torch._C._get_privateuse1_backend_name()``,
#: which torch_npu renames to "npu").
CAPTURE_DEVICE_TYPES = ("cuda", "npu", "mlu", "xpu")


def any_stream_capturing() -> bool:
    """Whether any loaded device runtime is capturing on its current stream
    (:func:`stream_capturing` of each type in :data:`CAPTURE_DEVICE_TYPES`
    and of the out-of-tree backend). The CPU emulator's capture is not a
    stream capture: ask ``graphmode.emulator.current_session()`` for it."""
    types = dict.fromkeys((*CAPTURE_DEVICE_TYPES, torch._C._get_privateuse1_backend_name()))
    return any(stream_capturing(device_type) for device_type in types)


def _device_module(device: torch.device) -> Any:
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "synchronize"):
        raise CaptureError(
            f"torch has no device module for {device.type!r}; install the "
            "vendor's torch extension or run with execute_mode='eager'"
        )
    return module


class TorchGraph(DeviceGraph):
    """Wraps a graph class with ``torch.cuda.CUDAGraph``'s interface.

    capture_kwargs are passed to ``capture_begin`` (torch_npu's NPUGraph, for
    instance, needs none; its dispatch-capture switch lives on the object).
    """

    def __init__(
        self,
        device: torch.device,
        graph: Any = None,
        *,
        capture_error_mode: str = "thread_local",
    ) -> None:
        self.device = torch.device(device)
        if self.device.index is None:
            module = _device_module(self.device)
            self.device = torch.device(self.device.type, module.current_device())
        self.module = _device_module(self.device)
        if graph is None:
            graph_class = getattr(self.module, f"{self.device.type.upper()}Graph", None)
            if graph_class is None:
                raise CaptureError(
                    f"torch.{self.device.type} has no graph class; a vendor "
                    "plugin must implement graphmode_make_graph for this device"
                )
            graph = graph_class()
        self.graph = graph
        self.capture_error_mode = capture_error_mode
        self._stream_context: Any = None

    def capture_begin(self, pool: Any = None) -> None:
        self.module.synchronize(self.device)
        stream = _capture_stream(self.device, lambda: self.module.Stream(device=self.device))
        self._stream_context = self.module.stream(stream)
        self._stream_context.__enter__()
        try:
            drop_blas_workspaces(self.device)
            self.graph.capture_begin(pool=pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self._leave_stream()
            raise

    def capture_end(self) -> None:
        try:
            self.graph.capture_end()
        finally:
            self._leave_stream()

    def _leave_stream(self) -> None:
        if self._stream_context is not None:
            context, self._stream_context = self._stream_context, None
            context.__exit__(None, None, None)

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()

    def pool(self) -> Any:
        return self.graph.pool()

    def debug_dump(self, path: str) -> None:
        self.graph.debug_dump(path)

    def enable_debug_mode(self) -> None:
        """The graph class's ``enable_debug_mode()`` where it has one
        (``torch.cuda.CUDAGraph``, ``torch.mlu.MLUGraph``,
        ``torch.accelerator.Graph``; torch_npu's ``NPUGraph`` dumps without)."""
        enable = getattr(self.graph, "enable_debug_mode", None)
        if enable is not None:
            enable()


class AcceleratorGraph(TorchGraph):
    """``torch.accelerator.Graph`` (PyTorch 2.12+): the pool and the capture
    mode are set on the object rather than passed to ``capture_begin``."""

    def __init__(self, device: torch.device, *, capture_error_mode: CaptureErrorMode = "thread_local") -> None:
        graph = torch.accelerator.Graph(capture_error_mode=capture_error_mode)
        super().__init__(device, graph, capture_error_mode=capture_error_mode)

    def capture_begin(self, pool: Any = None) -> None:
        self.module.synchronize(self.device)
        stream = _capture_stream(self.device, lambda: torch.Stream(device=self.device))
        self.graph.graph_pool = pool
        self._stream_context = stream
        stream.__enter__()
        try:
            drop_blas_workspaces(self.device)
            self.graph.capture_begin()
        except BaseException:
            self._leave_stream()
            raise


# The answer for each device type, once probed: torch registers graph
# implementations when its backend libraries load, so it does not change
# within a process.
_graph_impl_registered: dict[str, bool] = {}

# ATen's refusal when no implementation is registered for the device type
# (aten/src/ATen/accelerator/Graph.cpp in pytorch/pytorch).
_NO_GRAPH_IMPL = "Graph is not supported on device type"


def _accelerator_graph_impl_registered(device_type: str) -> bool:
    """Whether torch registered a ``torch.accelerator.Graph`` implementation
    for the current accelerator, whose type is ``device_type``.

    The class exists in torch 2.12+ for every device, but ATen's constructor
    checks ``at::has_graph_impl(device_type)`` and raises "Graph is not
    supported on device type" where none is registered: in 2.12 to 2.15 only
    XPU registers one, not CUDA (and so not MACA or PPU, which run on torch's
    CUDA device type). torch exposes no predicate for it to Python, so this
    constructs one graph, once per device type, and keeps the answer. Any other
    error is raised: it is not an answer to this question.
    """
    if device_type not in _graph_impl_registered:
        try:
            torch.accelerator.Graph()
        except RuntimeError as error:
            if _NO_GRAPH_IMPL not in str(error):
                raise
            _graph_impl_registered[device_type] = False
        else:
            _graph_impl_registered[device_type] = True
    return _graph_impl_registered[device_type]


def accelerator_graph_available(device: torch.device) -> bool:
    """Whether ``torch.accelerator.Graph`` drives graphs on ``device``: torch
    has the class (2.12+), ``device`` is of the current accelerator's type, and
    torch registered a graph implementation for that type."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "Graph"):
        return False
    if not accelerator.is_available():
        return False
    current = accelerator.current_accelerator()
    if current is None or current.type != torch.device(device).type:
        return False
    return _accelerator_graph_impl_registered(current.type)


def make_device_graph(device: torch.device) -> DeviceGraph:
    """The default graph for a device: the emulator on the CPU, else the
    accelerator graph where registered, else the device module's class."""
    device = torch.device(device)
    if device.type == "cpu":
        from graphmode.emulator import EmulatedGraph

        return EmulatedGraph()
    if accelerator_graph_available(device):
        return AcceleratorGraph(device)
    return TorchGraph(device)

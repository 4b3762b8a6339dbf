"""Adapters from PyTorch's graph classes to :class:`DeviceGraph`.

``torch.accelerator.Graph`` (PyTorch 2.12+) is used where the device is the
current accelerator; otherwise the device module's own class, found by name
(``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``, ``torch.mlu.MLUGraph``,
``torch.xpu.XPUGraph``). Capture always runs on a side stream, one per device,
shared by all graphs so that they can share one memory pool.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmode.errors import CaptureError
from graphmode.graphs.base import DeviceGraph

__all__ = ["AcceleratorGraph", "TorchGraph", "accelerator_graph_available", "make_device_graph"]

_capture_streams: dict[torch.device, Any] = {}


def _capture_stream(device: torch.device, make: Any) -> Any:
    if device not in _capture_streams:
        _capture_streams[device] = make()
    return _capture_streams[device]


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


class AcceleratorGraph(TorchGraph):
    """``torch.accelerator.Graph`` (PyTorch 2.12+): the pool and the capture
    mode are set on the object rather than passed to ``capture_begin``."""

    def __init__(self, device: torch.device, *, capture_error_mode: str = "thread_local") -> None:
        graph = torch.accelerator.Graph(capture_error_mode=capture_error_mode)
        super().__init__(device, graph, capture_error_mode=capture_error_mode)

    def capture_begin(self, pool: Any = None) -> None:
        self.module.synchronize(self.device)
        stream = _capture_stream(self.device, lambda: torch.Stream(device=self.device))
        self.graph.graph_pool = pool
        self._stream_context = stream
        stream.__enter__()
        try:
            self.graph.capture_begin()
        except BaseException:
            self._leave_stream()
            raise


def accelerator_graph_available(device: torch.device) -> bool:
    """Whether ``torch.accelerator.Graph`` drives graphs on ``device``."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "Graph"):
        return False
    if not accelerator.is_available():
        return False
    current = accelerator.current_accelerator()
    return current is not None and current.type == torch.device(device).type


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

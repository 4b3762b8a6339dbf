"""A real torch accelerator on the CPU, to choose between graph classes with.

Run as a script in its own process (the accelerator cannot be unregistered):
it registers torch's Python PrivateUse1 backend under the name ``pyaccel``
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``,
the way pytorch/pytorch's test/test_privateuseone_python_backend.py does), so
that ``torch.accelerator`` reports it as the current accelerator. With
``--graph-impl`` it first builds and loads a C++ graph implementation for it,
registered with ATen's ``REGISTER_GRAPH_IMPL`` exactly as a backend registers
its own (aten/src/ATen/core/GraphImplInterface.h); without, ``pyaccel`` has
none, as CUDA has none in torch 2.12 and 2.13, and ATen's
``torch.accelerator.Graph()`` raises "Graph is not supported on device type".

It then asks graphmode for the device graph of ``pyaccel:0``, captures and
replays through it, and prints what happened as one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# The implementation writes every call it receives to its debug dump, so the
# caller can see what reached the backend through torch.accelerator.Graph.
GRAPH_IMPL_SOURCE = r"""
#include <ATen/core/GraphImplInterface.h>
#include <fstream>
#include <sstream>

namespace {

struct LoggingGraphImpl final : at::GraphImplInterface {
  explicit LoggingGraphImpl(const at::GraphImplArgs&) {}

  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode mode) override {
    pool_ = pool;
    log_ << "capture_begin pool=" << pool.first << "," << pool.second
         << " mode=" << static_cast<int>(mode) << "\n";
  }
  void capture_end() override { log_ << "capture_end\n"; }
  void instantiate() override { log_ << "instantiate\n"; }
  void replay() override { log_ << "replay\n"; }
  void reset() override { log_ << "reset\n"; }
  at::MempoolId_t pool() const override { return pool_; }
  void enable_debug_mode() override {}
  void debug_dump(const std::string& path) override { std::ofstream(path) << log_.str(); }

 private:
  at::MempoolId_t pool_{0, 0};
  std::ostringstream log_;
};

}  // namespace

namespace at {
REGISTER_GRAPH_IMPL(PYACCEL, LoggingGraphImpl)
}
"""


class PyAccelGraph:
    """``torch.pyaccel.PYACCELGraph``: the device module's own graph class,
    with ``torch.cuda.CUDAGraph``'s interface, logging the calls it receives
    to its debug dump like the C++ implementation above."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.log.append(f"capture_begin pool={pool[0]},{pool[1]} mode={capture_error_mode}")

    def capture_end(self) -> None:
        self.log.append("capture_end")

    def replay(self) -> None:
        self.log.append("replay")

    def debug_dump(self, path: str) -> None:
        Path(path).write_text("".join(f"{line}\n" for line in self.log))


class PyAccelModule:
    """``torch.pyaccel``: what torch and graphmode ask of a device module.

    Work runs on the host, so synchronizing has nothing to wait for; streams
    are torch's own (``torch.Stream`` on ``pyaccel``).
    """

    PYACCELGraph = PyAccelGraph
    Stream = torch.Stream

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def stream(self, stream: torch.Stream) -> torch.Stream:
        return stream  # torch.Stream is its own context manager


def load_graph_impl() -> None:
    """Build (cached under torch's extension directory) and load the graph
    implementation; loading the library registers it with ATen. ``load`` of
    a source file, not ``load_inline``, which prepends torch/extension.h
    (the whole C++ API and Python's headers: 38 s of compiling on a CI
    machine, against 3 s for the one header the source includes)."""
    from torch.utils.cpp_extension import load

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "graphmode_pyaccel_graph.cpp"
        source.write_text(GRAPH_IMPL_SOURCE)
        load("graphmode_pyaccel_graph", sources=[str(source)], is_python_module=False)


def main(argv: list[str]) -> None:
    if "--graph-impl" in argv:
        load_graph_impl()
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend("pyaccel", backend_module=PyAccelModule())

    from graphmode.graphs import accelerator_graph_available, make_device_graph

    device = torch.device("pyaccel", 0)
    graph = make_device_graph(device)
    graph.capture_begin(pool=(5, 1))
    graph.capture_end()
    graph.replay()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "graph.log"
        graph.debug_dump(str(dump))
        backend_log = dump.read_text().splitlines()
    print(json.dumps({
        "accelerator_graph_available": accelerator_graph_available(device),
        "adapter": type(graph).__name__,
        "graph_class": type(getattr(graph, "graph", graph)).__qualname__,
        "backend_log": backend_log,
    }))


if __name__ == "__main__":
    main(sys.argv[1:])

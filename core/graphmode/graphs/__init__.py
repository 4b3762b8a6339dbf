"""Device graphs: the interface the runner uses, and its PyTorch adapters."""

from graphmode.device_graph import DeviceGraph
from graphmode.graphs.torch_graph import (
    AcceleratorGraph,
    TorchGraph,
    accelerator_graph_available,
    make_device_graph,
)

__all__ = [
    "AcceleratorGraph",
    "DeviceGraph",
    "TorchGraph",
    "accelerator_graph_available",
    "make_device_graph",
]

"""Graph memory: what a runner's graphs take on the device, planned before
the KV cache exists (``GraphRunner.plan_memory``,
``graphmode.plan_graph_memory``) and measured at every warm-up
(``GraphRunner.graph_memory``). See docs/engines.md, "Graph memory before the
KV cache"."""

from graphmode.memory.meter import MemoryMeter
from graphmode.memory.plan import GraphMemory, MemoryPlan

__all__ = ["GraphMemory", "MemoryMeter", "MemoryPlan"]

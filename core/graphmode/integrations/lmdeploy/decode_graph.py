"""One lmdeploy decode graph: a bucket's buffers, capture and replay.

The buffers are the model's own (lmdeploy's ``CudaGraphMixin``:
``make_buffers_cudagraph``, ``fill_buffers_cudagraph``,
``update_context_cudagraph``, ``get_outputs_cudagraph``), so a model that
adds inputs of its own (M-RoPE positions, SSM state ids, vision embeddings,
FA3 or FlashMLA scheduler metadata) keeps them. The device graph and its
memory pool are graphmode's vendor's (``graphmode_make_graph``): CUDA
graphs on CUDA, the vendor's graph class elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphmode.graphs import DeviceGraph

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """The graph of one key (bucket, query length, microbatch, the model's
    extra key) and the lmdeploy ``CudaGraphMeta`` holding its buffers.

    ``capture`` allocates the buffers, runs the padded step once eagerly
    (lazy kernel set-up happens outside the graph) and records it;
    ``replay`` refills the buffers and replays. Both return the step's
    outputs cut to its live tokens by the model (``get_outputs_cudagraph``).
    The first call returns the eager warm-up's outputs, as lmdeploy's own
    runner does, so that a stateful (SSM) model's state advances once.
    """

    def __init__(self, model: Any, forward: Callable[..., Any], graph_meta: Any, graph: DeviceGraph) -> None:
        self.model = model
        self.forward = forward
        self.meta = graph_meta
        self.graph = graph
        self._ctx_mgr = model.ctx_mgr

    def _bind(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Fill the buffers from this step and point the step context at them."""
        padded = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self.model.update_context_cudagraph(self.meta, self._ctx_mgr.current_context())
        return padded

    def capture(self, kwargs: dict[str, Any], pool: Any) -> Any:
        """Capture this key's graph from the step ``kwargs`` into ``pool``
        (another graph's pool token, or None for a new pool)."""
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded = self._bind(kwargs)
        warm = self.model.make_output_buffers(self.forward(**padded))
        plan = self.meta.step_meta_plan
        if plan is not None:  # the CUDA backend's per-implementation metadata, fixed before recording
            plan.prepare_cudagraph_capture(self.meta, self.meta.input_buffers, self._ctx_mgr.current_context(),
                                           self.meta.step_meta_buffers, padded["attn_metadata"])
        with self.graph.capture(pool):
            output = self.forward(**padded)
        self.meta.output_buffers = self.model.make_output_buffers(output)
        return self.model.get_outputs_cudagraph(warm, **kwargs)

    def replay(self, kwargs: dict[str, Any]) -> Any:
        """Refill the buffers from ``kwargs`` and replay."""
        self._bind(kwargs)
        self.graph.replay()
        return self.model.get_outputs_cudagraph(self.meta.output_buffers, **kwargs)

    def release(self) -> None:
        """Drop the recorded work and the buffers (their memory goes back to
        the pool's allocator once every graph of the pool is released)."""
        self.graph.reset()
        self.meta.input_buffers = {}
        self.meta.output_buffers = {}

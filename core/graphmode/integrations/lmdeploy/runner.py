"""LmdeployGraphRunner: lmdeploy's graph runner, built by graphmode.

lmdeploy's engine calls its graph runner instead of its model for every
forward (``ModelAgent``, the speculative agent's proposer, the memory-decode
agent). This runner takes lmdeploy's decode steps into graphmode's decode
graphs, one per bucket of graphmode's vendor, with the model's own buffers
(``decode_graph.DecodeGraph``); every other step (prefill, mixed, steps the
model does not graph) goes to lmdeploy's own runner, built beside it, which
runs it eagerly or in lmdeploy's piecewise graphs where lmdeploy enables them
(``piecewise_cudagraph_max_tokens``). graphmode counts each kind in
``runner.stats``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
from lmdeploy.pytorch.backends.cuda.graph_runner.full_graph import _make_graph_meta, build_decode_model_forward
from lmdeploy.pytorch.backends.cuda.graph_runner.runner import _update_deepep_mode
from lmdeploy.pytorch.backends.graph_runner import GraphRunner

from graphmode.buckets import bucket_table
from graphmode.config import RunnerConfig, resolve_debug, resolve_execute_mode
from graphmode.errors import ConfigError, InputError
from graphmode.families.stats import RunnerStats
from graphmode.graphs.torch_graph import give_back_memory, keep_blas_workspaces
from graphmode.integrations.lmdeploy.decode_graph import DecodeGraph
from graphmode.integrations.lmdeploy.step_checks import check_decode_step
from graphmode.meta import GraphMeta
from graphmode.plugins import select_vendor
from graphmode.runner.setup import capture_sizes, configure

__all__ = ["LmdeployGraphRunner", "Settings"]

logger = logging.getLogger("graphmode.lmdeploy")

#: graphmode's vendor for each lmdeploy device type whose graph runner it
#: builds: the device types whose lmdeploy backend graphs decode steps with
#: the model's ``CudaGraphMixin`` buffers (CUDA's runner, which lmdeploy's
#: Camb and MACA backends reuse).
VENDOR_OF_DEVICE_TYPE = {"cuda": "cuda", "camb": "camb", "maca": "maca"}

#: Device types lmdeploy graphs another way, and why graphmode leaves them.
NOT_TAKEN_OVER = {
    "ascend": "lmdeploy's Ascend backend graphs decode steps with dlinfer's AscendGraphRunner, whose buffers and "
              "kv-length updates follow dlinfer's own contract, not the model's CudaGraphMixin buffers that "
              "graphmode drives",
}

#: Execute modes of the integration; the others of graphmode are refused.
MODES = ("graph", "full_and_piecewise", "eager")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``enable()`` was asked for: the execute mode (``$GRAPHMODE_EXECUTE_MODE``
    wins), debug mode (``$GRAPHMODE_DEBUG`` wins), and a vendor name that
    overrides the one lmdeploy's device type chooses (None: chosen)."""

    execute_mode: str | None = None
    debug: bool = False
    vendor: str | None = None


class LmdeployGraphRunner(GraphRunner):
    """lmdeploy's ``GraphRunner``, serving decode steps from graphmode's graphs.

    own: the runner lmdeploy built for the same model; the steps graphmode
    does not graph run through it, exactly as without graphmode.
    """

    def __init__(self, own: Any, model: Any, model_config: Any, cache_config: Any,
                 backend_config: Any, device: torch.device, settings: Settings) -> None:
        super().__init__(model, model_config, cache_config, backend_config, device)
        self.own = own
        self.mode = resolve_execute_mode(settings.execute_mode)
        if self.mode not in MODES:
            raise ConfigError(
                f"execute_mode={self.mode!r} in lmdeploy: graphmode graphs lmdeploy's decode steps "
                f"({', '.join(MODES)}); piecewise-only has no decode graphs and lmdeploy's prefill attention is "
                "lmdeploy's own, which graphmode's piecewise graphs cannot break at. Use 'graph' or "
                "'full_and_piecewise'"
            )
        device_type = backend_config.device_type
        vendor_name = settings.vendor or VENDOR_OF_DEVICE_TYPE[device_type]
        self.vendor = select_vendor(vendor_name, device)
        max_batches = cache_config.max_batches
        self.num_blocks = cache_config.num_gpu_blocks
        self._reserved_blocks = getattr(cache_config, "num_reserved_gpu_blocks", 0)
        # lmdeploy's own buckets, as the vendor keeps them (it may trim, never add).
        self.config = RunnerConfig(
            max_batches=max_batches,
            max_blocks_per_seq=max(self.num_blocks, 1),
            block_size=cache_config.block_size,
            device=torch.device(device),
            execute_mode=self.mode,
            capture_batch_sizes=tuple(own.get_capture_batch_sizes()),
            debug=resolve_debug(settings.debug),
        )
        spec = configure(self.vendor, self.config)
        self.capture_sizes = capture_sizes(self.vendor, self.config, spec)
        self._bucket_of = bucket_table(self.vendor, max_batches, self.capture_sizes)
        self.stats = RunnerStats()
        self._counts = self.stats.family("full")  # its decode graphs are full graphs' counters
        #: bytes the decode graphs' pool took from the device, by bucket key
        self.graph_memory: dict[tuple[Any, ...], int] = {}
        #: host seconds spent capturing (the warm-up forward included), since the last reset
        self.capture_seconds = 0.0
        self._graphs: dict[tuple[Any, ...], DecodeGraph] = {}
        self._pool: Any = None
        self._strategy = model.ctx_mgr.build_ctx.strategy_factory.build_cudagraph_strategy()
        self._forward: Any = build_decode_model_forward(model) if device_type == "cuda" else model
        self._graphs_decode = self.mode != "eager" and not backend_config.eager_mode
        self._model_graphs = getattr(model, "support_cuda_graph", None)
        #: lmdeploy's piecewise graphs (``piecewise_cudagraph_max_tokens``) capture a cuBLAS workspace made
        #: outside any pool: graphmode's captures and resets must then leave cuBLAS's workspace map alone.
        self._keep_workspaces = getattr(own, "_piecewise_graph_manager", None) is not None
        if self.mode == "full_and_piecewise":
            logger.warning(
                "graphmode in lmdeploy: execute_mode='full_and_piecewise' graphs decode steps in graphmode's full "
                "graphs; prefill and mixed steps run lmdeploy's own way (%s), because graphmode's piecewise graphs "
                "break at graphmode's AttentionOps and lmdeploy's attention is its own",
                "its piecewise graphs" if getattr(own, "_piecewise_graph_manager", None) is not None else "eagerly")

    # -- the step ---------------------------------------------------------

    def __call__(self, **kwargs: Any) -> Any:
        attn = kwargs["attn_metadata"]
        if attn.block_offsets.dtype != torch.int32:  # lmdeploy's kernels (FlashMLA) take int32 tables
            attn.block_offsets = attn.block_offsets.to(torch.int32)
        context = self.ctx_mgr.current_context()
        if not context.global_is_decoding():
            self.stats.eager_steps["prefill"] += 1
            return self.own(**kwargs)
        # What lmdeploy's runner does first for every forward (own() above does it for prefill): DeepEP's
        # low-latency mode for decode, which clears the buffer a normal-mode prefill left.
        _update_deepep_mode(context)
        if not self._graphs_decode:
            return self._eager("eager_mode", kwargs)
        if self._model_graphs is None or not self._model_graphs(**kwargs):
            return self._eager("model_refuses_graph", kwargs)
        batch = attn.q_seqlens.size(0)
        padded_to = self._runner_meta.padding_batch_size or batch
        bucket = self._bucket_of[padded_to] if padded_to < len(self._bucket_of) else None
        if bucket is None:
            return self._eager("batch_too_large", kwargs)
        num_tokens = kwargs["input_ids"].size(1)
        q_len = num_tokens // batch
        if self.config.debug and not context.is_dummy:  # lmdeploy's warm-up steps read the reserved block 0
            check_decode_step(kwargs, bucket, q_len, self.num_blocks, self.config.block_size, self._reserved_blocks)
        key = (bucket, q_len, context.enable_microbatch, *self.model.get_cudagraph_extra_key(**kwargs))
        graph = self._graphs.get(key)
        if graph is None:
            output = self._capture(key, kwargs, batch, num_tokens)
            if context.is_dummy:  # lmdeploy's warm-up (and a data-parallel rank's dummy step): no tokens served
                self._counts.warmup_captures += 1
        else:
            output = graph.replay(kwargs)
            self._counts.replays += 1
            self._counts.replays_by_q_len[q_len] += 1
        self._counts.real_tokens += num_tokens
        self._counts.padded_tokens += (bucket - batch) * q_len
        return output

    def _eager(self, reason: str, kwargs: dict[str, Any]) -> Any:
        """A decode step graphmode does not graph, run eagerly (never through
        lmdeploy's own runner, which would capture graphs of its own)."""
        self.stats.eager_steps[reason] += 1
        return self.model.make_output_buffers(self.model(**kwargs))

    def _capture(self, key: tuple[Any, ...], kwargs: dict[str, Any], batch: int, num_tokens: int) -> Any:
        bucket, q_len = key[0], key[1]
        max_tokens = self._strategy.get_max_tokens(bucket, batch, num_tokens)
        graph_meta = _make_graph_meta(
            self.model_config, self.ctx_mgr, max_batches=bucket, max_tokens=max_tokens, num_blocks=self.num_blocks,
            is_decoding=True, decode_query_len=q_len, device=self.device)
        device_graph = self.vendor.hook.graphmode_make_graph(meta=GraphMeta(
            max_batchs=bucket, max_tokens=max(max_tokens, bucket), num_blocks=max(self.num_blocks, 1),
            block_size=self.config.block_size, device=self.device, capture_sizes=self.capture_sizes,
            vendor_options=self.config.vendor_options))
        if device_graph is None:
            raise ConfigError(f"vendor {self.vendor.name!r}: graphmode_make_graph returned None for {self.device}")
        graph = DecodeGraph(self.model, self._forward, graph_meta, device_graph)
        reserved = _reserved(self.device)
        start = time.perf_counter()
        try:
            with keep_blas_workspaces() if self._keep_workspaces else contextlib.nullcontext():
                output = graph.capture(kwargs, self._pool)
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"graphmode (lmdeploy integration): capturing the decode graph of bucket {bucket}, "
                               f"q_len {q_len}, vendor {self.vendor.name!r}")
            raise
        self.capture_seconds += time.perf_counter() - start
        if self._pool is None:
            self._pool = device_graph.pool()
        self.graph_memory[key] = _reserved(self.device) - reserved
        self._graphs[key] = graph
        self._counts.captures += 1
        return output

    # -- what lmdeploy's engine asks of its runner ---------------------------

    def get_capture_batch_sizes(self) -> list[int]:
        """The buckets lmdeploy's warm-up runs a dummy decode step of, so that
        it captures every graph graphmode will replay."""
        return list(self.capture_sizes)

    def get_prefill_warmup_token_sizes(self) -> list[int]:
        """lmdeploy's own prefill warm-up (its piecewise plans, when on)."""
        return list(self.own.get_prefill_warmup_token_sizes())

    def update_inputs(self, inputs: Any) -> Any:
        """Data-parallel ranks agree on the tokens of the padded step: the
        bucket graphmode will replay, times the query length."""
        if not self._graphs_decode:  # decode steps run eagerly: no padding to agree on, as lmdeploy's eager mode
            return inputs
        dp_meta = inputs.dp_meta
        if inputs.global_is_decoding() and dp_meta is not None:
            padded_to = self._runner_meta.padding_batch_size
            if padded_to is None or padded_to >= len(self._bucket_of) or self._bucket_of[padded_to] is None:
                raise InputError(
                    f"lmdeploy padded a data-parallel decode step to {padded_to} sequences, past graphmode's largest "
                    f"bucket {self.capture_sizes[-1]}; raise max_batch_size or capture up to it")
            query_len = inputs.input_ids.numel() // inputs.seq_length.size(0)
            dp_meta.sync_tp_size(self._bucket_of[padded_to] * query_len)
        return inputs

    def reset(self) -> None:
        """Drop every graph, its buffers and the pool (lmdeploy calls this on
        sleep, release and the weight updates it finalises itself); the next
        decode step of a bucket, or lmdeploy's next warm-up, captures it
        again. The pool's memory goes back to the driver, cuBLAS's cached
        workspace (the last capture's, in the pool) first, unless lmdeploy's
        piecewise graphs hold a workspace of that map."""
        super().reset()
        for graph in self._graphs.values():
            graph.release()
        self._graphs.clear()
        self.graph_memory.clear()
        self.capture_seconds = 0.0
        self._pool = None
        self.own.reset()
        if not self._keep_workspaces:
            give_back_memory(torch.device(self.device))

    @property
    def graph_bytes(self) -> int:
        """What the decode graphs took from the device, in bytes."""
        return sum(self.graph_memory.values())


def _reserved(device: torch.device) -> int:
    """Bytes the device's caching allocator holds (0 where it has none)."""
    module = getattr(torch, torch.device(device).type, None)
    reserved = getattr(module, "memory_reserved", None)
    return int(reserved(device)) if callable(reserved) and torch.device(device).type != "cpu" else 0

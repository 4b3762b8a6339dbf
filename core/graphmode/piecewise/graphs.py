"""PiecewiseGraphs: a runner's piecewise graphs, one per token bucket.

A step of ``n`` tokens (prefill, mixed prefill and decode, or decode) runs in
the graph of the smallest token bucket >= ``n``: its ids and positions are
copied into static buffers (padding tokens: id 0, position 0), then each
segment replays and each break point between segments runs eagerly with the
step's own attention metadata on the live tokens (see ``breaks.py``). The
first step of a bucket captures it (``segments.py``); its answer is the
warm-up's. The graphs share the runner's memory pool with its full graphs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import ConfigError, InputError
from graphmode.piecewise import PIECEWISE_MODES
from graphmode.piecewise.breaks import LiveStep, find_attention_ops, intercepted
from graphmode.piecewise.compiled import SplitForward
from graphmode.piecewise.segments import BreakBuffers, CaptureForward, EagerForward, Pieces
from graphmode.piecewise.sizes import default_token_sizes, token_bucket
from graphmode.runner.cache_checks import CacheMemory, cache_flattener
from graphmode.runner.outputs import SharedOutputs
from graphmode.staging import to_device

if TYPE_CHECKING:
    from graphmode.runner import GraphRunner

__all__ = ["PIECEWISE_MODES", "PiecewiseGraph", "PiecewiseGraphs", "shape_only"]

#: Why a full-graph runner would run a step eagerly, that piecewise graphs take.
_NOT_FULL = ("prefill", "multi_token_decode", "mixed_q_len", "no_bucket")


@dataclass
class PiecewiseGraph:
    """One token bucket's captured forward, and what it captured by reference."""

    bucket: int
    pieces: Pieces
    output: Any
    cache_tensors: list[Any]
    flatten_cache: Callable[[Any], list[Any]]
    extras: dict[str, Any]

    def __post_init__(self) -> None:
        self.memory = CacheMemory(self.cache_tensors, self.flatten_cache)  # their data pointers, checked at every replay

    @property
    def name(self) -> str:
        """How errors name it: "token bucket 8 (piecewise)"."""
        return f"token bucket {self.bucket} (piecewise)"


class PiecewiseGraphs:
    """The piecewise half of a :class:`~graphmode.runner.GraphRunner` in
    execute mode "piecewise" or "full_and_piecewise"; the runner hands it
    the steps its full graphs do not take (:meth:`takes`)."""

    def __init__(self, runner: GraphRunner) -> None:
        config = runner.config
        if runner.rank_sync is not None:
            raise ConfigError(
                f"execute_mode={config.execute_mode!r} with a tensor-parallel process group: piecewise "
                "graphs do not yet make the ranks agree on token buckets, and a rank on another graph "
                "would hang the collectives. Use execute_mode='graph' with tensor parallelism"
            )
        self.runner = runner
        self.mode = config.execute_mode
        self.sizes = config.capture_token_sizes or default_token_sizes(config.max_batches)
        self.ops = find_attention_ops(runner.model)
        # What warm-ups and captures run: the model, or its compiled forward split at the break points.
        self._forward = SplitForward(runner._forward, self.ops) if runner._compiled else runner.model
        self._graphs: dict[int, PiecewiseGraph] = {}
        self._buffers = BreakBuffers(self.sizes[-1])
        self._outputs = SharedOutputs(self.sizes[-1])
        self._ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    # -- steps ---------------------------------------------------------------

    def takes(self, eager_reason: str | None) -> bool:
        """Whether a step the full-graph logic judged so runs piecewise."""
        if self.mode == "piecewise":
            return True
        return eager_reason in _NOT_FULL

    def bucket_of(self, tokens: int) -> int | None:
        """The token bucket a step of ``tokens`` tokens runs in, or None (eager)."""
        return token_bucket(tokens, self.sizes)

    @property
    def captured_buckets(self) -> list[int]:
        return list(self._graphs)

    def step(self, inputs: StepInputs, on_host: bool) -> Any:
        """Run one step: replay its bucket's graph, capture it first, or run
        eagerly when the step has more tokens than the largest bucket."""
        runner, stats = self.runner, self.runner.stats
        if on_host:
            inputs = to_device(inputs, runner.config.device)
        tokens = inputs.num_tokens
        bucket = self.bucket_of(tokens)
        if bucket is None:
            stats.eager_steps["no_token_bucket"] += 1
            return runner.model(**inputs.as_kwargs())
        live = LiveStep(inputs.attn_metadata, tokens, bucket)
        graph, debug = self._graphs.get(bucket), runner._debug
        if debug is not None:  # the same checks as a full graph's steps (graphmode.runner.debug)
            debug.check_step(inputs, inputs.attn_metadata.q_seqlens.shape[0], uniform=False)
        if graph is None:
            output = self._capture(inputs, live)
            stats.piecewise_captures += 1
        else:
            _check_same_objects(graph, inputs)
            if debug is not None:
                debug.check_addresses(graph.name, graph.cache_tensors, graph.extras)
            self._fill(inputs, bucket)
            graph.pieces.replay(live)
            output = graph.output
            stats.piecewise_replays += 1
        stats.real_tokens += tokens
        stats.padded_tokens += bucket - tokens
        return _live_columns(output, tokens)

    def _fill(self, inputs: StepInputs, bucket: int) -> None:
        """The step's ids and positions into the static buffers; the padding
        columns up to ``bucket`` get token 0 at position 0."""
        if self._ids is None or self._positions is None:
            shape, device = (1, self.sizes[-1]), self.runner.config.device
            self._ids = torch.zeros(shape, dtype=inputs.input_ids.dtype, device=device)
            self._positions = torch.zeros(shape, dtype=inputs.position_ids.dtype, device=device)
        tokens = inputs.num_tokens
        for buffer, values in ((self._ids, inputs.input_ids), (self._positions, inputs.position_ids)):
            buffer[:, :tokens].copy_(values)
            buffer[:, tokens:bucket].zero_()

    def _capture(self, inputs: StepInputs, live: LiveStep) -> Any:
        bucket, runner = live.bucket, self.runner
        self._fill(inputs, bucket)
        assert self._ids is not None and self._positions is not None
        static = StepInputs(
            self._ids[:, :bucket], self._positions[:, :bucket], inputs.past_key_values,
            shape_only(inputs.attn_metadata), dict(inputs.extras),
        )
        warm_up = EagerForward(live, self._buffers)
        started = time.perf_counter()
        try:
            with intercepted(self.ops, warm_up):
                warm_output = self._forward(**static.as_kwargs())  # compiles, with compile=True
        except RuntimeError as error:
            if "meta" in str(error) and hasattr(error, "add_note"):
                error.add_note(
                    "graphmode: in piecewise modes the model sees attn_metadata with tensors on the 'meta' "
                    "device, and only the AttentionOps calls get the step's real metadata: code between "
                    "them that reads attn_metadata would freeze one step's values into the graphs. Read "
                    "it only inside the vendor's AttentionOps, or use execute_mode='graph'"
                )
            raise
        if runner._compiled:
            runner.stats.compile_seconds += time.perf_counter() - started
        self._outputs.prepare(warm_output, bucket)
        # Plugins tell piecewise graphs from full ones (make_graph, capture
        # advice) by is_decoding False; their capture sizes are token sizes.
        hook = runner.vendor.hook
        meta = dataclasses.replace(runner.graph_meta(), is_decoding=False, capture_sizes=tuple(self.sizes))
        forward = CaptureForward(warm_up.views, lambda: hook.graphmode_make_graph(meta=meta), runner._pool)
        try:
            with intercepted(self.ops, forward), forward:
                output = self._outputs.publish(self._forward(**static.as_kwargs()), bucket)
        except Exception as error:
            advice = hook.graphmode_capture_error(error=error, meta=meta, bucket=bucket)
            if advice is not None:
                raise advice from error
            if hasattr(error, "add_note"):
                error.add_note(
                    f"graphmode: while capturing segment {len(forward.pieces.segments) + 1} of the piecewise "
                    f"graph of token bucket {bucket} ({runner.vendor.name})"
                )
            raise
        runner._pool = forward.pool  # one pool for every graph of the runner, full and piecewise
        flatten = cache_flattener(static.past_key_values)
        graph = self._graphs[bucket] = PiecewiseGraph(
            bucket, forward.pieces, output, flatten(static.past_key_values), flatten, dict(static.extras)
        )
        if runner._debug is not None:
            runner._debug.record(graph.name, graph.cache_tensors, graph.extras)
        return warm_output

    # -- whole-runner operations ------------------------------------------

    def warmup(self, past_key_values: Any, extras: dict[str, Any], report: Callable[[str, bool], None] | None) -> None:
        """Capture every token bucket not captured yet, largest first, from
        inert steps: one token per sequence, slot -1 (no KV write), reading
        the reserved block 0."""
        todo = [bucket for bucket in reversed(self.sizes) if bucket not in self._graphs]
        for index, bucket in enumerate(todo):
            if report is not None:
                report(f"capturing piecewise token bucket {bucket} ({index + 1}/{len(todo)})", index + 1 == len(todo))
            step = inert_step(bucket, self.runner.config.device, past_key_values, extras)
            self._capture(step, LiveStep(step.attn_metadata, bucket, bucket))
            self.runner.stats.piecewise_captures += 1

    def reset(self) -> None:
        """Drop every piecewise graph (the runner drops the pool)."""
        for graph in self._graphs.values():
            graph.pieces.reset()
        self._graphs.clear()
        self._outputs = SharedOutputs(self.sizes[-1])

    def graph(self, bucket: int) -> PiecewiseGraph | None:
        """The captured piecewise graph of a token bucket, if captured."""
        return self._graphs.get(bucket)


def shape_only(attn: AttnMetadata) -> AttnMetadata:
    """The metadata the model sees while a piecewise graph is captured: the
    same shapes and flags, but tensors on the ``meta`` device and maxima -1.

    Only the break points may read the step's metadata (they get the live
    one at every replay); a segment reading it would freeze the capture
    step's values into the graph. With meta tensors it fails at capture
    instead ("Tensor on device meta is not on the expected device")."""

    def ghost(tensor: torch.Tensor | None) -> Any:
        return None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    return attn.replace(
        block_offsets=ghost(attn.block_offsets),
        q_start_loc=ghost(attn.q_start_loc),
        q_seqlens=ghost(attn.q_seqlens),
        kv_seqlens=ghost(attn.kv_seqlens),
        kv_start_indices=ghost(attn.kv_start_indices),
        kv_seqlens_cpu=ghost(attn.kv_seqlens_cpu),
        x_active_mask=ghost(attn.x_active_mask),
        max_q_seq_len=-1,
        max_kv_seq_len=-1,
    )


def inert_step(tokens: int, device: torch.device, past_key_values: Any, extras: dict[str, Any]) -> StepInputs:
    """A decode step of ``tokens`` sequences that changes nothing: every slot
    -1, every row on the reserved block 0 with length 1."""
    int32 = torch.int32
    attn = AttnMetadata(
        is_decoding=True,
        block_offsets=torch.zeros((tokens, 1), dtype=int32, device=device),
        q_start_loc=torch.arange(tokens, dtype=int32, device=device),
        q_seqlens=torch.ones(tokens, dtype=int32, device=device),
        kv_seqlens=torch.ones(tokens, dtype=int32, device=device),
        kv_start_indices=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        max_q_seq_len=1,
        max_kv_seq_len=1,
        kv_seqlens_cpu=torch.ones(tokens, dtype=int32),
    )
    zeros = torch.zeros((1, tokens), dtype=torch.int64, device=device)
    return StepInputs(zeros, zeros.clone(), past_key_values, attn, dict(extras))


def _live_columns(output: Any, tokens: int) -> Any:
    """The output cut to the live tokens (dimension 1, the model contract)."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return leaf.narrow(1, 0, tokens)
        return leaf

    return tree_map(cut, output)


def _check_same_objects(graph: PiecewiseGraph, inputs: StepInputs) -> None:
    """The break points hold the KV-cache tensors and the segments the extra
    inputs they captured: refuse others rather than ignore them."""
    graph.memory.check(inputs.past_key_values, graph.name)
    for name in inputs.extras.keys() | graph.extras.keys():
        if inputs.extras.get(name) is not graph.extras.get(name):
            raise InputError(
                f"extra model input {name!r} is not the object the piecewise graph of token bucket "
                f"{graph.bucket} captured; graphs freeze extra inputs. Keep it fixed, or run eagerly"
            )

"""PiecewiseGraphs: the family of piecewise graphs, one per token bucket.

A step of ``n`` tokens (prefill, mixed prefill and decode, or decode) runs in
the graph of the smallest token bucket >= ``n``: its ids, positions and
declared step inputs are copied into static buffers (``inputs.py``), then
each segment replays and each break point between segments runs eagerly
with the step's own attention metadata on the live tokens (see
``breaks.py``). The first step of a bucket captures it (``segments.py``);
its answer is the warm-up's. The graphs share the runner's memory pool with
its full graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graphmode.checks.cache_checks import CacheMemory, cache_flattener, check_same_objects
from graphmode.checks.host_lengths import check_piecewise_step
from graphmode.checks.model_state import ModelState
from graphmode.context import KVCache, StepInputs
from graphmode.errors import CaptureError
from graphmode.families.common import (
    capture_failed,
    fresh_context,
    graph_name,
    inert_step,
    live_columns,
    note_replay_failure,
    row_names,
    unpadded_extras,
)
from graphmode.families.decision import StepDecision
from graphmode.families.family import Captured, Report, RunnerContext
from graphmode.families.outputs import SharedOutputs, check_token_dimension
from graphmode.families.piecewise.breaks import LiveStep, find_attention_ops, intercepted, writes_kv_in_graph
from graphmode.families.piecewise.compiled import SplitForward
from graphmode.families.piecewise.ghosts import OPS_AT_OPS, READ_INSIDE_OPS, GhostReads, shape_only
from graphmode.families.piecewise.inputs import TokenInputs
from graphmode.families.piecewise.segments import BreakBuffers, CaptureForward, EagerForward, Pieces
from graphmode.families.sleep import SleptGraph
from graphmode.graphs import DeviceGraph
from graphmode.meta import GraphMeta
from graphmode.staging import to_device
from graphmode.token_buckets import default_token_sizes, token_bucket
from graphmode.variants import PLAIN, file_suffix

__all__ = ["PiecewiseGraph", "PiecewiseGraphs", "shape_only"]


@dataclass
class PiecewiseGraph:
    """One token bucket's captured forward, and what it captured by reference."""

    bucket: int
    pieces: Pieces
    output: Any
    meta: GraphMeta
    cache_tensors: list[Any]
    flatten_cache: Callable[[Any], list[Any]]
    extras: dict[str, Any]  # the extra inputs without a buffer, frozen by the segments
    in_warmup: bool = False
    variant: str = PLAIN  # its graph variant's label (graphmode.variants)

    def __post_init__(self) -> None:
        self.memory = CacheMemory(self.cache_tensors, self.flatten_cache)  # their data pointers, checked at every replay

    @property
    def name(self) -> str:
        """How errors name it: "token bucket 8 (piecewise)", "token bucket 8 (piecewise, lora=True)"."""
        return graph_name(PiecewiseGraphs.name, PiecewiseGraphs.unit, self.bucket, variant=self.variant)


class PiecewiseGraphs:
    """The piecewise graphs of a runner in execute mode "piecewise" or
    "full_and_piecewise": every step up to the largest token bucket."""

    name = "piecewise"
    setting = "capture_token_sizes"
    unit = "tokens"
    #: Host steps are copied to the device: the break points run eagerly on the step's own metadata.
    stages_host = False
    steps_natively = False
    uniform_steps = False
    staging = None
    native_step = None

    def __init__(self, shared: RunnerContext) -> None:
        config = shared.config
        self.shared = shared
        self.sizes = tuple(config.capture_token_sizes or default_token_sizes(config.max_batches))
        self.ops = find_attention_ops(shared.model)
        # With compile=True, the runner's compiled forward split at the break points.
        self._split = SplitForward(shared.forward, self.ops) if shared.compiled else None
        # By graph variant (graphmode.variants; one key when none are declared), then token bucket.
        self._by_variant: dict[tuple[Any, ...], dict[int, PiecewiseGraph]] = {}
        self._new_buffers()
        declared = [spec for spec in shared.spec.buffers if spec.name in shared.declared_extras]
        # Step inputs of one row per sequence: a segment sees them as the bucket's rows of tokens.
        self._per_sequence = [spec.name for spec in declared if not spec.per_token]
        self._warned = False

    def _new_buffers(self) -> None:
        """The buffers every token bucket's graph shares, empty (each is
        allocated at the first capture that needs it)."""
        config, shared = self.shared.config, self.shared
        self._buffers = BreakBuffers(self.sizes[-1])
        #: By graph variant, the last warm-up's break-point layout (EagerForward.layout), from which a later
        #: bucket's capture takes its views without a warm-up forward of its own (BreakBuffers.views_for).
        self._layouts: dict[tuple[Any, ...], list[tuple[Any, ...] | None]] = {}
        self._outputs = SharedOutputs(self.sizes[-1])
        declared = [spec for spec in shared.spec.buffers if spec.name in shared.declared_extras]
        # KV writes the ops let segments capture read the step's slots from a static buffer.
        in_graph = any(writes_kv_in_graph(ops) for ops in self.ops)
        self._inputs = TokenInputs(self.sizes[-1], declared, config.max_blocks_per_seq, config.device, in_graph)

    # -- the protocol ----------------------------------------------------------

    def refusal(self, inputs: StepInputs, batch: int, q_len: int | None) -> str | None:
        if inputs.num_tokens > self.sizes[-1]:
            return "no_token_bucket"
        if self._per_sequence and inputs.num_tokens != batch:
            return self._per_sequence_refusal(inputs.num_tokens, batch)
        return None

    def _per_sequence_refusal(self, tokens: int, batch: int) -> str:
        """A step of other than one token per sequence with a per-sequence
        step input runs eagerly: its segments would see the input's rows as
        the first tokens' (ids [1, 2, 3] for 6 + 1 + 1 tokens: adapters 1, 2,
        3 on the first sequence's first tokens), a silently wrong result; and
        with padding rows of no token, the bucket may hold fewer rows than
        the batch."""
        if not self._warned:
            self._warned = True
            names = ", ".join(repr(name) for name in self._per_sequence)
            warnings.warn(
                f"graphmode: step inputs {names} are declared per sequence, but a piecewise graph's segments see "
                f"a step as rows of tokens: a step of {tokens} tokens for {batch} sequences (prefill, mixed, "
                "verify, padding rows) runs eagerly instead (runner.stats.eager_steps['per_sequence_input']). Declare them "
                "per token, BufferSpec(name, dtype, shape=(TOKENS,)), and pass values.repeat_interleave(q_seqlens)",
                stacklevel=4,
            )
        return "per_sequence_input"

    def graph_for(self, inputs: StepInputs, batch: int, q_len: int | None) -> tuple[int, int]:
        bucket = token_bucket(inputs.num_tokens, self.sizes)
        assert bucket is not None  # refusal() said so otherwise
        return bucket, bucket

    def run(self, inputs: StepInputs, decision: StepDecision, on_host: bool) -> Any:
        """Replay the step's token bucket, or capture it first."""
        shared, stats = self.shared, self.shared.stats.family(self.name)
        check_piecewise_step(inputs.attn_metadata, inputs.num_tokens, on_host)  # host values: no synchronisation
        if on_host:  # the break points run eagerly on the step's metadata: on the device
            inputs = to_device(inputs, shared.config.device)
        tokens, bucket = decision.tokens, decision.key
        live = LiveStep(inputs.attn_metadata, tokens, bucket)
        graph, debug = self._current().get(bucket), shared.debug
        if graph is None:
            return self._capture(inputs, live)
        check_same_objects(graph, inputs)
        if debug is not None:
            debug.check_addresses(graph.name, graph.extras)
        self._inputs.fill(inputs, bucket)
        try:
            graph.pieces.replay(live)
        except Exception as error:
            note_replay_failure(error, shared, graph.name)
            raise
        stats.replays += 1
        stats.replays_by_variant[graph.variant] += 1
        return live_columns(graph.output, tokens)

    def todo(self, q_lens: Sequence[int]) -> list[int]:
        return self._todo()

    def tokens(self, key: int) -> int:
        return key

    def warmup(self, past_key_values: KVCache, extras: dict[str, Any], q_lens: Sequence[int], report: Report,
               only: Sequence[int] | None = None) -> None:
        """Every token bucket not captured yet (of ``only``, when given),
        largest first, from inert steps of one token per sequence (query
        lengths do not matter here)."""
        todo = self._todo()
        if only is not None:
            todo = [bucket for bucket in todo if bucket in only]
        for index, bucket in enumerate(todo):
            self._capture_inert(past_key_values, extras, bucket, f"({index + 1}/{len(todo)})", report,
                                index + 1 == len(todo))

    def _capture_inert(self, past_key_values: KVCache, extras: dict[str, Any], bucket: int, count: str,
                       report: Report, last: bool) -> None:
        """Capture token bucket ``bucket`` from an inert step of one token per sequence (warm-up, wake)."""
        variant = self.shared.variant_label
        suffix = f", {variant}" if variant != PLAIN else ""
        report(f"capturing piecewise token bucket {bucket}{suffix} {count}", last)
        step = inert_step(self.shared, bucket, past_key_values, extras)
        self._capture(step, LiveStep(step.attn_metadata, bucket, bucket), warmup=True)

    def reset(self) -> None:
        for graphs in self._by_variant.values():
            for graph in graphs.values():
                graph.pieces.reset()
        self._by_variant.clear()
        self._outputs = SharedOutputs(self.sizes[-1])

    def captured(self) -> list[Captured]:
        return [graph for graphs in self._by_variant.values() for graph in graphs.values()]

    def graph_keys(self) -> list[tuple[int, ...]]:
        return [(bucket,) for bucket in self._by_variant.get(self.shared.variants.plain, {})]

    def lookup(self, key: tuple[int, ...], variant: tuple[Any, ...]) -> PiecewiseGraph | None:
        return self._by_variant.get(variant, {}).get(key[0])

    def forget_native(self) -> None:
        pass  # no native step

    def release(self) -> list[SleptGraph]:
        slept = [
            SleptGraph(variant, bucket, graph.extras)
            for variant, graphs in self._by_variant.items() for bucket, graph in graphs.items()
        ]
        self.reset()
        self._new_buffers()  # the break-point, step-input and output buffers reset() keeps
        return slept

    def recapture(self, past_key_values: KVCache, graphs: Sequence[SleptGraph], report: Report) -> None:
        todo = sorted(graphs, key=lambda graph: -graph.key)  # largest first, as warmup()
        for index, graph in enumerate(todo):
            self._capture_inert(past_key_values, graph.extras, graph.key, f"again ({index + 1}/{len(todo)})",
                                report, index + 1 == len(todo))

    # -- queries --------------------------------------------------------------

    def bucket_of(self, tokens: int) -> int | None:
        """The token bucket a step of ``tokens`` tokens runs in, or None (eager)."""
        return token_bucket(tokens, self.sizes)

    @property
    def captured_buckets(self) -> list[int]:
        """The plain variant's captured token buckets, in capture order."""
        return list(self._by_variant.get(self.shared.variants.plain, {}))

    def graph(self, bucket: int, **variant: Any) -> PiecewiseGraph | None:
        """The captured piecewise graph of a token bucket, if captured; of the
        graph variant the keywords name (``graph(8, lora=True)``), the plain one without."""
        key = self.shared.variants.key_of(variant, f"runner.family('piecewise').graph({bucket}")
        return self._by_variant.get(key, {}).get(bucket)

    def _current(self) -> dict[int, PiecewiseGraph]:
        """The graphs of the variant of the step or warm-up in progress."""
        return self._by_variant.setdefault(self.shared.variant, {})

    # -- capture --------------------------------------------------------------

    def _todo(self) -> list[int]:
        graphs = self._current()
        return [bucket for bucket in reversed(self.sizes) if bucket not in graphs]

    def _capture(self, inputs: StepInputs, live: LiveStep, *, warmup: bool = False, warm: bool = False) -> Any:
        """Capture token bucket ``live.bucket`` from ``inputs`` and return the
        step's answer (None for a warm-up capture that ran no warm-up
        forward). ``warm``: run the warm-up forward even where it may be
        left out."""
        bucket, shared, ranks = live.bucket, self.shared, self.shared.ranks
        shared.agree_to_capture(live.tokens, bucket, unit="tokens")
        shared.check_capture_cache(inputs.past_key_values, graph_name(self.name, self.unit, bucket))
        static = self._inputs.fill(inputs, bucket)
        static = dataclasses.replace(static, attn_metadata=shape_only(inputs.attn_metadata))
        forward = shared.model if self._split is None else self._split
        shape = shared.forward_shape(self.name, bucket, 1, inputs.past_key_values, inputs.extras)
        # As the full graphs' (family.FORWARDS_RUN): a warm-up capture of a shape the forward ran at
        # needs no warm-up forward, when an earlier warm-up's break points give this bucket's views.
        views, layout = None, self._layouts.get(shared.variant)
        if warmup and not warm and layout is not None and self._outputs.buffers is not None \
                and shared.has_run_at(shape):
            views = self._buffers.views_for(layout, bucket)
        warm_output = None
        # The graph's rows are tokens: a per-sequence extra (one row per sequence) fits it only by chance.
        rows = row_names(inputs.attn_metadata.batch_size, inputs.num_tokens)
        unpadded = unpadded_extras(shared, inputs.extras, rows, bucket) \
            if inputs.extras and bucket != inputs.num_tokens else None
        if views is None:
            warm_up = EagerForward(live, self._buffers)
            try:
                with intercepted(self.ops, warm_up), self._ghost_reads():
                    # compiles, with compile=True
                    warm_output = shared.warm_up(lambda: forward(**fresh_context(static).as_kwargs()), shape)
            except RuntimeError as error:
                if "meta" in str(error) and hasattr(error, "add_note"):
                    error.add_note(f"graphmode: {READ_INSIDE_OPS}, or use execute_mode='graph'. {OPS_AT_OPS}")
                if unpadded is not None and hasattr(error, "add_note"):
                    error.add_note(unpadded)
                raise
            self._outputs.prepare(warm_output, bucket)
            views, self._layouts[shared.variant] = warm_up.views, warm_up.layout
        # Plugins tell piecewise graphs from full ones (make_graph, capture
        # advice) by family "piecewise"; their capture sizes are token sizes.
        meta = dataclasses.replace(shared.graph_meta(), family=self.name, capture_sizes=tuple(self.sizes))
        slots_attn = None
        if self._inputs.with_slots:
            slots_attn = static.attn_metadata.replace(kv_start_indices=self._inputs.slot_rows(bucket))
        capture = CaptureForward(views, lambda: self._make_graph(meta), shared.pool, slots_attn)
        if ranks is not None:
            ranks.barrier()  # every rank's device idle before any of them captures
        changed = False
        try:
            state = ModelState(shared.model, shared.config.host_bookkeeping, before=shared.last_state)
            shared.last_state = None
            # Below the capture's own modes: a segment's end pops the emulator's.
            with intercepted(self.ops, capture), self._ghost_reads(), capture:
                result = forward(**fresh_context(static).as_kwargs())
                if warm_output is None:
                    check_token_dimension(result, bucket)  # prepare()'s check, which no warm-up result met
                output = self._outputs.publish(result, bucket)
            try:
                state.check(f"the piecewise graph of token bucket {bucket}")
            except CaptureError:
                if warm_output is not None:
                    raise
                changed = True  # lazy state for this shape after all: captured again after a warm-up forward
        except Exception as error:
            what = f"segment {len(capture.pieces.segments) + 1} of the piecewise graph of token bucket {bucket}"
            if shared.variant_label != PLAIN:
                what += f", {shared.variant_label}"
            capture_failed(error, shared, meta, bucket, what, self.setting, unpadded)
        if changed:
            capture.pieces.reset()
            return self._capture(inputs, live, warmup=warmup, warm=True)
        shared.ran_at(shape)
        if warmup:
            shared.last_state = state  # the next warm-up capture's state before, if nothing runs the model first
        shared.adopt_pool(capture.pool)  # one pool for every graph of the runner, full and piecewise
        shared.weights.hold(shared.model)  # the first capture's addresses, which every graph step checks
        flatten = cache_flattener(static.past_key_values)
        frozen = shared.frozen_extras(inputs.extras)
        graph = self._current()[bucket] = PiecewiseGraph(
            bucket, capture.pieces, output, meta, flatten(static.past_key_values), flatten, frozen, warmup,
            shared.variant_label,
        )
        if shared.debug is not None:
            shared.debug.record(graph.name, graph.extras)
            suffix = file_suffix(graph.variant)
            for index, segment in enumerate(graph.pieces.segments, 1):
                shared.debug.dump(segment, f"tokens{bucket}-segment{index}{suffix}", f"segment {index} of {graph.name}")
        counts = shared.stats.family(self.name)
        counts.captures += 1
        if warmup:  # an inert step
            counts.warmup_captures += 1
        return None if warm_output is None else live_columns(warm_output, live.tokens)

    def _ghost_reads(self) -> Any:
        """Refuse the model's reads of the capture's ghost metadata (not with compile=True)."""
        return GhostReads() if self._split is None else contextlib.nullcontext()

    def _make_graph(self, meta: GraphMeta) -> DeviceGraph:
        graph = self.shared.vendor.hook.graphmode_make_graph(meta=meta)
        if self.shared.debug is not None:
            graph.enable_debug_mode()  # before capture, as for full graphs
        return graph

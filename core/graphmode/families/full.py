"""FullGraphs: the family of full decode graphs, one per batch bucket and
query length.

A decode step whose sequences all carry ``q_len`` new tokens (1, or ``1 + k``
for speculative verify and MTP; at most ``max_q_len``) runs in the graph of
(batch bucket, q_len). The first such step fills the buffers, runs the model
once outside any graph (that result is returned) and captures the same
forward; every later step of that key fills the buffers and replays.

It never reads device values on the host (no synchronisation per step; on
the emulator, and on CUDA when asked, a hook that does is refused: see
``graphmode.checks.host_reads``), but for the query lengths of a verify
step built on the device that its host facts cannot prove uniform
(``graphmode.checks.host_lengths.check_device_verify_step``), and never
copies the output: a replay result is a view of the graph's output, valid
until the next step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphmode import default
from graphmode.buffers import plan_key
from graphmode.checks.cache_checks import CacheMemory, cache_flattener, check_same_objects
from graphmode.checks.host_lengths import check_device_verify_step, check_host_kv_lengths, check_uniform_step
from graphmode.checks.host_reads import replay_guard
from graphmode.checks.model_state import ModelState
from graphmode.checks.validate import check_cache_layout
from graphmode.context import KVCache, StepInputs
from graphmode.errors import CaptureError, InputError
from graphmode.families.common import (
    capture_failed,
    fresh_context,
    graph_name,
    guard_dropped_fields,
    inert_step,
    note_replay_failure,
    row_names,
    unpadded_extras,
)
from graphmode.families.decision import StepDecision
from graphmode.families.family import Captured, Report, RunnerContext
from graphmode.families.outputs import SharedOutputs, check_token_dimension
from graphmode.families.sleep import SleptGraph
from graphmode.graphs import DeviceGraph
from graphmode.meta import GraphMeta
from graphmode.native import NativeSteps, native_module
from graphmode.staging import HostStaging, emulator_host_hint, to_device, to_host
from graphmode.variants import PLAIN, file_suffix

__all__ = ["CapturedGraph", "FullGraphs"]


@dataclass
class CapturedGraph:
    """One (bucket, q_len) graph, and what it captured by reference."""

    bucket: int
    graph: DeviceGraph
    meta: GraphMeta
    past_key_values: KVCache
    extras: dict[str, Any]
    cache_tensors: list[Any]
    flatten_cache: Callable[[Any], list[Any]]
    in_warmup: bool = False  # captured by warmup(), with the extras given to it
    q_len: int = 1  # new tokens per sequence
    variant: str = PLAIN  # its graph variant's label (graphmode.variants)

    def __post_init__(self) -> None:
        self.memory = CacheMemory(self.cache_tensors, self.flatten_cache)  # their data pointers, checked at every replay
        self._name = graph_name(FullGraphs.name, FullGraphs.unit, self.bucket, self.q_len if self.q_len > 1 else None,
                                self.variant)  # made once
        self.replay_label = f"the replay of {type(self.graph).__name__}"  # what the replay guard names
        self.results: dict[int, torch.Tensor] = {}  # the built-in outputs hook's view, by token count

    @property
    def name(self) -> str:
        """How errors name it: "bucket 8", "bucket 8, q_len 3", "bucket 8, lora=True"."""
        return self._name


class FullGraphs:
    """The full decode graphs of a runner (execute modes "graph" and
    "full_and_piecewise"). With ``compile=True`` the warm-ups and captures
    run the runner's ``torch.compile(model)``."""

    name = "full"
    setting = "capture_batch_sizes"
    unit = "batch"
    stages_host = True
    steps_natively = True
    uniform_steps = True

    def __init__(self, shared: RunnerContext) -> None:
        config, vendor = shared.config, shared.vendor
        self.shared = shared
        self.bucket_of = shared.bucket_of
        self.sizes = shared.capture_sizes
        # By graph variant (graphmode.variants; one key when none are declared), then (bucket, q_len).
        self.by_variant: dict[tuple[Any, ...], dict[tuple[int, int], CapturedGraph]] = {}
        self._outputs = SharedOutputs(config.max_tokens, adopt=False)
        # The replay path's hooks, without pluggy's dispatch where that changes nothing.
        self._fill_buffers = vendor.direct("graphmode_fill_buffers")
        self._get_outputs = vendor.direct("graphmode_get_outputs")
        # The built-in hook returns a view of the output: made once per token count, aliased per step.
        self._output_views = self._get_outputs is default.graphmode_get_outputs
        update = vendor.hook.graphmode_update_graph_params
        self._update_params = update if update.get_hookimpls() else None
        self.replay_guard = replay_guard(config.device)
        self.staging: HostStaging | None = None
        self._staging_decided = False
        #: The native step (graphmode.native): made at the first replay step it may take.
        self.native: NativeSteps | None = None
        self.native_step: Callable[..., Any] | None = None
        self._native_decided = False
        self._staged_before_sleep = False  # whether host staging was on when the runner last slept

    @property
    def graphs(self) -> dict[tuple[int, int], CapturedGraph]:
        """The plain variant's graphs, by (bucket, q_len)."""
        return self.by_variant.setdefault(self.shared.variants.plain, {})

    def _current(self) -> dict[tuple[int, int], CapturedGraph]:
        """The graphs of the variant of the step or warm-up in progress."""
        return self.by_variant.setdefault(self.shared.variant, {})

    def _name_of(self, bucket: int, q_len: int | None, variant: str = PLAIN) -> str:
        return graph_name(self.name, self.unit, bucket, q_len, variant)

    # -- the protocol ----------------------------------------------------------

    def refusal(self, inputs: StepInputs, batch: int, q_len: int | None) -> str | None:
        if not inputs.attn_metadata.is_decoding:
            return "prefill"
        if q_len is None:
            return "mixed_q_len"
        if q_len > self.shared.config.max_q_len:
            return "multi_token_decode"
        if self.bucket_of[batch] is None:
            return "no_bucket"
        return None

    def graph_for(self, inputs: StepInputs, batch: int, q_len: int | None) -> tuple[int, tuple[int, int]]:
        bucket = self.bucket_of[batch]
        assert bucket is not None and q_len is not None  # refusal() said why otherwise
        return bucket, (bucket, q_len)

    def run(self, inputs: StepInputs, decision: StepDecision, on_host: bool) -> Any:
        given = inputs
        inputs = self._placed(inputs, on_host)
        batch, bucket, q_len = decision.batch, decision.bucket, decision.q_len
        assert bucket is not None and q_len is not None  # graph_for() set them
        if self.shared.debug is None and q_len > 1:
            # Host values only: no synchronisation (q_len 1, the hot path, is debug mode's, which checks
            # every step's device values itself).
            attn = given.attn_metadata
            if on_host:
                check_uniform_step(attn, batch, inputs.num_tokens, attn.q_seqlens, attn.q_start_loc)
            else:
                if attn.kv_seqlens_cpu is not None:  # what the host kv lengths prove, read first: no copy
                    check_host_kv_lengths(attn, batch, inputs.num_tokens, attn.kv_seqlens_cpu)
                self._read_verify_lengths(attn, batch, inputs.num_tokens)
        captured = self._current().get(decision.key)
        if captured is None:
            return self._capture(inputs, batch, bucket)
        # The native step repeats steps whose tensors the engine gave as the fill read them (not moved).
        return self._replay(captured, inputs, batch, learn=inputs is given)

    def _read_verify_lengths(self, attn: Any, batch: int, tokens: int) -> None:
        """A device-built verify step's query lengths, read to the host and
        checked (``check_device_verify_step``): counted, and logged once."""
        stats = self.shared.stats
        stats.verify_length_reads += 1
        if stats.verify_length_reads == 1:
            # Logged, not warned: a cost, not a mistake (an engine may build its verify steps on the device).
            logging.getLogger("graphmode").warning(
                "graphmode: a verify step (several new tokens per sequence) came with its query lengths on the "
                "device: graphmode reads q_seqlens and q_start_loc to the host once per such step (one "
                "synchronisation, counted in runner.stats.verify_length_reads) to prove every sequence carries "
                "the graph's tokens, which max_q_seq_len alone cannot. Build verify steps on the host (host "
                "tensors; graphmode copies them in) to skip the read"
            )
        check_device_verify_step(attn, batch, tokens)

    def todo(self, q_lens: Sequence[int]) -> list[tuple[int, int]]:
        return self._todo(q_lens)

    def tokens(self, key: tuple[int, int]) -> int:
        return key[0] * key[1]

    def warmup(self, past_key_values: KVCache, extras: dict[str, Any], q_lens: Sequence[int], report: Report,
               only: Sequence[tuple[int, int]] | None = None) -> None:
        todo = self._todo(q_lens)
        if only is not None:
            todo = [key for key in todo if key in only]
        if todo and not self._staging_decided:
            self._decide_staging(on_host=False)  # no step seen: host_staging=None means off
        for index, (bucket, q_len) in enumerate(todo):
            self._capture_inert(past_key_values, extras, bucket, q_len, f"({index + 1}/{len(todo)})", report,
                                index + 1 == len(todo))

    def _capture_inert(self, past_key_values: KVCache, extras: dict[str, Any], bucket: int, q_len: int, count: str,
                       report: Report, last: bool) -> None:
        """Capture the graph of (bucket, q_len) from an inert step (warm-up, wake)."""
        shown = q_len if self.shared.config.max_q_len > 1 else None
        report(f"capturing {self._name_of(bucket, shown, self.shared.variant_label)} {count}", last)
        step = inert_step(self.shared, bucket, past_key_values, extras, q_len)
        # With host staging the step comes from the host, as an engine's steps do.
        if self.staging is not None:  # declared step inputs too: their padding was made on the device
            step = to_host(step, self.shared.config.device, self.shared.declared_extras)
        self._capture(step, bucket, bucket, warmup=True)

    def reset(self) -> None:
        if self.native is not None:
            self.native.clear()
        for graphs in self.by_variant.values():
            for captured in graphs.values():
                captured.graph.reset()
        self.by_variant.clear()
        self._outputs = SharedOutputs(self.shared.config.max_tokens, adopt=False)

    def graph_keys(self) -> list[tuple[int, ...]]:
        return list(self.graphs)

    def lookup(self, key: tuple[int, ...], variant: tuple[Any, ...]) -> CapturedGraph | None:
        bucket, q_len = key
        return self.by_variant.get(variant, {}).get((bucket, q_len))

    def forget_native(self) -> None:
        if self.native is not None:
            self.native.clear()

    def captured(self) -> list[Captured]:
        return [captured for graphs in self.by_variant.values() for captured in graphs.values()]

    def release(self) -> list[SleptGraph]:
        slept = [
            SleptGraph(variant, key, captured.extras)
            for variant, graphs in self.by_variant.items() for key, captured in graphs.items()
        ]
        self.reset()  # the graphs and the shared output buffers
        # Host staging's arena and mirror go too, made again at the first capture after wake as
        # decided before sleep (host_staging=None decided it from the first step's inputs).
        self._staged_before_sleep = self.staging is not None
        self.staging, self._staging_decided = None, False
        # The native step's memo holds the graphs' buffers and views: decided again at the next replay.
        self.native, self.native_step, self._native_decided = None, None, False
        return slept

    def recapture(self, past_key_values: KVCache, graphs: Sequence[SleptGraph], report: Report) -> None:
        if not self._staging_decided:
            self._decide_staging(on_host=self._staged_before_sleep)
        todo = sorted(graphs, key=lambda graph: (-graph.key[1], -graph.key[0]))  # as warmup(): by q_len, largest first
        for index, graph in enumerate(todo):
            bucket, q_len = graph.key
            self._capture_inert(past_key_values, graph.extras, bucket, q_len, f"again ({index + 1}/{len(todo)})",
                                report, index + 1 == len(todo))

    # -- steps ----------------------------------------------------------------

    def _todo(self, q_lens: Sequence[int]) -> list[tuple[int, int]]:
        graphs = self._current()
        return [
            (b, q) for q in sorted(set(q_lens), reverse=True) for b in reversed(self.shared.capture_sizes)
            if (b, q) not in graphs
        ]

    def _placed(self, inputs: StepInputs, on_host: bool) -> StepInputs:
        """The inputs of a graph step where this family's fill needs them;
        the first graph step decides host staging when the config leaves it open."""
        if not self._staging_decided:
            self._decide_staging(on_host)
        if self.staging is not None:
            if not on_host:
                raise InputError(
                    "this runner stages its inputs on the host (host staging: its graphs copy them "
                    "from a pinned host mirror), but this step's tensors are on "
                    f"{inputs.input_ids.device}; reading them back would cost a device-to-host copy "
                    f"every step. Pass the step's inputs as host (CPU) tensors"
                    f"{emulator_host_hint(self.shared.config.device)}, or build the runner with host_staging=False"
                )
            return inputs
        return to_device(inputs, self.shared.config.device) if on_host else inputs

    def _decide_staging(self, on_host: bool) -> None:
        """Once, before the first capture: with host staging, the device input
        buffers move into one arena with a pinned host mirror."""
        wanted = self.shared.config.host_staging
        if wanted is None:
            wanted = on_host and self.shared.staging_refusal is None
        if wanted:
            self.staging = HostStaging(self.shared.graph_meta())
        self._staging_decided = True

    def _replay(self, captured: CapturedGraph, inputs: StepInputs, batch: int, learn: bool = True) -> Any:
        check_same_objects(captured, inputs)
        shared = self.shared
        if shared.debug is not None:
            shared.debug.check_addresses(captured.name, captured.extras)
        meta, bucket, staging, q_len = captured.meta, captured.bucket, self.staging, captured.q_len
        if staging is not None:
            staging.begin()  # the next mirror, whose last copy has run (a wait only three steps ahead)
        # No hook may read a device value on the host from here on.
        with self.replay_guard as guard:
            guard.running("graphmode_fill_buffers")
            self._fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
            if self._update_params is not None:
                guard.running("graphmode_update_graph_params")
                self._update_params(graph=captured.graph, meta=meta, batch_size=batch, bucket=bucket)
            guard.running(captured.replay_label)
            if staging is not None:
                staging.launch(bucket)  # the mirror's one copy into the arena, ordered after the last replay
            try:
                captured.graph.replay()
            except Exception as error:
                note_replay_failure(error, shared, captured.name)
                raise
            stats = shared.stats.family(self.name)
            stats.replays += 1
            stats.replays_by_q_len[q_len] += 1
            stats.replays_by_variant[captured.variant] += 1
            guard.running("graphmode_get_outputs")
            output = self.result(captured, batch)
        if learn and not self._native_decided:
            self._decide_native()
        if learn and self.native is not None:
            # The view the output hook gave, not this step's alias of it (the engine's to reshape).
            plan = meta.fill_plans.get(plan_key(meta, inputs, batch, bucket))
            self.native.learn(captured, inputs, batch, plan, captured.results.get(batch))
        return output

    def _decide_native(self) -> None:
        """Once, at the first replay step: whether the native step may take
        this runner's replay steps (graphmode.native: the built-in fill and
        outputs, no parameter update, variants, debug mode or per-step rank
        agreement; the host-read guard watches vendor hooks, which it never
        calls), and its memo."""
        shared = self.shared
        self._native_decided = True
        module = native_module()
        if module is None or shared.families[0] is not self or shared.variants or shared.debug is not None \
                or (shared.ranks is not None and shared.ranks.check_replays) or self._update_params is not None \
                or self._fill_buffers is not default.graphmode_fill_buffers or not self._output_views:
            return
        config = shared.config
        self.native = NativeSteps(module, shared.lock, self.staging, config.device.type == "cpu",
                                  (config.max_blocks_per_seq, config.block_size), shared.stats.family(self.name), PLAIN,
                                  shared.weights.addresses)
        self.native_step = self.native.step

    def result(self, captured: CapturedGraph, batch: int) -> Any:
        """The result of a replay of ``captured`` for ``batch`` sequences
        (``graphmode_get_outputs``)."""
        if not self._output_views:
            return self._get_outputs(meta=captured.meta, batch_size=batch, num_tokens=batch * captured.q_len)
        view = captured.results.get(batch)
        if view is None:
            view = self._get_outputs(meta=captured.meta, batch_size=batch, num_tokens=batch * captured.q_len)
            if not isinstance(view, torch.Tensor):  # a structure of outputs: made every step
                return view
            captured.results[batch] = view
        # A new tensor object each step (an engine may change a result's shape in place),
        # over the same memory: an alias costs less host time than slicing the output.
        return view.detach()

    def _check_new_graph(self, graph: DeviceGraph, name: str) -> None:
        """A graph the runner holds for another bucket, captured again, would
        replace that capture (or a runtime refuses it, naming no hook)."""
        held = next((c for graphs in self.by_variant.values() for c in graphs.values() if c.graph is graph), None)
        if held is not None:
            raise CaptureError(
                f"capturing the decode graph of {name}: graphmode_make_graph (plugin {self.shared.vendor.name}) "
                f"returned the graph object it returned for {held.name}, which holds that graph's capture. Hook: "
                "graphmode_make_graph must return a new graph at every call (one per bucket; the runner keeps "
                "them), never one kept in meta.vendor_state or a module"
            )

    def _capture(self, inputs: StepInputs, batch: int, bucket: int, *, warmup: bool = False,
                 warm: bool = False) -> Any:
        """Capture the graph of ``bucket`` from ``inputs`` and return the
        step's answer (None for a warm-up capture that ran no warm-up
        forward). ``warm``: run the warm-up forward even where it may be
        left out."""
        shared = self.shared
        ranks, hook, staging = shared.ranks, shared.vendor.hook, self.staging
        shared.agree_to_capture(batch, bucket)
        q_len = inputs.num_tokens // batch  # proved uniform by the caller
        shown = q_len if q_len > 1 else None
        shared.check_capture_cache(inputs.past_key_values, self._name_of(bucket, shown))
        flatten = cache_flattener(inputs.past_key_values)
        check_cache_layout(shared.model, flatten(inputs.past_key_values), shared.config.block_size)
        tokens = bucket * q_len  # the graph's, padding rows included
        meta = shared.graph_meta().for_graph()
        if staging is not None:
            staging.begin()
        hook.graphmode_fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
        if staging is not None:
            staging.launch(bucket)  # the warm-up and the capture read the arena
            staging.wait()  # once per capture: the warm-up may then read it on the host (the emulator)
        static = hook.graphmode_update_context(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
        # The warm-up runs the real step outside any graph: its result is this
        # step's answer, and it leaves lazy initialisation (and compilation)
        # out of the graph.
        forward = shared.forward
        name = self._name_of(bucket, shown, shared.variant_label)
        seen = guard_dropped_fields(inputs, static)  # what the model sees of the context
        shape = shared.forward_shape(self.name, bucket, q_len, inputs.past_key_values, inputs.extras)
        # A warm-up capture (an inert step: its answer is dropped) of a shape the forward ran at
        # before in this process needs no warm-up forward (family.FORWARDS_RUN); the first capture
        # since reset() runs one all the same, whose result sizes the shared output buffers.
        warmed = warm or not warmup or self._outputs.buffers is None or not shared.has_run_at(shape)
        warm_output = None
        unpadded = unpadded_extras(shared, inputs.extras, row_names(batch, inputs.num_tokens), bucket) \
            if inputs.extras and bucket != batch else None
        if warmed:
            try:
                warm_output = shared.warm_up(lambda: forward(**fresh_context(seen).as_kwargs()), shape)
            except Exception as error:
                if unpadded is not None and hasattr(error, "add_note"):
                    error.add_note(unpadded)
                raise
            self._outputs.prepare(warm_output, tokens, bucket)
        graph = hook.graphmode_make_graph(meta=meta)
        self._check_new_graph(graph, name)
        if shared.debug is not None:
            graph.enable_debug_mode()  # before capture, or CUDA and MLU graphs keep nothing to dump
        if ranks is not None:
            ranks.barrier()
        changed = False
        try:
            state = ModelState(shared.model, shared.config.host_bookkeeping, before=shared.last_state)
            shared.last_state = None
            with graph.capture(pool=shared.pool):
                output = forward(**fresh_context(seen).as_kwargs())
                if not warmed:
                    check_token_dimension(output, tokens, bucket)  # prepare()'s check, which no warm-up result met
                meta.output_buffers["output"] = self._outputs.publish(output, tokens)
            try:
                state.check(f"the decode graph of {name}")
            except CaptureError:
                if warmed:
                    raise
                changed = True  # lazy state for this shape after all: captured again after a warm-up forward
        except Exception as error:
            capture_failed(error, shared, meta, bucket, f"the decode graph of {name}", self.setting, unpadded)
        if changed:
            graph.reset()
            return self._capture(inputs, batch, bucket, warmup=warmup, warm=True)
        shared.ran_at(shape)
        if warmup:
            shared.last_state = state  # the next warm-up capture's state before, if nothing runs the model first
        shared.adopt_pool(graph.pool())
        shared.weights.hold(shared.model)  # the first capture's addresses, which every graph step checks
        if self.native is not None:  # a new graph: steps learn again
            self.native.clear()
        flatten = cache_flattener(static.past_key_values)
        frozen = shared.frozen_extras(inputs.extras)
        captured = self._current()[(bucket, q_len)] = CapturedGraph(
            bucket, graph, meta, static.past_key_values, frozen, flatten(static.past_key_values), flatten,
            in_warmup=warmup, q_len=q_len, variant=shared.variant_label,
        )
        if shared.debug is not None:
            shared.debug.record(captured.name, captured.extras)
            shared.debug.dump(graph, f"bucket{bucket}-q{q_len}{file_suffix(captured.variant)}", f"bucket {bucket}")
        counts = shared.stats.family(self.name)
        counts.captures += 1
        if warmup:  # an inert step
            counts.warmup_captures += 1
        if warm_output is None:
            return None
        warm_meta = dataclasses.replace(meta, output_buffers={"output": warm_output})
        return hook.graphmode_get_outputs(meta=warm_meta, batch_size=batch, num_tokens=batch * q_len)

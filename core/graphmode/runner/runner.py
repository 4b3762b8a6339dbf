"""GraphRunner: run a model's decode steps as one device graph per batch bucket
and query length.

A decode step whose sequences all carry ``q_len`` new tokens (1, or ``1 + k``
for speculative verify and MTP; at most ``max_q_len``) runs in the graph of
(batch bucket, q_len). The first such step fills the buffers, runs the model
once outside any graph (that result is returned) and captures the same
forward; every later step of that key fills the buffers and replays. Everything that
is not a decode step runs eagerly and returns the same results, or, in execute
modes "piecewise" and "full_and_piecewise", in piecewise graphs
(``graphmode.piecewise``).

With ``compile=True`` the graphs hold ``torch.compile(model)``: the warm-up
forward of a capture compiles (Dynamo traces, Inductor generates kernels and
autotunes, outside any graph), and the capture records the compiled kernels;
piecewise graphs capture it split at the attention calls
(``graphmode.piecewise.compiled``). Eager steps run the model uncompiled.

What it deliberately does not do: it never reads device values on the host
(no synchronisation per step; on the emulator, and on CUDA when asked, a hook
that does is refused: see ``graphmode.runner.host_reads``), never captures
prefill whole, and never copies the output: a replay result is a view of the
graph's output, valid until the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphmode import buffers
from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import ConfigError, InputError
from graphmode.graphs import DeviceGraph
from graphmode.meta import GraphMeta
from graphmode.piecewise.compiled import compiled_shapes
from graphmode.plugins import Vendor
from graphmode.runner.cache_checks import (
    CacheFit,
    CacheMemory,
    cache_flattener,
    check_same_objects,
    check_warmup_cache,
)
from graphmode.runner.debug import StepChecker
from graphmode.runner.guard import busy, one_at_a_time
from graphmode.runner.host_reads import replay_guard
from graphmode.runner.outputs import SharedOutputs
from graphmode.runner.progress import CaptureProgress
from graphmode.runner.setup import capture_sizes, configure
from graphmode.runner.stats import RunnerStats
from graphmode.runner.validate import check_cache_layout, check_inputs, check_model_ops, uniform_q_len
from graphmode.staging import HostStaging, staging_refusal, to_device, to_host

if TYPE_CHECKING:
    from graphmode.piecewise.graphs import PiecewiseGraphs

__all__ = ["GraphRunner"]


@dataclass
class CapturedGraph:
    """One (bucket, q_len) graph, and what it captured by reference."""

    bucket: int
    graph: DeviceGraph
    meta: GraphMeta
    past_key_values: Any
    extras: dict[str, Any]
    cache_tensors: list[Any]
    flatten_cache: Callable[[Any], list[Any]]
    in_warmup: bool = False  # captured by warmup(), with the extras given to it
    q_len: int = 1  # new tokens per sequence

    def __post_init__(self) -> None:
        self.memory = CacheMemory(self.cache_tensors, self.flatten_cache)  # their data pointers, checked at every replay

    @property
    def name(self) -> str:
        """How errors name it: "bucket 8", or "bucket 8, q_len 3"."""
        return f"bucket {self.bucket}" + (f", q_len {self.q_len}" if self.q_len > 1 else "")


class GraphRunner:
    """Call it like the model: ``runner(input_ids=..., position_ids=...,
    past_key_values=..., attn_metadata=..., **extras)``. Build it with
    :func:`graphmode.build_graph_runner`."""

    def __init__(
        self,
        model: Any,
        config: RunnerConfig,
        vendor: Vendor,
        *,
        process_group: Any = None,
        check_ranks: str = "always",
    ) -> None:
        self.model = model
        self.config = config
        self.vendor = vendor
        self._hook = vendor.hook
        self.spec = configure(vendor, config)
        check_model_ops(model, vendor)
        check_runner = getattr(model, "check_runner", None)
        if callable(check_runner):  # the model's own limits on the runner's shape (the HF adapter's sliding window)
            check_runner(config)
        self.capture_sizes = capture_sizes(vendor, config, self.spec)
        self._bucket_of = self._bucket_table()
        self._ranks = _rank_sync(process_group, check_ranks)
        if self._ranks is not None:
            self._ranks.agree_on_setup(config.execute_mode, self.capture_sizes)
        self.meta: GraphMeta | None = None
        self._graphs: dict[tuple[int, int], CapturedGraph] = {}  # by (bucket, q_len)
        self._pool: Any = None
        self.stats = RunnerStats()
        self._busy = threading.RLock()  # one step at a time (graphmode.runner.guard)
        self._cache_fit = CacheFit(model, config.block_size)
        self._outputs = SharedOutputs(config.max_tokens)
        # What warm-ups and captures run: the model, or its compiled forward.
        self._compiled = config.compile and config.execute_mode != "eager"
        self._forward = self._compile_model() if self._compiled else model
        # The replay path's hooks, without pluggy's dispatch where that changes nothing.
        self._fill_buffers = vendor.direct("graphmode_fill_buffers")
        self._get_outputs = vendor.direct("graphmode_get_outputs")
        update = self._hook.graphmode_update_graph_params
        self._update_params = update if update.get_hookimpls() else None
        self._staging_refusal = staging_refusal(vendor, config.device)
        if config.host_staging and self._staging_refusal is not None:
            raise ConfigError(f"host_staging=True: {self._staging_refusal}; build the runner with host_staging=None or False")
        self.staging: HostStaging | None = None
        self._staging_decided = False
        self._declared_extras = {
            path.split(".", 1)[1] for spec in self.spec.buffers for path in spec.contexts if path.startswith("extras.")
        }
        self._replay_guard = replay_guard(config.device)
        self._debug = StepChecker(model, config.block_size) if config.debug else None
        self.piecewise: PiecewiseGraphs | None = None
        if config.execute_mode in ("piecewise", "full_and_piecewise"):
            from graphmode.piecewise.graphs import PiecewiseGraphs  # imports this module

            self.piecewise = PiecewiseGraphs(self)

    # -- start-up checks ----------------------------------------------------

    def _compile_model(self) -> Any:
        """``torch.compile(model)`` for the graphs, where its kernels can be
        captured; refused, naming the reason, where they cannot."""
        name = self.vendor.name
        if "inductor_graphs" not in self.vendor.info.capabilities:
            raise ConfigError(
                f"compile=True: vendor {name!r} does not declare that Inductor's kernels run inside its "
                "graphs (VendorInfo capability 'inductor_graphs'); build the runner with compile=False "
                "(and compile the model with the vendor's own compiler, if it has one)"
            )
        if self.config.device.type == "cpu":
            # Seen with torch 2.13: under the emulator's capture modes the
            # compiled function runs its original Python, so the capture holds
            # the uncompiled aten operators; and Inductor's CPU kernels are
            # C++ calls the dispatcher (where the emulator records) never sees.
            raise ConfigError(
                "compile=True on the CPU graph emulator: the emulator records operators at PyTorch's "
                "dispatcher, where Inductor's kernels never pass (with its capture modes active, "
                "torch.compile runs the model's uncompiled code instead), so an emulated graph cannot "
                "hold compiled kernels. Use compile=True on a GPU, and compile=False on cpu"
            )
        options = self.config.torch_compile_options
        config = torch._dynamo.config
        limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        limit = getattr(config, limit_name)
        shapes = compiled_shapes(self.config, self.capture_sizes)  # full graph and token buckets
        if options.get("dynamic") is False and shapes > limit:
            raise ConfigError(
                f"compile_options dynamic=False compiles each of the {shapes} buckets "
                f"anew, above torch._dynamo.config.{limit_name}={limit}: Dynamo would run the "
                f"buckets past the limit uncompiled. Raise the limit to >= {shapes}, "
                "pass fewer capture_batch_sizes (or capture_token_sizes), or leave dynamic=True"
            )
        return torch.compile(self.model, **options)

    def _bucket_table(self) -> list[int | None]:
        """bucket_of[batch] for every batch size, asked once and checked."""
        table: list[int | None] = [None]
        for batch in range(1, self.config.max_batches + 1):
            bucket = self._hook.graphmode_compatible_size(batch_size=batch, capture_sizes=self.capture_sizes)
            fits = bucket is None or (bucket >= batch and bucket in self.capture_sizes)
            if bucket is None and batch <= self.capture_sizes[-1]:
                fits = False
            if not fits:
                raise ConfigError(
                    f"vendor {self.vendor.name!r}: graphmode_compatible_size({batch}) returned "
                    f"{bucket}; it must be a capture size >= {batch} from "
                    f"{list(self.capture_sizes)} (padding a batch into a smaller graph "
                    "would drop sequences)"
                )
            table.append(bucket)
        return table

    # -- one step -----------------------------------------------------------

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Any,
        attn_metadata: AttnMetadata,
        **extras: Any,
    ) -> Any:
        inputs = StepInputs(input_ids, position_ids, past_key_values, attn_metadata, extras)
        # One step at a time: steps share the input buffers, and a result is a
        # view of its graph's output until the next step. A second thread would
        # overwrite both mid-step, so it is refused rather than queued.
        if not self._busy.acquire(blocking=False):
            raise busy("GraphRunner")
        try:
            # Always in inference mode: buffers made in it can only be written in it.
            if torch.is_inference_mode_enabled():
                return self._step(inputs)
            with torch.inference_mode():
                return self._step(inputs)
        finally:
            self._busy.release()

    def _step(self, inputs: StepInputs) -> Any:
        batch, on_host = check_inputs(inputs, self.config)
        self._cache_fit(inputs.past_key_values)
        q_len = uniform_q_len(inputs.attn_metadata, batch, inputs.num_tokens)
        reason = self._eager_reason(inputs, batch, q_len)
        if self.piecewise is not None and self.piecewise.takes(reason):
            return self.piecewise.step(inputs, on_host)
        if self._ranks is not None and self._ranks.check_replays and reason in (None, "no_bucket"):
            # Before any collective: a rank on another graph would hang the rest.
            self._ranks.agree_on_step(batch, self._bucket_of[batch], "run")
        if reason is not None:
            self.stats.eager_steps[reason] += 1
            if on_host:
                inputs = to_device(inputs, self.config.device)
            return self.model(**inputs.as_kwargs())
        inputs = self._placed(inputs, on_host)
        bucket = self._bucket_of[batch]
        assert bucket is not None and q_len is not None  # _eager_reason said why otherwise
        if self._debug is not None:
            self._debug.check_step(inputs, batch)
        captured = self._graphs.get((bucket, q_len))
        if captured is None:
            return self._capture(inputs, batch, bucket)
        return self._replay(captured, inputs, batch)

    def _eager_reason(self, inputs: StepInputs, batch: int, q_len: int | None) -> str | None:
        if self.config.execute_mode == "eager":
            return "eager_mode"
        if not inputs.attn_metadata.is_decoding:
            return "prefill"
        if q_len is None:
            return "mixed_q_len"
        if q_len > self.config.max_q_len:
            return "multi_token_decode"
        if self._bucket_of[batch] is None:
            return "no_bucket"
        return None

    def _placed(self, inputs: StepInputs, on_host: bool) -> StepInputs:
        """The inputs of a graph step where this runner's fill needs them;
        the first graph step decides host staging when the config leaves it open."""
        if not self._staging_decided:
            self._decide_staging(on_host)
        if self.staging is not None:
            if not on_host:
                raise InputError(
                    "this runner stages its inputs on the host (host staging: its graphs copy them "
                    "from a pinned host mirror), but this step's tensors are on "
                    f"{inputs.input_ids.device}; reading them back would cost a device-to-host copy "
                    "every step. Pass the step's inputs as host (CPU) tensors, or build the runner "
                    "with host_staging=False"
                )
            return inputs
        return to_device(inputs, self.config.device) if on_host else inputs

    def _decide_staging(self, on_host: bool) -> None:
        """Once, before the first capture: with host staging, the device input
        buffers move into one arena with a pinned host mirror."""
        wanted = self.config.host_staging
        if wanted is None:
            wanted = on_host and self._staging_refusal is None
        if wanted:
            self.staging = HostStaging(self.graph_meta())
        self._staging_decided = True

    def _replay(self, captured: CapturedGraph, inputs: StepInputs, batch: int) -> Any:
        check_same_objects(captured, inputs)
        if self._debug is not None:
            self._debug.check_addresses(captured.name, captured.cache_tensors, captured.extras)
        meta, bucket, staging, q_len = captured.meta, captured.bucket, self.staging, captured.q_len
        if staging is not None:
            staging.wait()  # the previous replay has copied the mirror: it may be written
        # No hook may read a device value on the host from here on.
        with self._replay_guard as guard:
            guard.running("graphmode_fill_buffers")
            self._fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
            if self._update_params is not None:
                guard.running("graphmode_update_graph_params")
                self._update_params(graph=captured.graph, meta=meta, batch_size=batch, bucket=bucket)
            guard.running(f"the replay of {type(captured.graph).__name__}")
            captured.graph.replay()
            if staging is not None:
                staging.copied()
            self.stats.replays += 1
            self.stats.replays_by_q_len[q_len] += 1
            self.stats.real_tokens += batch * q_len
            self.stats.padded_tokens += (bucket - batch) * q_len
            guard.running("graphmode_get_outputs")
            return self._get_outputs(meta=meta, batch_size=batch, num_tokens=batch * q_len)

    def _capture(self, inputs: StepInputs, batch: int, bucket: int, *, warmup: bool = False) -> Any:
        if self._ranks is not None and not self._ranks.check_replays:
            # Before the warm-up's collectives: disagreeing ranks would hang in them.
            self._ranks.agree_on_step(batch, bucket, "capture")
        flatten = cache_flattener(inputs.past_key_values)
        check_cache_layout(self.model, flatten(inputs.past_key_values), self.config.block_size)
        q_len = inputs.num_tokens // batch  # proved uniform by the caller
        tokens = bucket * q_len  # the graph's, padding rows included
        key = f"bucket {bucket}" + (f", q_len {q_len}" if q_len > 1 else "")
        meta = self.graph_meta().for_graph()
        hook, staging = self._hook, self.staging
        if staging is not None:
            staging.wait()
        hook.graphmode_fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
        if staging is not None:
            staging.copy_in(bucket)  # the warm-up reads the arena
            staging.copied()
        static = hook.graphmode_update_context(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)
        # The warm-up runs the real step outside any graph: its result is this
        # step's answer, and it leaves lazy initialisation (and compilation)
        # out of the graph.
        started = time.perf_counter()
        warm_output = self._forward(**static.as_kwargs())
        if self._compiled:
            self.stats.compile_seconds += time.perf_counter() - started
        self._outputs.prepare(warm_output, tokens)
        graph = hook.graphmode_make_graph(meta=meta)
        if self._debug is not None:
            graph.enable_debug_mode()  # before capture, or CUDA and MLU graphs keep nothing to dump
        if self._ranks is not None:
            self._ranks.barrier()
        try:
            with graph.capture(pool=self._pool):
                if staging is not None:
                    staging.copy_in(bucket)  # the graph's first node: the mirror, read live
                meta.output_buffers["output"] = self._outputs.publish(self._forward(**static.as_kwargs()), tokens)
        except Exception as error:
            advice = hook.graphmode_capture_error(error=error, meta=meta, bucket=bucket)
            if advice is not None:
                raise advice from error
            if hasattr(error, "add_note"):
                error.add_note(f"graphmode: while capturing the decode graph of {key} ({self.vendor.name})")
            raise
        if self._pool is None:
            self._pool = graph.pool()
        flatten = cache_flattener(static.past_key_values)
        # Extras without a buffer are captured by reference: later steps must pass the same objects.
        frozen = {name: value for name, value in inputs.extras.items() if name not in self._declared_extras}
        captured = self._graphs[(bucket, q_len)] = CapturedGraph(
            bucket, graph, meta, static.past_key_values, frozen, flatten(static.past_key_values), flatten,
            in_warmup=warmup, q_len=q_len,
        )
        if self._debug is not None:
            self._debug.record(captured.name, captured.cache_tensors, captured.extras)
            self._debug.dump(graph, bucket, q_len)
        self.stats.captures += 1
        if warmup:  # an inert step: no served tokens
            self.stats.warmup_captures += 1
        else:
            self.stats.real_tokens += batch * q_len
            self.stats.padded_tokens += (bucket - batch) * q_len
        warm_meta = dataclasses.replace(meta, output_buffers={"output": warm_output})
        return hook.graphmode_get_outputs(meta=warm_meta, batch_size=batch, num_tokens=batch * q_len)

    @one_at_a_time("runner.graph_meta()")
    @torch.inference_mode()
    def graph_meta(self) -> GraphMeta:
        """The GraphMeta holding the input buffers every bucket shares, made
        (with its padding snapshot) on first use, in inference mode like every
        step that writes them."""
        if self.meta is None:
            config = self.config
            meta = GraphMeta(
                max_batchs=config.max_batches,
                max_tokens=config.max_tokens,
                num_blocks=config.max_blocks_per_seq,
                block_size=config.block_size,
                device=config.device,
                vocab_size=_model_attr(self.model, "vocab_size"),
                spec=self.spec,
                capture_sizes=self.capture_sizes,
                vendor_options=config.vendor_options,
            )
            meta.input_buffers = self._hook.graphmode_make_buffers(meta=meta)
            meta.padding_buffers = {name: t.clone() for name, t in meta.input_buffers.items()}
            meta.q_len_padding = buffers.q_len_paddings(meta)
            meta.live_buffers = buffers.live_values(meta)
            self.meta = meta
        return self.meta

    # -- whole-runner operations ------------------------------------------

    @one_at_a_time("runner.warmup()")
    def warmup(
        self, past_key_values: Any, *, progress: bool = True, q_lens: Sequence[int] | None = None, **extras: Any
    ) -> None:
        """Capture every graph not captured yet, largest first, into one pool
        (on every rank in the same order, when tensor parallel): for each
        query length of ``q_lens`` (default: every one in 1..max_q_len), every
        bucket.

        The warm-up steps are inert: every slot is -1 (no KV write) and every
        row reads the reserved block 0, so no live cache block changes."""
        if self.config.execute_mode == "eager":
            return
        limit = self.config.max_q_len
        wanted = range(1, limit + 1) if q_lens is None else list(q_lens)
        bad = [q for q in wanted if not isinstance(q, int) or not 1 <= q <= limit]
        if bad:
            raise ConfigError(
                f"warmup(q_lens={list(wanted)}): {bad} outside 1..max_q_len={limit}; pass query lengths the "
                "runner graphs, or build it with a larger max_q_len"
            )
        check_warmup_cache(self, past_key_values)
        full = self.config.execute_mode != "piecewise"
        todo = [
            (b, q) for q in sorted(set(wanted), reverse=True) for b in reversed(self.capture_sizes)
            if (b, q) not in self._graphs
        ] if full else []
        if todo and not self._staging_decided:
            self._decide_staging(on_host=False)  # no step seen: host_staging=None means off
        pieces = [b for b in self.piecewise.sizes if self.piecewise.graph(b) is None] \
            if self.piecewise is not None else []
        with _frozen_gc(), torch.inference_mode(), \
                CaptureProgress(len(pieces) + len(todo), self.config.device, bar=progress) as report:
            if self.piecewise is not None:  # first, as vLLM: the larger activations take the pool first
                self.piecewise.warmup(past_key_values, extras, report)
            for index, (bucket, q_len) in enumerate(todo):
                name = f"bucket {bucket}" + (f", q_len {q_len}" if limit > 1 else "")
                report(f"capturing {name} ({index + 1}/{len(todo)})", index + 1 == len(todo))
                step = self._inert_step(bucket, past_key_values, extras, q_len)
                self._capture(step, bucket, bucket, warmup=True)

    def _inert_step(self, batch: int, past_key_values: Any, extras: dict[str, Any], q_len: int = 1) -> StepInputs:
        """A decode step of ``batch`` sequences of ``q_len`` tokens that
        changes nothing: every slot -1, every row on the reserved block 0."""
        device, int32 = self.config.device, torch.int32
        tokens = batch * q_len
        attn = AttnMetadata(
            is_decoding=True,
            block_offsets=torch.zeros((batch, 1), dtype=int32, device=device),
            q_start_loc=torch.arange(0, tokens, q_len, dtype=int32, device=device),
            q_seqlens=torch.full((batch,), q_len, dtype=int32, device=device),
            kv_seqlens=torch.full((batch,), q_len, dtype=int32, device=device),
            kv_start_indices=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            max_q_seq_len=q_len,
            max_kv_seq_len=q_len,
            kv_seqlens_cpu=torch.full((batch,), q_len, dtype=int32),
        )
        zeros = torch.zeros((1, tokens), dtype=torch.int64, device=device)
        extras = dict(extras)
        padding = self.graph_meta().padding_buffers
        for spec in self.spec.buffers:  # declared engine inputs not given: their padding rows
            name = spec.name
            if name in self._declared_extras and name not in extras:
                extras[name] = padding[name].narrow(spec.row_dim, 0, tokens if spec.per_token else batch)
        step = StepInputs(zeros, zeros.clone(), past_key_values, attn, extras)
        # With host staging the step comes from the host, as an engine's steps do.
        return to_host(step, device) if self.staging is not None else step

    @one_at_a_time("runner.reset()")
    def reset(self) -> None:
        """Drop every graph, their captured parameters and the memory pool.
        The next decode step of each bucket captures again (after a weight
        reload, say). A compiled forward is kept: it reads the weights as
        inputs, so weights changed in place need no recompilation."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
        if self.piecewise is not None:
            self.piecewise.reset()
        self._pool = None
        self._cache_fit.forget()
        self._outputs = SharedOutputs(self.config.max_tokens)
        module: Any = getattr(torch, self.config.device.type, None)
        if self.config.device.type != "cpu" and hasattr(module, "empty_cache"):
            module.empty_cache()

    @property
    def rank_sync(self) -> Any:
        """The :class:`graphmode.distributed.RankSync` of a tensor-parallel
        runner (its gloo ``control`` group carries host-side agreement), or None."""
        return self._ranks

    @property
    def captured_buckets(self) -> list[int]:
        """The buckets with a one-token decode graph, in the order they were
        captured (:attr:`captured_graphs` lists every q_len)."""
        return [bucket for bucket, q_len in self._graphs if q_len == 1]

    @property
    def captured_graphs(self) -> list[tuple[int, int]]:
        """Every graph's (bucket, q_len), in the order they were captured."""
        return list(self._graphs)

    def bucket_of(self, batch_size: int) -> int | None:
        """The graph a batch of ``batch_size`` sequences runs in, or None."""
        if not 1 <= batch_size <= self.config.max_batches:
            raise InputError(f"batch size {batch_size} is outside 1..max_batches={self.config.max_batches}")
        return self._bucket_of[batch_size]

    @one_at_a_time("runner.graph()")
    def graph(self, bucket: int, q_len: int = 1) -> CapturedGraph | None:
        """The captured graph of a bucket and query length, if captured."""
        return self._graphs.get((bucket, q_len))

    def __repr__(self) -> str:
        compiled = ", compiled" if self._compiled else ""
        return (
            f"<GraphRunner {self.vendor.name} on {self.config.device}, {self.config.execute_mode} mode{compiled}, "
            f"buckets {list(self.capture_sizes)}, captured "
            f"{self.captured_graphs if self.config.max_q_len > 1 else self.captured_buckets}>"
        )


def _rank_sync(process_group: Any, check_ranks: str) -> Any:
    if check_ranks not in ("capture", "always"):
        raise ConfigError(f"check_ranks={check_ranks!r}: use 'capture' (start-up and captures) or 'always' (every step)")
    if process_group is None:
        return None
    import torch.distributed as dist

    from graphmode.distributed import RankSync

    if dist.get_world_size(process_group) == 1:
        return None
    return RankSync(process_group, check_replays=check_ranks == "always")


def _model_attr(model: Any, name: str) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, name, None)


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Collect once, then keep the collector out of the capture loop: it
    would only slow capture down, finding nothing new to free."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""GraphRunner: what an engine calls instead of its model.

The runner checks each step's inputs, then hands the step to the first graph
family of its execute mode that takes it (``graphmode.families.modes``: full
decode graphs, ``graphmode.families.full``; piecewise token graphs,
``graphmode.families.piecewise.graphs``), or runs it eagerly, counting why. It owns
what the families share (``graphmode.families.family.RunnerContext``: the vendor, the
memory pool, the statistics, debug mode, the ranks), the one-step lock, and
the KV cache's first check; warm-up and reset go to every family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphmode.buckets import bucket_table
from graphmode.checks.cache_checks import check_warmup_cache
from graphmode.checks.model_state import KeptBuffers, watched_rebinds
from graphmode.checks.step_checks import StepChecks
from graphmode.checks.validate import check_model, uniform_q_len
from graphmode.config import RunnerConfig
from graphmode.context import AttnMetadata, KVCache, StepInputs, StepModel
from graphmode.errors import ConfigError, InputError
from graphmode.families.common import note_eager_failure, note_replay_failure
from graphmode.families.decision import decide
from graphmode.families.family import GraphFamily, RunnerContext
from graphmode.families.modes import build_families
from graphmode.families.sleep import asleep_error, recapture, release
from graphmode.families.stats import RunnerStats
from graphmode.graphs.torch_graph import give_back_memory
from graphmode.memory.meter import device_module
from graphmode.memory.plan import GraphMemory, MemoryPlan, Sample, WarmupMemory, plan
from graphmode.meta import GraphMeta
from graphmode.plugins import Vendor
from graphmode.runner.guard import busy, one_at_a_time
from graphmode.runner.progress import CaptureProgress, logger
from graphmode.runner.setup import capture_sizes, configure
from graphmode.staging import HostStaging, to_device

if TYPE_CHECKING:
    from graphmode.distributed import RankSync

__all__ = ["GraphRunner"]

#: Eager one-token steps marked as prefill a runner takes before it warns that they may be decode steps.
ONE_TOKEN_PREFILLS = 16


class GraphRunner:
    """Call it like the model: ``runner(input_ids=..., position_ids=...,
    past_key_values=..., attn_metadata=..., **extras)``. Build it with
    :func:`graphmode.build_graph_runner`."""

    def __init__(
        self,
        model: StepModel,
        config: RunnerConfig,
        vendor: Vendor,
        *,
        process_group: Any = None,
        check_ranks: str = "always",
        share_pool_with: GraphRunner | None = None,
    ) -> None:
        self.config = config
        self.vendor = vendor
        self.spec = configure(vendor, config)
        check_model(model, vendor)
        check_runner = getattr(model, "check_runner", None)
        if callable(check_runner):  # the model's own limits on the runner's shape (the HF adapter's sliding window)
            check_runner(config)
        self.capture_sizes = capture_sizes(vendor, config, self.spec)
        self._bucket_of = bucket_table(vendor, config.max_batches, self.capture_sizes)
        ranks = _rank_sync(process_group, check_ranks)
        self._shared = RunnerContext(model, config, vendor, self.spec, self.capture_sizes, self._bucket_of, ranks)
        self._cache_fit = self._shared.cache_fit
        self._rebinds = watched_rebinds(self)  # the model given other tensors than the graphs hold
        self._busy = self._shared.lock = threading.RLock()  # one step at a time (graphmode.runner.guard)
        self._check_inputs = StepChecks(config)  # check_inputs, its per-layout part once per layout
        #: The execute mode's families (graphmode.families.modes), tried in order for every step.
        self.families = build_families(self._shared)
        self._shared.families = self.families
        if share_pool_with is not None:
            if not isinstance(share_pool_with, GraphRunner):
                raise ConfigError(
                    f"share_pool_with={type(share_pool_with).__name__}: pass the GraphRunner whose memory pool "
                    "this runner's graphs should share (a draft model's runner: its target's runner)"
                )
            self._shared.join_pool(share_pool_with._shared)
        #: The family whose native step every call tries first (the one that has one), or None.
        self._native = next((family for family in self.families if family.steps_natively), None)
        if ranks is not None:
            token_sizes = tuple(size for family in self.families if family.unit == "tokens" for size in family.sizes)
            variants = self._shared.variants
            ranks.agree_on_setup(config.execute_mode, self.capture_sizes, token_sizes,
                                 repr(variants.declared) if variants else "")
            ranks.name_variant = lambda index: variants.label(variants.key_at(index))
        self._one_token_prefills = 0  # eager one-token steps marked as prefill (_one_token_prefill)
        self._memory_plan: MemoryPlan | None = None
        self._graph_memory: GraphMemory | None = None
        self._planning = False

    # -- what the families share ------------------------------------------

    @property
    def model(self) -> StepModel:
        """The model eager steps, warm-ups and captures run."""
        return self._shared.model

    @model.setter
    def model(self, model: StepModel) -> None:
        """A model the later eager steps, warm-ups and captures run: a wrapper
        of the same model (its AttentionOps, parameters and cache layout,
        which the runner found at build), not another model. With
        ``compile=True`` graphs keep running the compiled forward of the
        model the runner was built with; build a new runner for another."""
        self._shared.model = model

    @property
    def stats(self) -> RunnerStats:
        """What graph mode did: captures, replays, eager steps by reason, tokens."""
        return self._shared.stats

    @property
    def meta(self) -> GraphMeta | None:
        """The input buffers' GraphMeta, once a full graph step (or
        :meth:`graph_meta`) made it."""
        return self._shared.meta

    @property
    def staging(self) -> HostStaging | None:
        """The full graphs' host staging (docs/architecture.md), when on."""
        return next((family.staging for family in self.families if family.staging is not None), None)

    def family(self, name: str) -> GraphFamily | None:
        """The execute mode's family of that name (``GraphFamily.name``), or None."""
        return next((family for family in self.families if family.name == name), None)

    @property
    def rank_sync(self) -> RankSync | None:
        """The :class:`graphmode.distributed.RankSync` of a tensor-parallel
        runner (its gloo ``control`` group carries host-side agreement), or None."""
        return self._shared.ranks

    # -- one step -----------------------------------------------------------

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache,
        attn_metadata: AttnMetadata,
        **extras: Any,
    ) -> Any:
        native = self._native.native_step if self._native is not None else None
        if native is not None and not extras:  # a replay step of a layout seen before (graphmode.native)
            try:
                output = native(input_ids, position_ids, past_key_values, attn_metadata)
            except Exception as error:  # raised by its replay: noted as the Python path's replay notes it
                note_replay_failure(error, self._shared, f"bucket {self._bucket_of[attn_metadata.batch_size]}")
                raise
            if output is not None:
                return output
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
        if self._shared.asleep is not None:  # the native step has no memo while asleep: every step comes here
            raise asleep_error("a step")
        variants = self._shared.variants
        if variants:  # before any check: an undeclared variant is named first
            extras, key = variants.of_step(inputs.extras)
            inputs = dataclasses.replace(inputs, extras=extras)
            self._shared.use_variant(key)
        batch, on_host = self._check_inputs(inputs)
        inputs = self._shared.host_fields.complete(inputs, on_host)
        self._cache_fit(inputs.past_key_values)
        shared = self._shared
        q_len = uniform_q_len(inputs.attn_metadata, batch, inputs.num_tokens)
        decision = decide(self.families, inputs, batch, q_len, shared.variant_index)
        family, ranks = decision.family, shared.ranks
        if ranks is not None and ranks.check_replays and self.families:
            # Before any collective: a rank on another graph, or running eagerly, would hang the rest.
            unit = "batch" if family is None else family.unit
            ranks.agree_on_step(decision.size, decision.bucket, "run", unit=unit, variant=decision.variant)
        if family is not None:
            self._rebinds.check()  # new tensor objects (registration hooks)
            if shared.debug is None:  # debug mode checks every captured address itself, naming the graph
                shared.weights.check()  # new memory under the same objects (param.data = new)
            else:  # the step's device values, against what its graph would read and write
                shared.debug.check_step(inputs, batch, uniform=family.uniform_steps)
            output = family.run(inputs, decision, on_host)
            shared.count_tokens(family.name, decision.tokens, decision.padding)
            return output
        if shared.debug is not None:  # an eager step writes the cache too: its values are checked as any step's
            shared.debug.check_step(inputs, batch, uniform=False, ids=False)
        self.stats.eager_steps[decision.reason] += 1
        if decision.reason == "prefill" and q_len == 1:
            self._one_token_prefill()
        if on_host:
            inputs = to_device(inputs, self.config.device)
        graphs = any(family.captured() for family in self.families)
        try:
            output, rebound = self._rebinds.run(self.model, lambda: self.model(**inputs.as_kwargs()), graphs)
        except Exception as error:
            note_eager_failure(error, shared, str(decision.reason))
            raise
        if rebound:
            for family in self.families:
                family.forget_native()  # its memo would replay without the check below
        return output

    def _one_token_prefill(self) -> None:
        """An eager step of one new token per sequence marked as prefill:
        after :data:`ONE_TOKEN_PREFILLS` of them, warn (once) that they may
        be decode steps built with ``is_decoding=False`` (a newcomer's engine
        built every step so: all ran eagerly, unannounced)."""
        self._one_token_prefills += 1
        if self._one_token_prefills == ONE_TOKEN_PREFILLS:
            warnings.warn(
                f"graphmode: {ONE_TOKEN_PREFILLS} steps of one new token per sequence came with is_decoding=False, "
                "so they ran eagerly (runner.stats.eager_steps['prefill']); if they are decode steps, build their "
                "AttnMetadata with is_decoding=True to replay graphs",
                stacklevel=4,
            )

    @one_at_a_time("runner.graph_meta()")
    @torch.inference_mode()
    def graph_meta(self) -> GraphMeta:
        """The GraphMeta holding the input buffers every graph shares, made
        (with its padding snapshot) on first use, in inference mode like every
        step that writes them."""
        if self._shared.asleep is not None:
            raise asleep_error("runner.graph_meta()")
        return self._shared.graph_meta()

    # -- whole-runner operations ------------------------------------------

    @one_at_a_time("runner.warmup()")
    def warmup(
        self, past_key_values: KVCache, *, progress: bool = True, q_lens: Sequence[int] | None = None, **extras: Any
    ) -> None:
        """Capture every graph not captured yet, largest first, into one pool
        (on every rank in the same order, when tensor parallel): the
        families in reverse order (the later ones take the larger steps,
        whose activations take the pool first, as vLLM captures PIECEWISE
        before FULL); full graphs for each query length of ``q_lens``
        (default: every one in 1..max_q_len), every bucket; for every graph
        variant (``graph_variants``), or only the value of a variant keyword
        given in ``extras`` (``warmup(cache, lora=False)``: the plain graphs).

        The warm-up steps are inert: every slot is -1 (no KV write) and every
        row reads the reserved block 0, so no live cache block changes.

        On a device that reports its free memory, the warm-up measures the
        memory it takes (:attr:`graph_memory`), synchronising and emptying
        the caching allocator's unused blocks before and after each family;
        on the CPU emulator, after :meth:`plan_memory` only."""
        self._warmup(past_key_values, progress, q_lens, extras)

    def _warmup(self, past_key_values: KVCache, progress: bool, q_lens: Sequence[int] | None, extras: dict[str, Any],
                sample: Sample | None = None) -> None:
        """:meth:`warmup`; with ``sample`` (the memory plan's), each family
        captures the graphs the sample picks, measured one by one."""
        if self._shared.asleep is not None:
            raise asleep_error("runner.warmup()")
        if not self.families:
            return
        limit = self.config.max_q_len
        wanted = range(1, limit + 1) if q_lens is None else list(q_lens)
        bad = [q for q in wanted if not isinstance(q, int) or not 1 <= q <= limit]
        if bad:
            raise ConfigError(
                f"warmup(q_lens={list(wanted)}): {bad} outside 1..max_q_len={limit}; pass query lengths the "
                "runner graphs, or build it with a larger max_q_len"
            )
        self._cache_fit(past_key_values)
        check_warmup_cache([c for family in self.families for c in family.captured()], past_key_values)
        order, shared = self.families[::-1], self._shared
        # Every graph variant (graph_variants), or those the extras name; the plain one first.
        variants = shared.variants.for_warmup(extras)
        count = 0
        for _, key in variants:
            shared.use_variant(key)
            count += sum(len(sample.pick(family.todo(wanted)) if sample else family.todo(wanted)) for family in order)
        with _frozen_gc(), torch.inference_mode(), _fresh_state(shared), _kept_buffers(shared), \
                CaptureProgress(count, self.config.device, bar=progress) as report, \
                WarmupMemory(self.config.device, self._measures_memory()) as memory:
            for variant_extras, key in variants:
                shared.use_variant(key)
                for family in order:
                    with memory.family(family.name):
                        if sample is None:
                            family.warmup(past_key_values, variant_extras, wanted, report)
                        else:
                            sample.capture(family, past_key_values, variant_extras, wanted, report)
        self._graph_memory = memory.result(count) or self._graph_memory
        if self._memory_plan is not None and self._graph_memory is not None and not self._planning:
            logger.info("%s", self._memory_plan.compare(self._graph_memory))

    # -- graph memory (graphmode.memory) -----------------------------------

    @one_at_a_time("runner.plan_memory()")
    def plan_memory(
        self, past_key_values: KVCache, *, q_lens: Sequence[int] | None = None, **extras: Any
    ) -> MemoryPlan:
        """The device memory :meth:`warmup` will take, before the KV cache
        exists: warms up on ``past_key_values``, a probe cache of a few blocks
        made like the real one (``model.make_kv_cache(4, block_size)``), with
        the same ``q_lens`` and extras as the real warm-up, measures, and
        resets. Call it before any capture; the next warm-up reports against
        it (:meth:`memory_report`). See docs/engines.md, "Graph memory before
        the KV cache"."""
        if self._shared.asleep is not None:
            raise asleep_error("runner.plan_memory()")
        self._planning = True
        try:
            with _frozen_gc():  # the plan's measurements collect before each: see _frozen_gc
                self._memory_plan = plan(self, past_key_values, q_lens, extras)
        finally:
            self._planning = False
        self._graph_memory = None  # the planning warm-up's figure is the plan's (plan.warmup), not a warm-up's
        return self._memory_plan

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The last :meth:`plan_memory` result, or None."""
        return self._memory_plan

    @property
    def graph_memory(self) -> GraphMemory | None:
        """What the last measured :meth:`warmup` took: every warm-up on a
        device that reports its free memory, on the CPU emulator those after
        :meth:`plan_memory`; else None (None again after :meth:`plan_memory`
        until the next warm-up: the planning warm-up is ``plan.warmup``)."""
        return self._graph_memory

    def memory_report(self) -> str:
        """The plan against the last warm-up, in words (also logged at INFO
        by the warm-up)."""
        if not self.families:
            return "graph memory: none (execute mode 'eager': no graphs)"
        if self._memory_plan is None:
            return "graph memory: no plan (call plan_memory() before warmup())"
        if self._graph_memory is None:
            return f"graph memory: planned {self._memory_plan.bytes / 2**20:.1f} MiB, not warmed up yet"
        return self._memory_plan.compare(self._graph_memory)

    def _measures_memory(self) -> bool:
        device = self.config.device
        return device_module(device) is not None or self._planning or self._memory_plan is not None

    @one_at_a_time("runner.reset()")
    def reset(self) -> None:
        """Drop every graph, their captured parameters and the memory pool
        (a pool shared with another runner stays while that one holds
        graphs in it). The next step of each bucket captures again (after a weight
        reload, say). A compiled forward is kept: it reads the weights as
        inputs, so weights changed in place need no recompilation."""
        for family in self.families:
            family.reset()
        self._shared.asleep = None  # asleep: what wake() would capture again is forgotten too
        self._rebinds = watched_rebinds(self)
        self._shared.weights.forget()
        self._shared.release_pool()
        self._cache_fit.forget()
        give_back_memory(self.config.device)

    # -- sleep and wake (graphmode.families.sleep) -----------------------------

    @one_at_a_time("runner.sleep()")
    def sleep(self) -> None:
        """Give every byte of graph memory back: drop every graph of every
        family, their output, input, break-point and staging buffers and the
        memory pool, of this runner and of every runner sharing its pool (a
        draft model's runner and its target's: the pool is one), then
        ``empty_cache()``; on a GPU the driver's free memory is then what it
        was before the first capture (the engine may go on to offload its
        weights and KV cache). Results of earlier steps are views of graph
        memory: drop them first, or the memory they are in stays.

        Until :meth:`wake` every step, :meth:`warmup`, :meth:`plan_memory`
        and :meth:`graph_meta` of a sleeping runner is refused (ReplayError,
        naming wake()); :meth:`reset` forgets the sleep instead (the runner
        is then awake with no graph, and captures at each bucket's next
        step). Sleeping while asleep does nothing. See docs/engines.md,
        "Sleep and wake"."""
        members = [self._shared, *(m for m in self._shared.pool_share.members if m is not self._shared)]
        held = []
        try:
            for member in members:  # every runner of the pool, each between its steps
                if not member.lock.acquire(blocking=False):
                    raise busy("runner.sleep() (of a runner sharing this runner's memory pool)")
                held.append(member)
            for member in members:
                if member.asleep is None:
                    member.asleep = release(member)
                    member.stats.sleeps += 1
        finally:
            for member in held:
                member.lock.release()
        gc.collect()  # graphs in reference cycles hold pool memory until collected
        give_back_memory(self.config.device)

    @one_at_a_time("runner.wake()")
    def wake(self, past_key_values: KVCache, *, progress: bool = True) -> None:
        """Capture again, now, every graph :meth:`sleep` released of this
        runner (each runner sharing its pool wakes with its own cache), on
        ``past_key_values``, the KV cache as the engine has it after wake
        (the same tensors, or reallocated): as :meth:`warmup` captures, from
        inert steps (no live cache block changes), largest first, into one
        new pool; the graphs read the weights the model holds now. Steps
        after wake equal steps before sleep for the same weights and cache
        contents. Waking an awake runner does nothing. The capture costs what
        the warm-up of those graphs costs (docs/engines.md, "Sleep and wake",
        gives the command that measures it)."""
        asleep = self._shared.asleep
        if asleep is None:
            return
        self._cache_fit(past_key_values)
        self._shared.asleep = None
        # Every graph is captured afresh from the model's tensors now: replacements seen before sleep are healed.
        self._rebinds = watched_rebinds(self)
        with _frozen_gc(), torch.inference_mode(), _fresh_state(self._shared), _kept_buffers(self._shared), \
                CaptureProgress(asleep.count, self.config.device, bar=progress) as report:
            recapture(self._shared, asleep, past_key_values, report)
        self.stats.wakes += 1
        self.stats.recaptures += asleep.count

    @property
    def asleep(self) -> bool:
        """Whether the runner is asleep (between :meth:`sleep` and :meth:`wake`)."""
        return self._shared.asleep is not None

    # -- queries ------------------------------------------------------------

    @property
    def captured_buckets(self) -> list[int]:
        """The buckets with a one-token decode graph, in the order they were
        captured (:attr:`captured_graphs` lists every q_len)."""
        return [bucket for bucket, q_len in self.captured_graphs if q_len == 1]

    @property
    def captured_graphs(self) -> list[tuple[int, ...]]:
        """Every full graph's (bucket, q_len), in the order they were captured,
        of the plain variant (``graph()`` finds the others' graphs)."""
        return [key for family in self.families if family.unit == "batch" for key in family.graph_keys()]

    def bucket_of(self, batch_size: int) -> int | None:
        """The graph a batch of ``batch_size`` sequences runs in, or None."""
        if not 1 <= batch_size <= self.config.max_batches:
            raise InputError(f"batch size {batch_size} is outside 1..max_batches={self.config.max_batches}")
        return self._bucket_of[batch_size]

    @one_at_a_time("runner.graph()")
    def graph(self, bucket: int, q_len: int = 1, **variant: Any) -> Any:
        """The captured graph of a batch bucket and query length (the full
        graphs'), if captured; of the graph variant the keywords name
        (``graph(8, lora=True)``; defaults for the rest), the plain one without."""
        batched = [family for family in self.families if family.unit == "batch"]
        if not batched:
            return None
        key = self._shared.variants.key_of(variant, f"runner.graph({bucket}, {q_len}")
        return next((graph for family in batched if (graph := family.lookup((bucket, q_len), key)) is not None), None)

    def __repr__(self) -> str:
        compiled = ", compiled" if self._shared.compiled else ""
        return (
            f"<GraphRunner {self.vendor.name} on {self.config.device}, {self.config.execute_mode} mode{compiled}, "
            f"buckets {list(self.capture_sizes)}, captured "
            f"{self.captured_graphs if self.config.max_q_len > 1 else self.captured_buckets}>"
        )


def _rank_sync(process_group: Any, check_ranks: str) -> RankSync | None:
    if check_ranks not in ("capture", "always"):
        raise ConfigError(f"check_ranks={check_ranks!r}: use 'capture' (start-up and captures) or 'always' (every step)")
    if process_group is None:
        return None
    import torch.distributed as dist

    from graphmode.distributed import RankSync

    if dist.get_world_size(process_group) == 1:
        return None
    return RankSync(process_group, check_replays=check_ranks == "always")


@contextlib.contextmanager
def _fresh_state(shared: RunnerContext) -> Iterator[None]:
    """No model state carried into or out of a warm-up: the engine may change
    the model between calls (``RunnerContext.last_state`` is for one capture loop)."""
    shared.last_state = None
    try:
        yield
    finally:
        shared.last_state = None


@contextlib.contextmanager
def _kept_buffers(shared: RunnerContext) -> Iterator[None]:
    """Warm-up steps leave the model's in-place state (its buffers) as they
    found it (``graphmode.checks.model_state.KeptBuffers``)."""
    kept = shared.kept_buffers = KeptBuffers(shared.model)
    try:
        yield
    finally:
        shared.kept_buffers = None
        kept.restore()


_frozen = [0]  # _frozen_gc blocks entered and not left, process-wide (the collector is)
_frozen_lock = threading.Lock()


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Collect, then keep the collector out of the capture loop: it would
    only slow capture down, finding nothing new to free. A collection with
    the heap frozen scans only the objects made since, so the memory
    meter's collections inside (one per sampled graph, and around a plan)
    cost milliseconds, not the whole heap's 100 to 500 ms each. Blocks nest
    (a plan's warm-up, two runners warming up in two threads): each entry
    collects what was made since the last freeze and freezes it, and the
    heap thaws when the last block leaves."""
    with _frozen_lock:
        _frozen[0] += 1
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        with _frozen_lock:
            _frozen[0] -= 1
            if _frozen[0] == 0:
                gc.unfreeze()

"""Graph families: the ways a runner runs steps as captured device graphs.

A family takes some steps (full decode graphs: uniform decode steps, per
batch bucket and query length; piecewise graphs: any step, per token
bucket), captures a graph for a step on first use and replays it after.
Every family implements :class:`GraphFamily`; an execute mode is an ordered
tuple of families (``graphmode.families.modes``), and the runner hands a step
to the first family that takes it, or runs it eagerly.

The runner owns what the families share (:class:`RunnerContext`: the model, the
vendor, the statistics, the memory pool, debug mode, the ranks), and the
families get it from there, never from the runner itself: this module and
the families import nothing of ``graphmode.runner.runner``.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from graphmode import buffers
from graphmode.checks.cache_checks import CacheFit, FrozenExtras, check_warmup_cache
from graphmode.checks.debug import StepChecker
from graphmode.checks.weight_memory import WeightMemory
from graphmode.config import RunnerConfig
from graphmode.context import KVCache, StepInputs, StepModel
from graphmode.errors import ConfigError
from graphmode.families.compile import compiled_forward
from graphmode.families.host_fields import HostFields
from graphmode.families.stats import RunnerStats
from graphmode.meta import GraphMeta
from graphmode.plugins import Vendor
from graphmode.spec import GraphSpec
from graphmode.staging import staging_refusal
from graphmode.variants import PLAIN, GraphVariants

if TYPE_CHECKING:
    from graphmode.checks.cache_checks import CacheMemory
    from graphmode.checks.model_state import KeptBuffers, ModelState
    from graphmode.distributed import RankSync
    from graphmode.families.decision import StepDecision
    from graphmode.families.sleep import Asleep, SleptGraph
    from graphmode.staging import HostStaging

__all__ = ["FORWARDS_RUN", "Captured", "GraphFamily", "PoolShare", "Report", "RunnerContext"]

#: How warm-up reports progress: (a line, whether it is the last capture).
Report = Callable[[str, bool], None]


class Captured(Protocol):
    """What a captured graph holds by reference, as the identity checks
    (``graphmode.checks.cache_checks.check_same_objects``), debug mode and
    the warm-up cache check read it."""

    meta: GraphMeta  # its declarations (meta.spec.names: the inputs with a buffer)
    cache_tensors: list[Any]  # the KV-cache tensors it captured, in order
    extras: dict[str, Any]  # the extra inputs without a buffer it captured (frozen)
    memory: CacheMemory  # the cache tensors' data pointers at capture
    in_warmup: bool  # captured by warmup(), with the extras given to it

    @property
    def name(self) -> str:
        """How errors name it: "bucket 8, q_len 2", "token bucket 16 (piecewise)"."""
        ...

    def flatten_cache(self, past_key_values: KVCache) -> list[Any]:
        """A step's KV cache as a list of tensors, listed as at capture."""
        ...


class GraphFamily(Protocol):
    """One kind of graph a runner captures and replays. Its graphs are keyed
    on ``RunnerContext.variant`` too (the engine's graph variants, LoRA on or off):
    the runner sets it before each step and each warm-up of a variant, and a
    graph of one variant never serves another's steps."""

    #: How statistics, errors and docs name it ("full", "piecewise").
    name: str
    #: The RunnerConfig setting that chooses its graphs' sizes, which capture
    #: advice names ("capture_batch_sizes", "capture_token_sizes").
    setting: str
    #: What its sizes count ("batch": sequences, "tokens"), and its sizes
    #: (buckets), which tensor-parallel ranks agree on at start-up.
    unit: str
    sizes: tuple[int, ...]
    #: Whether it can feed its graphs from pinned host mirrors
    #: (``host_staging=True`` needs a family that can).
    stages_host: bool
    #: Whether it learns a native replay step (at most one family of a mode does).
    steps_natively: bool
    #: Whether every step it takes carries the same new tokens per sequence
    #: (proved on the host), which debug mode checks as such
    #: (``graphmode.checks.debug.StepChecker.check_step``).
    uniform_steps: bool

    @property
    def staging(self) -> HostStaging | None:
        """Its host staging (``graphmode.staging.HostStaging``) when on, else None."""
        ...

    @property
    def native_step(self) -> Callable[..., Any] | None:
        """The native replay step (``graphmode.native``) the runner tries
        first for every call, once the family has learnt one; None before,
        and for a family that has none."""
        ...

    def refusal(self, inputs: StepInputs, batch: int, q_len: int | None) -> str | None:
        """Why this family does not take the step (a key of
        ``graphmode.families.stats.EAGER_REASONS``), or None when it does.
        ``q_len``: the tokens of every sequence, or None when they differ."""
        ...

    def graph_for(self, inputs: StepInputs, batch: int, q_len: int | None) -> tuple[int, Any]:
        """For a step it takes: the bucket (in its ``unit``) of the graph that
        runs it, and that graph's key (as :meth:`todo` lists keys)."""
        ...

    def run(self, inputs: StepInputs, decision: StepDecision, on_host: bool) -> Any:
        """Run a step the runner decided it takes (``graphmode.families.decision``;
        the runner has had ranks agree on it, checked it in debug mode and
        counts its tokens): capture its graph on first use (the answer is the
        warm-up forward's), replay it after. ``on_host``: the step's tensors
        are host tensors."""
        ...

    def todo(self, q_lens: Sequence[int]) -> list[Any]:
        """The keys of the graphs :meth:`warmup` would capture, in its order
        (largest first): (bucket, q_len) for full graphs, token buckets for
        piecewise ones."""
        ...

    def tokens(self, key: Any) -> int:
        """The tokens the graph of ``key`` (one of :meth:`todo`'s) runs,
        padding included: what its memory grows with (the memory plan's fit)."""
        ...

    def warmup(self, past_key_values: KVCache, extras: dict[str, Any], q_lens: Sequence[int], report: Report,
               only: Sequence[Any] | None = None) -> None:
        """Capture every graph not captured yet, largest first, from inert
        steps (no KV write, only the reserved block read); with ``only``,
        those of these keys (:meth:`todo`'s) only."""
        ...

    def reset(self) -> None:
        """Drop every graph (the runner drops the pool)."""
        ...

    def release(self) -> list[SleptGraph]:
        """Sleep (``graphmode.families.sleep``): drop every graph and every
        buffer the family allocated for its graphs (outputs, break points,
        staging), keeping no device memory, and name the graphs dropped, in
        capture order, for :meth:`recapture`."""
        ...

    def recapture(self, past_key_values: KVCache, graphs: Sequence[SleptGraph], report: Report) -> None:
        """Wake: capture ``graphs`` (of the variant in progress) again,
        largest first, from inert steps, as :meth:`warmup` does."""
        ...

    def captured(self) -> list[Captured]:
        """Every graph captured, in capture order."""
        ...

    def graph_keys(self) -> list[tuple[int, ...]]:
        """The keys of the plain variant's graphs, in capture order (full
        graphs: (bucket, q_len); piecewise graphs: (token bucket,))."""
        ...

    def lookup(self, key: tuple[int, ...], variant: tuple[Any, ...]) -> Captured | None:
        """Its captured graph of ``key`` (as :meth:`graph_keys` lists them) and
        graph variant, or None."""
        ...

    def forget_native(self) -> None:
        """Forget what the native step learnt (an eager step rebound the
        model's tensors: its memo would replay without the runner's check)."""
        ...


#: Every forward object (a model, a compiled forward) with the shapes
#: (:meth:`RunnerContext.forward_shape`) it ran at in this process, warm-up or
#: capture. A warm-up capture of a shape its forward ran at before needs no
#: warm-up forward: what a warm-up forward is for (lazy state set up for a
#: new shape, a rotary table grown, Triton and Inductor compiling and
#: autotuning outside the graph) happened the first time. vLLM runs no
#: warm-up forward per size by default (cudagraph_num_of_warmups=0) after
#: one profiling run; graphmode keeps one per shape and process, and a
#: capture that changes the model's Python state without one is captured
#: again after one (``graphmode.families.full``). Weak keys: a model dropped
#: takes its shapes with it.
FORWARDS_RUN: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


class PoolShare:
    """The memory-pool token of one runner's graphs, or of several runners'
    (``build_graph_runner(share_pool_with=...)``: a draft model's runner and
    its target's). The first capture of any member sets it; every later
    capture of every member captures into it. Their graphs then share
    intermediate memory, so they must replay one after another on one stream,
    as one runner's graphs do; results stay valid (each runner's outputs are
    buffers no later capture reuses)."""

    def __init__(self) -> None:
        self.token: Any = None
        self.members: weakref.WeakSet[RunnerContext] = weakref.WeakSet()


class RunnerContext:
    """What every family of one runner shares, owned by the runner.

    model: what eager steps and captures run (the runner's ``model``).
    compiled: ``compile=True`` in a graph mode; ``forward`` is then the one
        ``torch.compile(model)`` every family's warm-ups and captures run.
    capture_sizes, bucket_of: the batch buckets and the table of the bucket
        of every batch size (``bucket_of[batch]``). pool: the one memory pool
        of every graph of the runner (and of the runners sharing it:
        ``pool_share``), set by the first capture. debug: the step checker in debug mode.
    weights: the addresses of the model's parameters and buffers at the
        first capture (``graphmode.checks.weight_memory``).
    ranks: the :class:`graphmode.distributed.RankSync` of a tensor-parallel
        runner. declared_extras: the engine's declared step inputs (model
        keywords with a buffer, copied in every step rather than frozen).
    variants: the engine's declared graph variants (``graphmode.variants``);
        ``variant`` is the key of the step or warm-up in progress, set by the
        runner (one step at a time), which every family keys its graphs on,
        and ``variant_label`` how statistics and graph names name it.
    A vendor that cannot stage the inputs on the host is refused here when
    the config requires host staging, in every execute mode."""

    def __init__(
        self,
        model: StepModel,
        config: RunnerConfig,
        vendor: Vendor,
        spec: GraphSpec,
        capture_sizes: tuple[int, ...],
        bucket_of: list[int | None],
        ranks: RankSync | None,
    ) -> None:
        self.model, self.config, self.vendor, self.spec = model, config, vendor, spec
        self.capture_sizes, self.bucket_of = capture_sizes, bucket_of
        self.ranks = ranks
        self.compiled = config.compile and config.execute_mode != "eager"
        self._compiled_forward = compiled_forward(model, vendor, config, capture_sizes) if self.compiled else None
        self.stats = RunnerStats()
        #: The step context's host fields, marked on the emulator and derived where the vendor reads them.
        self.host_fields = HostFields(spec, config.device, self.stats, vendor.name)
        self.lock: Any = None  # the runner's one-step lock (the native step takes it too)
        self.pool_share = PoolShare()
        self.pool_share.members.add(self)
        #: The runner's families (set by the runner), asked whether it still holds graphs.
        self.families: Sequence[GraphFamily] = ()
        self.meta: GraphMeta | None = None
        self.debug = StepChecker(model, config.block_size) if config.debug else None
        #: The model's parameters and buffers the graphs captured, and their addresses: every family's
        #: captures hold them, every graph step checks them (the native step too), reset() forgets them.
        self.weights = WeightMemory()
        #: Where the KV cache first meets the runner: every step, warmup() and every capture.
        self.cache_fit = CacheFit(model, config.block_size)
        #: Why the vendor cannot stage this runner's inputs on the host, or None.
        self.staging_refusal = staging_refusal(vendor, config.device)
        if config.host_staging and self.staging_refusal is not None:
            raise ConfigError(f"host_staging=True: {self.staging_refusal}; build the runner with host_staging=None or False")
        self.variants = GraphVariants(config.graph_variants)
        self.variant: tuple[Any, ...] = self.variants.plain
        self.variant_label = PLAIN
        self.variant_index = 0  # the plain variant's (GraphVariants.index), which ranks compare
        self.declared_extras = frozenset(
            path.split(".", 1)[1] for spec in spec.buffers for path in spec.contexts if path.startswith("extras.")
        )
        #: The model state a warm-up capture's check left, while nothing has run the model since
        #: (``ModelState(before=...)``): the next warm-up capture without a warm-up forward starts from it.
        #: Set by warm-up captures, cleared by every warm-up forward and at the start and end of warm-up.
        self.last_state: ModelState | None = None
        #: During a warm-up (``runner.warmup()``, ``plan_memory()``, ``wake()``): the model's buffers as they
        #: were before it, given back after it where its steps changed them (``KeptBuffers``); else None.
        self.kept_buffers: KeptBuffers | None = None
        #: While the runner sleeps (``runner.sleep()``): the graphs its wake captures again; None when awake.
        self.asleep: Asleep | None = None

    def use_variant(self, key: tuple[Any, ...]) -> None:
        """The variant of the step or warm-up about to run."""
        self.variant, self.variant_label = key, self.variants.label(key)
        self.variant_index = self.variants.index(key)

    @property
    def forward(self) -> Any:
        """What warm-ups and captures run: the model, or its compiled forward."""
        # Not `or`: a compiled module's truth value is its model's (len()).
        return self.model if self._compiled_forward is None else self._compiled_forward

    def graph_meta(self) -> GraphMeta:
        """The GraphMeta holding the input buffers every graph shares
        (other families take a copy marked with their ``family``), made (with
        its padding snapshot) on first use; the caller holds inference mode,
        as every step that writes them does."""
        if self.meta is None:
            config = self.config
            meta = GraphMeta(
                max_batchs=config.max_batches,
                max_tokens=config.max_tokens,
                num_blocks=config.max_blocks_per_seq,
                block_size=config.block_size,
                device=config.device,
                spec=self.spec,
                capture_sizes=self.capture_sizes,
                vendor_options=config.vendor_options,
            )
            meta.input_buffers = self.vendor.hook.graphmode_make_buffers(meta=meta)
            buffers.check_made(meta, self.vendor.name)
            meta.padding_buffers = {name: t.clone() for name, t in meta.input_buffers.items()}
            meta.q_len_padding = buffers.q_len_paddings(meta)
            meta.live_buffers = buffers.live_values(meta)
            self.meta = meta
        return self.meta

    @property
    def pool(self) -> Any:
        """The pool token every capture passes (None before the first)."""
        return self.pool_share.token

    def adopt_pool(self, pool: Any) -> None:
        """The first capture's pool becomes every later graph's."""
        if self.pool_share.token is None:
            self.pool_share.token = pool

    def join_pool(self, other: RunnerContext) -> None:
        """Capture into ``other``'s pool from now on (before any capture)."""
        mine, theirs = self.config.device, other.config.device
        if mine.type != theirs.type or None not in (mine.index, theirs.index) and mine.index != theirs.index:
            raise ConfigError(
                f"share_pool_with: that runner's graphs are on {theirs}, this one's on {mine}; a memory pool belongs to one device. Share pools between runners of one device"
            )
        self.pool_share.members.discard(self)
        self.pool_share = other.pool_share
        self.pool_share.members.add(self)

    def release_pool(self) -> None:
        """After this runner dropped its graphs: forget the pool, unless a
        runner sharing it still holds graphs in it (its memory lives on with
        them; the next capture joins it, as a capture into a pool whose
        graphs are all gone may not)."""
        others = [m for m in self.pool_share.members if m is not self]
        if not any(family.captured() for member in others for family in member.families):
            self.pool_share.token = None

    def count_tokens(self, family: str, live: int, padding: int) -> None:
        """A graph step's live and padding tokens, in its family's ``stats``."""
        counts = self.stats.family(family)
        counts.real_tokens += live
        counts.padded_tokens += padding

    def agree_to_capture(self, size: int, bucket: int, unit: str = "batch") -> None:
        """Tensor-parallel ranks agree on a capture before its warm-up's
        collectives (disagreeing ranks would hang in them), unless they
        already agree on every step."""
        if self.ranks is not None and not self.ranks.check_replays:
            self.ranks.agree_on_step(size, bucket, "capture", unit=unit, variant=self.variant_index)

    def check_capture_cache(self, past_key_values: KVCache, graph: str) -> None:
        """Before the capture of ``graph`` (as errors name it): the KV cache
        fits the model, checked again where the engine replaced tensors in a
        container seen before (a step passes the container on its identity),
        and it is the cache the runner's graphs hold, if any (graphs on two
        caches would refuse the steps of either). Once per capture."""
        self.cache_fit.recheck(past_key_values)
        held = next((captured for family in self.families for captured in family.captured()), None)
        if held is not None:  # every capture checks it: the first graph stands for all
            check_warmup_cache([held], past_key_values, f"a step capturing the graph of {graph}")

    def warm_up(self, run: Callable[[], Any], shape: tuple[Any, ...] | None = None) -> Any:
        """``run()``, a capture's warm-up forward; with ``compile=True`` its
        time (the compilation) counts in ``stats.compile_seconds``. ``shape``
        (:meth:`forward_shape`): the forward then counts as having run at it."""
        self.last_state = None  # the forward may change the model's state (lazily, once)
        started = time.perf_counter()
        if self.kept_buffers is not None:
            self.kept_buffers.forward_starts()
        output = run()
        if self.kept_buffers is not None:
            self.kept_buffers.forward_ran()
        if self.compiled:
            self.stats.compile_seconds += time.perf_counter() - started
        if shape is not None:
            self.ran_at(shape)
        return output

    def forward_shape(self, family: str, size: int, q_len: int, past_key_values: KVCache,
                      extras: dict[str, Any]) -> tuple[Any, ...]:
        """What a capture's forward depends on beyond the model: the family,
        its size (batch bucket or token bucket), the query length, the graph
        variant, the extras' names and the KV cache's layout (each tensor's
        shape past its first dimension, the blocks, and its strides, dtype
        and device): not the cache's identity or its number of blocks, which
        size nothing a graph holds (``graphmode.memory.plan``), so that the
        plan's captures on a probe cache count for the warm-up's."""
        cache = tuple((tuple(t.shape[1:]), t.stride()[1:], t.dtype, t.device) for t in tree_leaves(past_key_values)
                      if isinstance(t, torch.Tensor))
        return (family, size, q_len, self.variant, tuple(sorted(extras)), cache)

    def has_run_at(self, shape: tuple[Any, ...]) -> bool:
        """Whether this runner's forward (the model, or its compiled forward)
        ran at ``shape`` before in this process (:data:`FORWARDS_RUN`)."""
        try:
            return shape in FORWARDS_RUN.get(self.forward, ())
        except TypeError:  # a forward that takes no weak reference: never known
            return False

    def ran_at(self, shape: tuple[Any, ...]) -> None:
        """Note that the forward ran at ``shape`` (a warm-up forward, a capture)."""
        with contextlib.suppress(TypeError):
            FORWARDS_RUN.setdefault(self.forward, set()).add(shape)

    def frozen_extras(self, extras: dict[str, Any]) -> FrozenExtras:
        """The extra inputs a graph captures by reference (those without a
        buffer): later steps must pass the same objects, holding the same values."""
        return FrozenExtras({name: value for name, value in extras.items() if name not in self.declared_extras})

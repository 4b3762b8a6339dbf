"""The harness: runs the same decode steps through graphs and eagerly, and
checks each step with messages that say what broke and why.

Graph steps go through the vendor's runner into one KV cache; eager steps go
through the model into another. After every step:

- the runner raised nothing (an error names the hook it came from: a host
  read on the replay path, an update racing the previous replay);
- the engine's step tensors are unmodified;
- after a graph step, every declared buffer holds what its declaration says
  (padding rows, live rows) and the context the bucket's graph captured is
  made of views of the buffers (:mod:`graphmode_conformance.structure`);
- outputs must match eager (same shape: the live tokens only);
- the graph's cache may only have changed at the slots this step wrote, and
  those must match eager; every other byte, the reserved block's included,
  must be unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import graphmode
from graphmode.context import StepInputs
from graphmode.errors import InputError
from graphmode.families.piecewise.graphs import PiecewiseGraphs
from graphmode.graphs import DeviceGraph
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine
from graphmode.staging import to_host
from graphmode_conformance.compare import check_padding_finite, compare_outputs, tolerance
from graphmode_conformance.launch_stream import launch_stream_cause
from graphmode_conformance.persistent import in_persistent_tensors
from graphmode_conformance.sizes import Sizes
from graphmode_conformance.structure import (
    ConformanceFailure,
    DeclaredBuffers,
    check_context,
    check_unmodified,
    query_bound_problem,
    step_tensors,
)

__all__ = ["ConformanceFailure", "Harness", "Sizes", "piecewise_of"]


def piecewise_of(runner: Any) -> PiecewiseGraphs | None:
    """The runner's piecewise graphs (execute modes "piecewise" and "full_and_piecewise"), or None."""
    family = runner.family("piecewise")
    assert family is None or isinstance(family, PiecewiseGraphs)
    return family


@dataclass
class Harness:
    vendor: graphmode.Vendor
    device: torch.device
    sizes: Sizes  # resolved: every size a number
    runner: graphmode.GraphRunner
    model: Any
    engine: ReferenceEngine
    graph_cache: list
    eager_cache: list
    check: str = "graph equals eager"
    steps_run: int = 0
    last_capture: dict[int, int] = field(default_factory=dict)
    # The context the forward saw at each bucket's capture, and the checker
    # of the declared buffers (made with the runner's buffers).
    contexts: dict[int, StepInputs] = field(default_factory=dict)
    declared: DeclaredBuffers | None = None
    variant: str = ""  # ", vendor_options {...}" when the run gave some
    host_inputs: bool = False  # the runner gets host copies of each step's tensors (host staging)
    # The runner gets each step's tensors as views of persistent ones written
    # in place (the block table as the first columns of a wider table: not
    # contiguous), as an engine keeping a persistent batch passes them.
    sliced_tables: bool = False
    _persistent: dict[str, torch.Tensor] = field(default_factory=dict)
    _recording: bool = False
    _captured_context: StepInputs | None = None

    @classmethod
    def build(
        cls,
        vendor: graphmode.Vendor,
        device: torch.device,
        sizes: Sizes,
        model_config: ModelConfig | None = None,
        seed: int = 0,
        vendor_options: Mapping[str, Any] | None = None,
        wrap: Callable[[Any], Any] | None = None,
        share_pool_with: graphmode.GraphRunner | None = None,
        **runner_options: Any,
    ) -> Harness:
        """A runner of ``vendor`` at ``sizes`` (block size and capture list
        left to the vendor's declarations where ``sizes`` leaves them), under
        ``vendor_options``, and an engine whose block tables are as wide as
        each step's longest sequence needs. ``wrap``: a function of the
        reference model giving the model under test (one reading engine step
        inputs, say); it keeps the model's ``ops``, ``config`` and
        ``make_kv_cache``. ``share_pool_with``: another harness's runner whose
        memory pool this runner's graphs share (a draft model's runner)."""
        sizes = sizes.resolved(vendor)
        config = model_config or ModelConfig.tiny(sizes.dtype)
        runner_options.setdefault("capture_batch_sizes", sizes.capture_sizes)
        if vendor_options is not None:
            runner_options.setdefault("vendor_options", dict(vendor_options))
        # The model's kernels and the runner under the same options.
        model = build_reference_model(config, vendor, device, seed=seed,
                                      vendor_options=runner_options.get("vendor_options"))
        if wrap is not None:
            model = wrap(model)
        runner = graphmode.GraphRunner(
            model,
            graphmode.RunnerConfig(
                sizes.max_batches, sizes.table_width, sizes.block, device, **runner_options,
            ),
            vendor,
            share_pool_with=share_pool_with,
        )
        engine = ReferenceEngine(
            sizes.cache_blocks, sizes.block, device, vocab_size=config.vocab_size, table_width=None, seed=seed + 1,
        )
        harness = cls(
            vendor, device, sizes, runner, model, engine,
            model.make_kv_cache(sizes.cache_blocks, sizes.block),
            model.make_kv_cache(sizes.cache_blocks, sizes.block),
        )
        if vendor_options:
            harness.variant = f", vendor_options {dict(vendor_options)}"
        model.register_forward_pre_hook(harness._record_context, with_kwargs=True)
        return harness

    def _record_context(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Keep the step context the runner's capture gives the forward."""
        if self._recording:
            names = ("input_ids", "position_ids", "past_key_values", "attn_metadata")
            given = dict(zip(names, args)) | kwargs
            extras = {k: v for k, v in given.items() if k not in names}
            self._captured_context = StepInputs(
                given["input_ids"], given["position_ids"], given["past_key_values"], given["attn_metadata"], extras,
            )

    # -- sequences ----------------------------------------------------------

    def start(self, count: int, lengths: list[int] | None = None) -> list[int]:
        """New sequences, prefilled (eagerly) into both caches."""
        seqs = [self.engine.add() for _ in range(count)]
        longest = self.sizes.table_width * self.sizes.block // 2
        lengths = lengths or [self.engine.rng.randrange(1, longest) for _ in seqs]
        step = self.engine.prefill(seqs, lengths)
        with torch.inference_mode():
            self._call_runner(step)
            self._call_model(step)
        return seqs

    def finish(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.engine.finish(seq)

    def room(self, seqs: list[int], steps: int) -> bool:
        """Whether every sequence can take ``steps`` more tokens."""
        limit = self.sizes.table_width * self.sizes.block
        return all(self.engine.sequences[s].kv_len + steps <= limit for s in seqs)

    # -- one checked step ---------------------------------------------------

    def step(self, seqs: list[int]) -> torch.Tensor:
        """One decode step through graphs and eagerly; raise
        :class:`ConformanceFailure` if they disagree, a declared buffer or
        the cache was hurt, or the engine's inputs changed."""
        owners = self._block_owners()
        inputs = self.engine.decode(seqs)
        batch = len(seqs)
        bucket = self.runner.bucket_of(batch)
        # A decode step a full graph serves (piecewise mode serves it in segments, not from the buffers).
        graph_step = bucket is not None and self.runner.config.execute_mode in ("graph", "full_and_piecewise")
        phase = "replay" if bucket in self.runner.captured_buckets else "capture"
        self.steps_run += 1
        where = (
            f"vendor {self.vendor.name} on {self.device}{self.variant}, batch {batch}, bucket {bucket}, "
            f"step {self.steps_run} ({phase})"
        )
        before = [tuple(t.clone() for t in pair) for pair in self.graph_cache]
        meta = self.runner.graph_meta() if graph_step else None
        buffers_before = DeclaredBuffers.snapshot(meta) if meta is not None else {}
        snapshot = step_tensors(inputs)
        with torch.inference_mode():
            self._recording, self._captured_context = graph_step and phase == "capture", None
            try:
                raw = self._call_runner(inputs)
            except ConformanceFailure:
                raise
            except Exception as error:
                cause = None
                if graph_step and phase == "replay" and bucket is not None:
                    from graphmode_conformance.unseen import (  # unseen imports this module
                        missing_update_cause,
                        pushed_length_cause,
                    )
                    cause = missing_update_cause(self) or pushed_length_cause(self, self.graph_of(inputs, bucket), bucket)
                described = self.describe_error(error) + (f". Likely cause: {cause}" if cause else "")
                raise ConformanceFailure(f"[{self.check}] {where}: {described}") from error
            finally:
                self._recording = False
            if self._captured_context is not None and bucket is not None:
                self.contexts[bucket] = self._captured_context
            graph = raw.clone() if isinstance(raw, torch.Tensor) else raw
            # The probes refill the buffers from a copy of the step: not where
            # the runner's tensors are persistent, whose fill they would redo.
            probes = self._probes(batch, bucket) if graph_step and not self.sliced_tables else []
            check_unmodified(where, inputs, snapshot, probes)
            eager = self._call_model(inputs)
        if meta is not None and bucket is not None:
            self.check_buffers(where, meta, inputs, batch, bucket, buffers_before)
            context = self.contexts.get(bucket)
            if context is not None:
                check_context(where, meta.spec, meta, context, batch, bucket)
        where = f"[{self.check}] {where}"
        try:
            self._check_outputs(where, graph, eager, seqs, phase, raw=raw)
        except ConformanceFailure as failure:
            if meta is None or bucket is None or phase != "replay":
                raise
            if self.device.type != "cpu":  # the emulator refuses a replay on an unordered stream where it happens
                captured = self.graph_of(inputs, bucket)
                launched = launch_stream_cause(lambda: self._call_runner(inputs), self.device,
                                               getattr(captured, "graph", None))
                if launched is None:
                    raise
                raise ConformanceFailure(str(failure).split(" Likely cause: ")[0] + f" Likely cause: {launched}") \
                    from None
            from graphmode_conformance.unseen import (  # it imports this module
                length_bound_cause,
                missing_update_cause,
                pushed_values_cause,
            )

            pushed = missing_update_cause(self) \
                or pushed_values_cause(self, self.graph_of(inputs, bucket), batch, bucket, buffers_before) \
                or length_bound_cause(self, self.graph_of(inputs, bucket), batch)
            if pushed is None:
                raise
            message = str(failure)
            raise ConformanceFailure(message.split(" Likely cause: ")[0] + f" Likely cause: {pushed}") from None
        if graph_step and bucket is not None and phase == "replay" and self.check != "reserved block":
            captured = self.graph_of(inputs, bucket)
            if captured is not None:
                check_padding_finite(where, captured.meta, inputs.input_ids.shape[-1])
        self._check_cache(where, before, owners)
        return graph

    def graph_of(self, inputs: StepInputs, bucket: int) -> Any:
        """The full graph that serves the decode step ``inputs`` in ``bucket``:
        of its query length and of its graph variant (the variant keywords
        among its extras), or None. Graphs are keyed so; a cause found in
        another graph of the bucket would be the wrong graph's."""
        inputs = self.with_extras(inputs)
        q_len = inputs.input_ids.shape[-1] // max(inputs.attn_metadata.batch_size, 1)
        names = self.runner.config.graph_variants
        variant = {name: inputs.extras[name] for name in names if name in inputs.extras}
        return self.runner.graph(bucket, q_len, **variant)

    def check_buffers(
        self, where: str, meta: Any, inputs: StepInputs, batch: int, bucket: int, before: dict[str, torch.Tensor],
    ) -> None:
        """The declared-buffer checks after a fill of (batch, bucket)."""
        if self.declared is None:
            self.declared = DeclaredBuffers(self.vendor, meta)
        self.declared.check(where, meta, self.with_extras(inputs), batch, bucket, before)

    def with_extras(self, inputs: StepInputs) -> StepInputs:
        """The step as the runner got it: with the extra keyword inputs a
        subclass passes (an engine's declared step inputs)."""
        return inputs

    def _probes(self, batch: int, bucket: int | None) -> list:
        """Each hook that is given the engine's step, called alone on a copy."""
        meta, hook = self.runner.graph_meta(), self.vendor.hook

        def fill(step: StepInputs) -> None:
            hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)

        def context(step: StepInputs) -> None:
            hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket)

        return [("graphmode_fill_buffers", fill), ("graphmode_update_context", context)]

    def describe_error(self, error: BaseException) -> str:
        """An error the runner raised, with the vendor hook it came from."""
        hooks = {}
        for name in dir(self.vendor.hook):
            if name.startswith("graphmode_"):
                for impl in getattr(self.vendor.hook, name).get_hookimpls():
                    hooks[getattr(impl.function, "__code__", None)] = (name, impl.plugin_name)
        # A declared source function runs inside the default fill: name the buffer, not graphmode's hook.
        sources = {getattr(spec.source, "__code__", None): spec.name
                   for spec in self.runner.spec.buffers if callable(spec.source)}
        raised_in, source, replayed = None, None, None
        traceback = error.__traceback__
        while traceback is not None:
            found = hooks.get(traceback.tb_frame.f_code)
            if found is not None:
                raised_in = found
            graph = traceback.tb_frame.f_locals.get("self")
            if replayed is None and traceback.tb_frame.f_code.co_name == "replay" and isinstance(graph, DeviceGraph):
                replayed = type(graph).__qualname__
            source = sources.get(traceback.tb_frame.f_code, source)
            traceback = traceback.tb_next
        where = f" in {raised_in[0]} (plugin {raised_in[1]})" if raised_in else ""
        if raised_in is None and replayed is not None:
            where = f" in {replayed}.replay() (the graph graphmode_make_graph returned)"
        text = f"the runner raised {type(error).__name__}{where}: {error}"
        if raised_in is None and replayed is not None and self.vendor.implements("graphmode_update_graph_params"):
            # A runtime refusing a replay: most often an update the hook skipped.
            text += (". The vendor pushes host values before replays: a replay its runtime refuses is most often "
                     "an update graphmode_update_graph_params skipped or left incomplete (it runs before every "
                     "replay, and must push into every captured call each time, changed or not)")
        if source is not None:
            text += (
                f". It was raised in the source function of buffer {source}, which the fill calls before every "
                f"replay: a source function computes the rows on the device (torch operations on the step's "
                f"tensors), never reads them on the host. Fix the BufferSpec {source!r} of graphmode_graph_spec"
            )
        if self.host_inputs and raised_in and isinstance(error, InputError) and "are a device tensor" in str(error):
            # Not the engine's: every step tensor the runner got here is a host tensor.
            text += (
                f". But every step tensor the runner got here is a host tensor: that device tensor is "
                f"{raised_in[0]}'s own, computed from device memory (the buffers of meta.input_buffers, which host "
                "staging writes only when the step's copy launches, after the fill: they hold the previous step's "
                f"values). Hook: {raised_in[0]} (plugin {raised_in[1]}) must compute what it stages from the step's "
                "tensors (its inputs), never from the device buffers"
            )
        return text

    def _call_runner(self, inputs: StepInputs) -> Any:
        if self.sliced_tables:
            inputs = in_persistent_tensors(self._persistent, inputs)
        if self.host_inputs:
            inputs = to_host(inputs, self.device)
        return self.runner(inputs.input_ids, inputs.position_ids, self.graph_cache, inputs.attn_metadata)

    def _compared(
        self, inputs: StepInputs, phase: str, per_token_seqs: list[int], describe: Callable[[int], str],
        full_graph: tuple[int, int] | None = None,
    ) -> str:
        """One step through the runner and eagerly, its outputs and the cache
        checked; ``describe(step number)`` names it in failures. Returns that
        name, ``[check]`` first. ``full_graph``: (batch, bucket) of a step a
        full graph serves, whose declared buffers are checked first."""
        owners = self._block_owners()
        before = [tuple(t.clone() for t in pair) for pair in self.graph_cache]
        meta = self.runner.graph_meta() if full_graph is not None else None
        buffers_before = DeclaredBuffers.snapshot(meta) if meta is not None else {}
        self._recording, self._captured_context = full_graph is not None and phase == "capture", None
        try:
            raw, graph, eager = self._graph_and_eager(inputs)
        finally:
            self._recording = False
        self.steps_run += 1
        where = f"[{self.check}] {describe(self.steps_run)}"
        if meta is not None and full_graph is not None:
            self.check_buffers(where.split("] ", 1)[1], meta, inputs, *full_graph, buffers_before)
            bound = query_bound_problem(self._captured_context, inputs.num_tokens // full_graph[0])
            if bound is not None:
                raise ConformanceFailure(f"{where}: {bound}")
        self._check_outputs(where, graph, eager, per_token_seqs, phase, raw=raw)
        self._check_cache(where, before, owners)
        return where

    def _graph_and_eager(self, inputs: StepInputs) -> tuple[Any, Any, Any]:
        """The step through the runner (as returned, and copied: the next step
        overwrites it) and eagerly on the model."""
        with torch.inference_mode():
            try:
                raw = self._call_runner(inputs)
            except ConformanceFailure:
                raise
            except Exception as error:  # named with the hook it came from, as decode steps are
                batch = len(inputs.attn_metadata.q_seqlens)
                # The context recorded for this step: only a capture step of _compared records one.
                recorded = self._captured_context if self._recording else None
                bound = query_bound_problem(recorded, inputs.num_tokens // batch)
                raise ConformanceFailure(
                    f"[{self.check}] vendor {self.vendor.name} on {self.device}{self.variant}, a step of "
                    f"{batch} sequences and {inputs.num_tokens} tokens: "
                    f"{self.describe_error(error)}" + (f". Likely cause: {bound}" if bound else "")
                ) from error
            graph = raw.clone() if isinstance(raw, torch.Tensor) else raw
            return raw, graph, self._call_model(inputs)

    def _call_model(self, inputs: StepInputs) -> Any:
        """The step eagerly, on the model itself (the reference)."""
        return self.model(inputs.input_ids, inputs.position_ids, self.eager_cache, inputs.attn_metadata)

    def _check_outputs(
        self, where: str, graph: Any, eager: torch.Tensor, seqs: list[int], phase: str, raw: Any = None,
    ) -> None:
        compare_outputs(where, graph, eager, seqs, phase, raw, self.model.ops)

    # -- the KV cache -------------------------------------------------------

    def slot_rows(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as (num_slots, values), whatever the vendor's layout."""
        view = self.model.ops.block_view(cache, self.model.config.head_dim)
        return view.reshape(view.shape[0] * view.shape[1], -1)

    def _block_owners(self) -> dict[int, str]:
        owners = {0: "the reserved block 0"}
        for seq in self.engine.sequences.values():
            for block in seq.blocks:
                owners[block] = f"block {block} of sequence {seq.seq_id}"
        return owners

    def _check_cache(self, where: str, before: list, owners: dict[int, str]) -> None:
        written = torch.tensor(sorted(set(self.engine.step_slots)), dtype=torch.long, device=self.device)
        atol, rtol = tolerance(self.model.config.dtype)
        for layer, (old_pair, new_pair, eager_pair) in enumerate(zip(before, self.graph_cache, self.eager_cache)):
            for name, old, new, eager in zip(("key", "value"), old_pair, new_pair, eager_pair):
                old_rows, new_rows = _bits(self.slot_rows(old)), _bits(self.slot_rows(new))
                changed = (old_rows != new_rows).any(dim=1)
                changed[written] = False
                if changed.any():
                    slots = changed.nonzero().flatten().tolist()
                    hurt = []
                    for slot in slots[:4]:
                        block = slot // self.sizes.block
                        hurt.append(f"slot {slot}: {owners.get(block, f'free block {block}')}")
                    cause = (
                        "a padding slot wrote into the cache (padding slots must be -1), "
                        "a stale slot index from an earlier, larger batch, or the vendor's fill_kv_cache "
                        "writing for slot -1 (which must write nothing: indexing with -1 writes the "
                        "cache's last slot)"
                    )
                    if slots == [changed.shape[0] - 1]:
                        cause = (
                            f"slot {slots[0]} is the cache's last slot: the vendor's fill_kv_cache "
                            "(graphmode_attention_ops) indexed the cache with a padding row's slot -1, which "
                            "Python and torch read as the last element. A slot < 0 must write nothing: mask it "
                            "(graphmode.attention.write_slots does)"
                        )
                    elif slots == [0]:
                        cause = (
                            "slot 0 is the first slot of the reserved block 0: a padding row's slot -1 became slot "
                            "0, in the vendor's fill_kv_cache (graphmode_attention_ops: a clamp, or a -1 redirected "
                            "to 0 and written), or the padding slot itself was 0 (in a full-graph step the "
                            "declared-buffer check, run first, names that). A slot < 0 must write nothing: mask it "
                            "(graphmode.attention.write_slots does)"
                        )
                    raise ConformanceFailure(
                        f"{where}: the graph step changed {len(slots)} {name}-cache slots of layer "
                        f"{layer} that no live token of this step writes ({'; '.join(hurt)}). "
                        f"Likely cause: {cause}"
                    )
                graph_rows = self.slot_rows(new)[written].float()
                eager_rows = self.slot_rows(eager)[written].float()
                if not torch.allclose(graph_rows, eager_rows, atol=atol, rtol=rtol):
                    raise ConformanceFailure(
                        f"{where}: the {name} written to layer {layer}'s cache differs from eager by "
                        f"{(graph_rows - eager_rows).abs().max().item():.3g}. Likely cause: stale inputs "
                        "(input ids or positions not refilled) or a wrong slot mapping"
                    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bits, so that byte-for-byte comparison also holds for NaNs."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer)

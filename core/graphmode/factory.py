"""build_graph_runner: the one call an engine makes."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from typing import Any

import torch

from graphmode.config import RunnerConfig
from graphmode.context import KVCache, StepModel
from graphmode.memory import MemoryMeter, MemoryPlan
from graphmode.plugins import Vendor, select_vendor
from graphmode.runner import GraphRunner
from graphmode.spec import BufferSpec

__all__ = ["RUNNER_KEYWORDS", "build_graph_runner", "model_device", "plan_graph_memory"]

#: The RunnerConfig fields build_graph_runner takes as keywords of the same
#: name: all but ``head_dim``, read from the model's config.
RUNNER_KEYWORDS = tuple(f.name for f in dataclasses.fields(RunnerConfig) if f.name != "head_dim")


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter or buffer (CPU if none)."""
    for tensor in (*model.parameters(), *model.buffers()) if hasattr(model, "parameters") else ():
        return tensor.device
    return torch.device("cpu")


def build_graph_runner(
    model: StepModel,
    *,
    max_batches: int,
    max_blocks_per_seq: int,
    block_size: int,
    device: torch.device | str | None = None,
    vendor: str | Vendor | None = None,
    execute_mode: str | None = None,
    capture_batch_sizes: Sequence[int] | None = None,
    vendor_options: Any = None,
    step_inputs: Sequence[BufferSpec] = (),
    process_group: Any = None,
    check_ranks: str = "always",
    compile: bool = False,
    compile_options: dict[str, Any] | None = None,
    host_staging: bool | None = None,
    debug: bool = False,
    capture_token_sizes: Sequence[int] | None = None,
    max_q_len: int = 1,
    graph_variants: dict[str, Sequence[Any]] | None = None,
    share_pool_with: GraphRunner | None = None,
    host_bookkeeping: Sequence[str] = (),
) -> GraphRunner:
    """A runner that serves ``model``'s decode steps from device graphs.

    model: any callable taking ``input_ids, position_ids, past_key_values,
        attn_metadata`` (plus extras) and returning tensors whose second
        dimension is the token (hidden states or logits).
    max_batches: the most sequences per step. max_blocks_per_seq: the
        widest block table a step may carry, in blocks (its columns: the most
        KV blocks one sequence holds), not the KV cache's size, which
        ``make_kv_cache(num_cache_blocks, block_size)`` takes. block_size:
        tokens per KV block.
    device: the model's device by default; "cpu" captures emulated graphs.
    vendor: a vendor name, or a loaded :class:`graphmode.Vendor` (as
        ``build_reference_model`` takes: ``load_vendor(name, plugin=module)``
        for a plugin not installed); else ``$GRAPHMODE_VENDOR``; else detection.
    execute_mode: "graph" (full graphs for decode steps), "piecewise" (every
        step in piecewise graphs), "full_and_piecewise" (full graphs for
        uniform decode, piecewise for the rest), or "eager"; None takes the
        vendor's default (``VendorInfo.execute_mode``); ``$GRAPHMODE_EXECUTE_MODE``
        overrides all.
    capture_batch_sizes: the buckets to capture; batches above the largest run
        eagerly. None lets the vendor choose.
    vendor_options: settings for the vendor plugin (see its docs): a dict of
        its options' fields, or its options object.
    step_inputs: the engine's own per-step model inputs, declared as
        :class:`graphmode.spec.BufferSpec` (name, dtype, shape, padding):
        filled every step with the rest, passed to the model as views of
        their buffers (docs/engines.md).
    process_group: the tensor-parallel group, when the model is sharded: the
        ranks then agree on buckets and capture together (see
        docs/tensor-parallel.md). check_ranks: "always" (default) checks that
        every rank runs the same batch before each graph step, so that a
        disagreement raises instead of hanging; "capture" checks only at
        start-up and before captures, for engines that guarantee agreement.
    compile: capture ``torch.compile(model)`` (Inductor kernels) in the
        graphs; eager steps run the model uncompiled. Refused for vendors
        without the ``inductor_graphs`` capability and on the CPU emulator.
        Compile time shows in ``runner.stats.compile_seconds``.
    compile_options: arguments for ``torch.compile`` (default
        ``dynamic=True``: one compilation serves every bucket); modes that
        record their own CUDA graphs are refused.
    host_staging: True to feed the graphs from one pinned host mirror (step
        inputs on the host), False for the device-side fill, None to decide at
        the first graph step from where its inputs are (docs/architecture.md).
    debug: check every step's device values (graph and eager steps) and the
        captured tensors' addresses, at one synchronisation per step (``$GRAPHMODE_DEBUG=1``
        overrides; docs/engines.md, "Debug mode").
    capture_token_sizes: the token buckets of piecewise graphs; None takes
        vLLM's default list (docs/architecture.md, "Piecewise graphs").
    max_q_len: the most new tokens per sequence a decode graph takes: 1
        (default) for one-token decode; ``1 + k`` to replay graphs for
        speculative verify or MTP steps of ``k`` draft tokens, keyed by
        (batch bucket, q_len) (docs/engines.md, "Speculative decoding").
    graph_variants: keyword arguments of the model that pick among graphs of
        their own, with their values, the default first:
        ``{"lora": (False, True)}``; each step passes the keyword, each value
        gets its own graphs sharing the pool and the buffers, and an
        undeclared value is refused (docs/engines.md, "Graph variants").
    share_pool_with: another runner on the same device whose graph memory
        pool this runner's graphs share (a draft model's runner: its
        target's), so that the two sets of graphs reuse one another's
        intermediate memory. Their steps must then run one after another
        on one stream, as one runner's do (docs/engines.md, "Draft-model
        graphs").
    host_bookkeeping: the model's attributes that are host bookkeeping no
        output depends on (a call counter, a profiling list), by the names
        capture errors give them or fnmatch patterns (``("calls",
        "layers.*.timings")``): a capture accepts a forward that changes
        them, and graph steps leave them unchanged. Any other attribute the
        forward changes at every call (rebound, or a list, dict or set
        changed in place) is refused at capture (docs/engines.md, "Model
        contract").
    """
    arguments = locals()
    chosen = select_vendor(vendor, device if device is not None else model_device(model))
    # Every RunnerConfig field is a keyword here of the same name (tests/test_config.py checks it), taken as given
    # but for these, which the runner derives or normalises.
    settings = {name: arguments[name] for name in RUNNER_KEYWORDS}
    settings.update(
        device=torch.device(device) if device is not None else model_device(model),
        execute_mode=execute_mode or chosen.info.execute_mode,
        capture_batch_sizes=tuple(capture_batch_sizes) if capture_batch_sizes is not None else None,
        capture_token_sizes=tuple(capture_token_sizes) if capture_token_sizes is not None else None,
        step_inputs=tuple(step_inputs),
        compile_options=dict(compile_options or {}),
        graph_variants=dict(graph_variants or {}),
        head_dim=_head_dim(getattr(model, "config", None)),
    )
    config = RunnerConfig(**settings)
    return GraphRunner(
        model, config, chosen, process_group=process_group, check_ranks=check_ranks, share_pool_with=share_pool_with,
    )


def plan_graph_memory(
    model: StepModel,
    past_key_values: KVCache,
    *,
    q_lens: Sequence[int] | None = None,
    warmup_extras: dict[str, Any] | None = None,
    **runner_arguments: Any,
) -> MemoryPlan:
    """The device memory the graphs of ``build_graph_runner(model,
    **runner_arguments)`` will take, before the KV cache exists, from a
    runner built, planned (:meth:`GraphRunner.plan_memory` on
    ``past_key_values``, a probe cache of a few blocks) and dropped: for
    comparing configurations (capture lists, execute modes) before building
    the one to serve with. Its figure includes the buffers that runner kept,
    since the runner that serves allocates them anew; planning the serving
    runner itself (``runner.plan_memory``) costs one capture of every graph
    less, and with ``compile=True`` one compilation less."""
    device = torch.device(runner_arguments["device"]) if runner_arguments.get("device") else model_device(model)
    with MemoryMeter(device) as meter:
        runner = build_graph_runner(model, **runner_arguments)
        planned = runner.plan_memory(past_key_values, q_lens=q_lens, **(warmup_extras or {}))
        with_runner = meter.used()
        del runner
        gc.collect()
        released = with_runner - meter.used()  # the buffers it kept, freed with it
    return MemoryPlan(planned.bytes + released, planned.families, planned.kept - released, planned.warmup)


def _head_dim(model_config: Any) -> int | None:
    """The attention head size a model config states (``head_dim``, else
    ``hidden_size // num_attention_heads``), or None."""
    head_dim = getattr(model_config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = getattr(model_config, "hidden_size", None), getattr(model_config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None

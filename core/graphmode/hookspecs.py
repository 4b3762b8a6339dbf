"""Hook specifications: everything a vendor plugin can provide.

A vendor plugin is a module (or object) with functions decorated by
``graphmode.hookimpl`` whose names match the functions below. The built-in
CUDA plugin (``graphmode.default``) implements every hook; a vendor registers
after it and therefore answers first, so it overrides only what it must.

Call semantics are stated per hook: "first result" hooks stop at the first
implementation that returns something other than None; the others call every
implementation, the vendor's first. A plugin extends a default instead of
replacing it with ``@hookimpl(wrapper=True)``: ``result = yield`` runs the
rest, then the wrapper may change the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from graphmode.attention import AttentionOps
    from graphmode.config import RunnerConfig
    from graphmode.context import StepInputs
    from graphmode.graphs import DeviceGraph
    from graphmode.meta import GraphMeta
    from graphmode.plugins import VendorInfo
    from graphmode.spec import GraphSpec

hookspec = pluggy.HookspecMarker("graphmode")


# -------------------------------------------------------------------------
# Identity and configuration
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def graphmode_vendor_info() -> VendorInfo:
    """Describe this vendor: its name, the device types it runs on, its
    runtime and version, and whether its hardware is present here (with the
    reason when not). Called to list and auto-detect vendors, once per loaded
    vendor (cached on the ``Vendor``); it must be cheap and must not fail
    when the runtime is missing: import the runtime inside the hook.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_graph_spec() -> GraphSpec:
    """The vendor's declarations (:class:`graphmode.spec.GraphSpec`): its
    graph buffers (name, dtype, shape, padding value, where a step's values
    come from, host or device memory) and its constraints (block sizes, KV
    layout, capture-size policy, the maxima graph contexts pass, the options
    dataclass). The built-in buffer hooks allocate, fill and view the
    buffers from it. Called once per loaded vendor (cached on the
    ``Vendor``); must be cheap and pure; anything but a GraphSpec is refused.

    Stops at the first non-None result (the default: ``CUDA_SPEC``).
    """


@hookspec
def graphmode_check_config(config: RunnerConfig) -> None:
    """Check the runner configuration before anything is allocated, for what
    the declarations cannot say (an environment variable, a runtime
    version). By then ``config.vendor_options`` is the vendor's options
    object, built from what the engine passed and checked by its dataclass;
    a hook may replace it with a resolved copy (``dataclasses.replace``).
    Raise :class:`graphmode.ConfigError` to refuse a setting, with the value
    and the fix in the message. Block sizes are checked by the core against
    ``GraphSpec.block_sizes`` before this hook runs.

    Every implementation is called, the vendor's first.
    """


# -------------------------------------------------------------------------
# Buckets
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def graphmode_capture_sizes(config: RunnerConfig, spec: GraphSpec) -> list[int]:
    """The batch sizes to capture a graph for: ascending, unique, within
    ``1..config.max_batches`` and the vendor's declared graphs (none above
    ``spec.max_capture_size``; only listed sizes for ``FixedSizes``).
    ``config.capture_batch_sizes`` is the user's list when given; a plugin
    may trim it but must not add sizes to it. The default:
    ``spec.capture_list(config.max_batches, config.capture_batch_sizes)``.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_compatible_size(batch_size: int, capture_sizes: tuple[int, ...]) -> int | None:
    """The bucket a batch of ``batch_size`` sequences runs in: a member of
    ``capture_sizes`` that is >= batch_size, or None when no graph can hold
    it (the step then runs eagerly), allowed only above the largest capture
    size. The runner calls it once per batch size at start-up, never per
    step, and refuses any other answer.

    Stops at the first non-None result.
    """


# -------------------------------------------------------------------------
# Buffers and the step context
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def graphmode_make_buffers(meta: GraphMeta) -> dict[str, torch.Tensor]:
    """Allocate the fixed input buffers, sized by ``meta`` (``max_batchs``
    rows per sequence, ``max_tokens`` per token). Called once per runner.
    The default allocates every buffer of ``meta.spec``; override it only
    for memory the declarations cannot describe, and return exactly the
    declared names with the declared shapes.

    Each buffer must hold its padding value when returned: the runner
    snapshots them into ``meta.padding_buffers`` and fills unused rows from
    that snapshot. Padding must be neutral: slot -1 (no KV write), block rows
    on reserved block 0, lengths that make valid, harmless work.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_fill_buffers(
    meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int
) -> bool:
    """Copy the live rows of ``inputs`` into ``meta.input_buffers`` and reset
    rows ``batch_size..bucket`` to their padding values (and block-table
    columns right of a narrower table). Called before every capture and
    every replay; must not read device values on the host (that would
    synchronise every step), and filling twice with the same inputs must
    leave the same buffers. The default does it from ``meta.spec`` in one
    fused copy; a plugin that fills its own way writes through
    :func:`graphmode.buffers.stage` so that host staging can route it.

    The return value only ends the hook call: return True once done, so
    that no later implementation fills again.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_update_context(
    meta: GraphMeta, inputs: StepInputs, batch_size: int, bucket: int
) -> StepInputs:
    """The step inputs the captured forward sees: every per-step tensor
    replaced by a view of its buffer holding ``bucket`` rows, host values a
    graph would freeze replaced by values that hold at every replay: per
    ``spec.max_q_policy`` / ``max_kv_seq_len``, -1 ("derive on the device
    from the length tensors") or a bound (1 query token; the block table's
    capacity).

    Called only before each capture (never on replay); the graph keeps
    reading the same buffers at every replay, so the result must contain no
    tensor that a later step replaces. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_get_outputs(meta: GraphMeta, batch_size: int, num_tokens: int) -> Any:
    """The step's result from ``meta.output_buffers["output"]`` (what the
    captured forward returned: a tensor, or a tuple, list or dict of them),
    every tensor cut to the ``num_tokens`` live tokens (the second
    dimension), the structure kept. The result may be a view of the output buffer, valid
    until the next replay. Called at every full-graph step, capture and
    replay: no host reads of device values.

    Stops at the first non-None result.
    """


# -------------------------------------------------------------------------
# The device graph
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def graphmode_make_graph(meta: GraphMeta) -> DeviceGraph:
    """A new, empty :class:`graphmode.graphs.DeviceGraph` for ``meta.device``
    (the CPU emulator on "cpu"), one per call: each bucket (each piecewise
    segment) captures into its own (a decode capture refuses a graph the
    runner holds for another bucket). Called only while capturing. Return None
    for devices this plugin does not drive so that the default answers.

    Stops at the first non-None result.
    """


@hookspec
def graphmode_update_graph_params(
    graph: DeviceGraph, meta: GraphMeta, batch_size: int, bucket: int
) -> None:
    """Push this step's host-side kernel arguments into a captured graph,
    after its buffers were filled and before it replays (Ascend's kv lengths,
    read from its host buffer). Called before every replay, never at capture
    (the capture step's values are already in the buffers); no host reads of
    device values. The replay must not start before the update is complete.
    Push every row of the bucket, padding rows with their declared padding
    as the fill left them (``meta.input_buffers[name][:bucket]``): the
    captured kernel took ``bucket`` rows and may trust their host values.

    Every implementation is called; the runner skips the call entirely when
    no plugin implements it.
    """


@hookspec(firstresult=True)
def graphmode_capture_error(error: BaseException, meta: GraphMeta, bucket: int) -> BaseException | None:
    """Turn a capture failure with a known vendor signature into an error
    that says what to do. The runner raises the result ``from`` the original;
    an error the plugin does not recognise must get None, so that it keeps
    its type and a note naming the bucket. Called only when a capture raises.
    For a piecewise graph, ``meta.family`` is "piecewise", ``bucket`` is its
    token bucket and ``meta.capture_sizes`` the token sizes.

    Stops at the first non-None result; None keeps the original error.
    """


# -------------------------------------------------------------------------
# The vendor's kernels, for the reference model and the conformance suite
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def graphmode_attention_ops(options: Any) -> AttentionOps:
    """The vendor's attention kernels behind graphmode's :class:`AttentionOps`
    protocol (``graphmode.attention``): ``layout``, ``contract``,
    ``cache_shape``, ``make_kv_cache``, ``block_view``, ``fill_kv_cache``,
    ``paged_decode_attention``, ``prefill_attention``. Called when a model is
    built for the vendor (``build_reference_model``, the Hugging Face
    adapter) and once per runner (a model's ops must follow the runner's
    vendor's ``contract``).

    ``options``: the vendor's options object (its ``GraphSpec.options``
    dataclass, built and checked from the engine's ``vendor_options``), for
    kernels whose behaviour an option chooses; an implementation that needs
    none leaves the parameter out.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def graphmode_dist_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a process group on ``device``
    (nccl, hccl, cncl, gloo); None for devices the plugin does not drive.
    Called when a process group is made.

    Stops at the first non-None result.
    """

"""The core's buffer machinery, driven by the vendor's declarations.

From the :class:`graphmode.spec.GraphSpec` in ``meta.spec``:

- :func:`allocate` makes every declared buffer at full size, holding its
  padding value (the runner snapshots them into ``meta.padding_buffers``,
  and the padding of ``q_len_scaled`` buffers for every q_len above 1 into
  ``meta.q_len_padding``: :func:`q_len_paddings`);
- :func:`fill` copies one step's live rows into the buffers and resets every
  other row to its padding value, in one fused copy (fill_words: int64 as int32 words);
- :func:`graph_context` builds the step the captured forward sees, every
  declared field a view of ``bucket`` rows of its buffer.

These are the built-in plugin's buffer hooks. A plugin that fills buffers
its own way stages its copies through :func:`stage`, so that host staging
(:mod:`graphmode.staging`) can route them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphmode.context import AttnMetadata, StepInputs
from graphmode.emulator.host import is_host, mark_host
from graphmode.errors import InputError, VendorError
from graphmode.fill_words import word_copy
from graphmode.meta import GraphMeta
from graphmode.spec import BLOCKS, BufferSpec

__all__ = ["allocate", "check_made", "fill", "graph_context", "host_zeros", "q_len_paddings", "stage", "step_value"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]

def host_zeros(meta: GraphMeta, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
    """A zeroed host (CPU) buffer, for kernels that take host values;
    ``pinned``: page-locked, so that a graph can copy it to the device.

    On the emulator the buffer is marked as host memory, so reading it inside
    a capture freezes the value read, exactly as on a device."""
    on_device = meta.device.type != "cpu"
    tensor = torch.zeros(tuple(shape), dtype=dtype, device="cpu", pin_memory=pinned and on_device)
    if not on_device:
        mark_host(tensor, pinned=pinned)
    return tensor


def allocate(meta: GraphMeta) -> dict[str, torch.Tensor]:
    """Every buffer ``meta.spec`` declares, at full size, holding its padding."""
    return {
        spec.name: spec.allocate(meta.max_batchs, meta.max_tokens, meta.num_blocks, meta.device)
        for spec in meta.spec.buffers
    }


def check_made(meta: GraphMeta, vendor: str) -> None:
    """Refuse a buffer ``graphmode_make_buffers`` made where its declaration
    does not put it: a device buffer in host memory (the fill would copy the
    step's device values to the host, which a capture refuses) or on another
    device, or a host buffer (``host=True``) on the device. A declared buffer
    it did not make is the fill's to name."""
    device = meta.device
    for spec in meta.spec.buffers:
        buffer = meta.input_buffers.get(spec.name)
        if not isinstance(buffer, torch.Tensor):
            continue
        on_host = buffer.device.type == "cpu" and (device.type != "cpu" or is_host(buffer))
        elsewhere = not on_host and (buffer.device.type != device.type
                                     or None not in (buffer.device.index, device.index)
                                     and buffer.device.index != device.index)
        if on_host != spec.host or elsewhere:
            made = "host memory" if on_host else str(buffer.device)
            wanted = "host memory (host=True)" if spec.host else (
                f"the runner's device, {device}" if device.type != "cpu" else
                "the runner's device (on the emulator, a CPU tensor not marked as host memory)")
            raise VendorError(
                f"vendor {vendor!r}: graphmode_make_buffers made buffer {spec.name!r} in {made}, but it is declared "
                f"in {wanted}: kernels and the fill read it there. Allocate it as declared "
                "(graphmode.buffers.allocate(meta), or spec.allocate(...) per buffer), or change its declaration"
            )


def q_len_paddings(meta: GraphMeta) -> dict[int, dict[str, torch.Tensor]]:
    """For every q_len in 2..max_q_len, the padding of each ``q_len_scaled``
    buffer at that q_len: its q_len-1 padding (the snapshot) times q_len.
    Empty when the runner graphs one-token decode only."""
    scaled = [spec.name for spec in meta.spec.buffers if spec.q_len_scaled]
    paddings: dict[int, dict[str, torch.Tensor]] = {}
    for q_len in range(2, meta.max_q_len + 1):
        paddings[q_len] = {}
        for name in scaled:
            base = meta.padding_buffers[name]
            pattern = base * q_len
            if meta.device.type == "cpu" and is_host(base):
                mark_host(pattern)
            paddings[q_len][name] = pattern
    return paddings


def live_values(meta: GraphMeta) -> dict[str, torch.Tensor]:
    """For each buffer with a ``live`` constant, a tensor like it holding that
    constant: the source of its live rows."""
    return {
        spec.name: torch.full_like(meta.input_buffers[spec.name], spec.live)
        for spec in meta.spec.buffers
        if spec.live is not None
    }


# -- one step's copies --------------------------------------------------------


def step_value(inputs: StepInputs, path: str) -> Any:
    """The value at ``path`` of a step (``attn_metadata.kv_seqlens``,
    ``extras.NAME``, ``attn_metadata.vendor_fields.NAME``), None when absent."""
    if path.startswith("extras."):
        return inputs.extras.get(path[len("extras."):])
    if path.startswith("attn_metadata.vendor_fields."):
        return inputs.attn_metadata.vendor_fields.get(path[len("attn_metadata.vendor_fields."):])
    return operator.attrgetter(path)(inputs)


def _origin(spec: BufferSpec) -> str:
    return " or ".join(spec.sources) or "its declared source"


def _getter(spec: BufferSpec) -> Callable[[StepInputs], Any]:
    if callable(spec.source):
        return spec.source
    paths = spec.sources
    if len(paths) == 1 and paths[0].count(".") <= 1 and not paths[0].startswith("extras."):
        return operator.attrgetter(paths[0])

    def first_given(inputs: StepInputs) -> Any:
        for path in paths:
            value = step_value(inputs, path)
            if value is not None:
                return value
        return None

    return first_given


class FillPlan:
    """The copies of every step of one shape (sequences, tokens, bucket,
    block-table width), made once: destinations and how to get each one's
    source from a step, plus the constant copies (padding rows, table tails,
    live constants)."""

    def __init__(self, meta: GraphMeta, inputs: StepInputs, batch: int, bucket: int) -> None:
        tokens = inputs.num_tokens
        per_seq = tokens // batch
        rows = {False: (batch, bucket), True: (tokens, bucket * per_seq)}
        self.sourced: list[tuple[torch.Tensor, Callable[[StepInputs], Any], tuple[int, ...], BufferSpec]] = []
        self.constant: Pairs = []
        # When graphs of several q_len share the buffers, the q_len_scaled ones
        # get this q_len's pattern in every row of the bucket, every step.
        rescaled = meta.max_q_len > 1
        scaled_padding = meta.q_len_padding.get(per_seq, {})
        for spec in meta.spec.buffers:
            buffer, padding = meta.input_buffers[spec.name], meta.padding_buffers[spec.name]
            padding = scaled_padding.get(spec.name, padding)
            if spec.host and meta.device.type == "cpu":
                # The runner's snapshots of a host buffer are host memory
                # (CPU tensors on a device); on the emulator, marked so.
                mark_host(padding)
                if spec.live is not None:
                    mark_host(meta.live_buffers[spec.name])
            row = spec.row_dim
            if not spec.written:
                if rescaled and spec.q_len_scaled:
                    self.constant.append((buffer.narrow(row, 0, bucket), padding.narrow(row, 0, bucket)))
                continue
            live, full = rows[spec.per_token]
            self.constant.append((buffer.narrow(row, live, full - live), padding.narrow(row, live, full - live)))
            target = buffer.narrow(row, 0, live)
            if spec.live is not None:
                self.constant.append((target, meta.live_buffers[spec.name].narrow(row, 0, live)))
                continue
            get = _getter(spec)
            value = get(inputs)
            if value is None:
                raise InputError(
                    f"step input {spec.name!r} ({_origin(spec)}) is missing: the vendor or the "
                    f"engine declared it as a per-step buffer; pass it with every step"
                )
            if BLOCKS in spec.shape:
                dim = spec.shape.index(BLOCKS)
                width = _shape(spec, value)[dim]
                target = target.narrow(dim, 0, width)
                tail = buffer.size(dim) - width
                if tail > 0:
                    self.constant.append((
                        buffer.narrow(row, 0, live).narrow(dim, width, tail),
                        padding.narrow(row, 0, live).narrow(dim, width, tail),
                    ))
            shape = _shape(spec, value)
            if target.numel() != math.prod(shape):
                raise InputError(
                    f"step input {spec.name!r} has shape {shape}; its buffer takes {tuple(target.shape)} for "
                    f"{batch} sequences and {tokens} tokens (declared shape {spec.shape}): its source must give one "
                    f"row per {str(spec.shape[spec.row_dim]).rstrip('s')} (no extra row, a leading 0, can be declared)"
                )
            self.sourced.append((_fusable(target.view(shape)), get, shape, spec))

        self._group(meta)

    def _group(self, meta: GraphMeta) -> None:
        """Group the copies by destination device and dtype once (each group
        is one ``_foreach_copy_``), routed through host staging if any:
        constant sources become their host copies here, step sources are
        checked at each step."""
        staging = meta.staging
        sourced = [(d, d, g, shape, spec) for d, g, shape, spec in self.sourced]
        constant = [(d, s) for d, s in self.constant if d.numel()]
        if staging is not None:
            sourced = [(m, d, _on_host(g, spec, meta), shape, spec) for (m, _), (d, g, shape, spec)
                       in zip(staging.route([(d, d) for d, *_ in self.sourced], host_sources=False), self.sourced)]
            constant = staging.route(constant)
        # Host memory (the mirror) takes every dtype in one list: a host _foreach_copy_ copies pair by pair.
        mirror = staging.on_host if staging is not None else None
        key = lambda t: (t.device, None if mirror is not None and mirror(t) else t.dtype)  # noqa: E731
        groups: dict[tuple[torch.device, torch.dtype | None], tuple[list, list, list]] = {}
        for target, original, get, shape, spec in sourced:
            group = groups.setdefault(key(target), ([], [], []))
            group[0].append(target)
            # A destination staged through the mirror takes host sources only.
            group[1].append((get, shape, spec, original if target is not original else None))
        for target, source in constant:
            group = groups.setdefault(key(target), ([], [], []))
            group[2].append((target, source))
        # Destinations: the step's rows first, then the constant copies.
        self.groups = [
            ([*targets, *(t for t, _ in consts)], getters, [s for _, s in consts])
            for targets, getters, consts in groups.values()
        ]
        # The int64 and int32 groups as one copy where the step's sources allow (graphmode.fill_words).
        typed = [group for (_, dtype), group in zip(groups, self.groups) if dtype is not None]
        self.words, others = word_copy(typed)
        self.others = [group for (_, dtype), group in zip(groups, self.groups) if dtype is None] + others
        self.staging = staging

    def run(self, inputs: StepInputs) -> None:
        """This step's copies: one ``_foreach_copy_`` per group, the integer
        groups' as one where the step's sources allow."""
        groups = self.groups
        if self.words is not None and self.words.run(inputs, self._source):
            groups = self.others
        for destinations, getters, constants in groups:
            sources = [self._source(inputs, *getter) for getter in getters]
            sources.extend(constants)
            torch._foreach_copy_(destinations, sources)

    def _source(self, inputs: StepInputs, get: Callable[[StepInputs], Any], shape: tuple[int, ...],
                spec: BufferSpec, staged: torch.Tensor | None) -> torch.Tensor:
        value = get(inputs)
        if value is None or value.shape != shape:
            got = "nothing" if value is None else f"shape {tuple(value.shape)}"
            raise InputError(
                f"step input {spec.name!r} ({_origin(spec)}) has {got}; this step's buffer rows "
                f"take shape {shape}. Pass it with every step, one row per "
                f"{'token' if spec.per_token else 'sequence'}"
            )
        if staged is not None:
            assert self.staging is not None  # only a plan with a mirror stages rows
            return self.staging.host_source(value, staged)
        return value


def _on_host(get: Callable[[StepInputs], Any], spec: BufferSpec, meta: GraphMeta) -> Callable[[StepInputs], Any]:
    """With host staging the step's tensors are host tensors, so a function
    source computes on the host too. On a device its result is a CPU tensor;
    on the emulator, where every tensor is a CPU tensor, it is marked as host
    memory, as its inputs are."""
    if not callable(spec.source) or meta.device.type != "cpu":
        return get

    def marked(inputs: StepInputs) -> Any:
        value = get(inputs)
        return mark_host(value) if isinstance(value, torch.Tensor) else value

    return marked


def _shape(spec: BufferSpec, value: Any) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor):
        raise InputError(
            f"step input {spec.name!r} is a {type(value).__name__}, not a tensor; pass a torch.Tensor "
            f"of dtype {spec.dtype} (it fills a buffer of declared shape {spec.shape})"
        )
    return tuple(value.shape)


def _fusable(view: torch.Tensor) -> torch.Tensor:
    """The same memory with a contiguous tensor's strides, where that is the
    same memory. A (1, n) slice of a (1, max_tokens) buffer has stride
    max_tokens in its size-1 dimension, a step's (1, n) tensor has n:
    harmless for a copy, but ``_foreach_copy_`` only takes its fused path when
    destination and source strides match."""
    if not view.is_contiguous():
        return view
    return view.as_strided(view.shape, torch.empty(view.shape, device="meta").stride(), view.storage_offset())


def fill(meta: GraphMeta, inputs: StepInputs, batch: int, bucket: int) -> None:
    """Copy the step's live rows into every written buffer and reset the rest
    of the bucket's rows (and the block-table columns right of a narrower
    table) to their padding: one fused copy per dtype, int64 and int32 as one."""
    key = plan_key(meta, inputs, batch, bucket)
    plan = meta.fill_plans.get(key)
    if plan is None:
        plan = meta.fill_plans[key] = FillPlan(meta, inputs, batch, bucket)
    plan.run(inputs)


def plan_key(meta: GraphMeta, inputs: StepInputs, batch: int, bucket: int) -> tuple[Any, ...]:
    """The plan of a step of this shape in ``meta.fill_plans``: one per host staging mirror (its copies routed there)."""
    slot = meta.staging.slot if meta.staging is not None else 0
    return ("fill", batch, inputs.num_tokens, bucket, inputs.attn_metadata.block_offsets.shape[-1], slot)


def stage(
    meta: GraphMeta,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Copy every source into its destination: one ``_foreach_copy_`` per
    destination device and dtype, so that each group takes the fused path (one
    kernel on a GPU) rather than one copy per buffer.

    With host staging (``meta.staging``), a destination in the device arena
    is written through its pinned host mirror instead, on the host: its
    source must then be a host tensor (or a view of a padding or live
    constant, whose host copy is used); a device source raises InputError."""
    if not isinstance(meta, GraphMeta):
        raise TypeError(f"stage(meta, pairs) takes a GraphMeta first, not a {type(meta).__name__}")
    if pairs is None:
        raise TypeError("stage(meta, pairs) missing its pairs: the (destination, source) tensors to copy")
    if meta.staging is not None:
        pairs = meta.staging.route(pairs)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for destination, source in pairs:
        destinations, sources = groups.setdefault((destination.device, destination.dtype), ([], []))
        destinations.append(destination)
        sources.append(source)
    for destinations, sources in groups.values():
        torch._foreach_copy_(destinations, sources)


# -- the captured step --------------------------------------------------------


def graph_context(meta: GraphMeta, inputs: StepInputs, batch: int, bucket: int) -> StepInputs:
    """The step the captured forward sees: every declared context field a view
    of its buffer's first ``bucket`` rows (tokens: ``bucket`` times the step's
    tokens per sequence), the maxima the spec's policy gives, and the rest
    of ``inputs`` (KV cache, undeclared extras) as is."""
    spec = meta.spec
    per_seq = inputs.num_tokens // batch
    fields: dict[str, torch.Tensor] = {}
    for buffer_spec in spec.buffers:
        rows = bucket * per_seq if buffer_spec.per_token else bucket
        view = meta.input_buffers[buffer_spec.name].narrow(buffer_spec.row_dim, 0, rows)
        for path in buffer_spec.contexts:
            fields[path] = view
    attn_fields: dict[str, Any] = {}
    vendor_fields: dict[str, torch.Tensor] = {}
    for path, value in fields.items():
        root, _, name = path.rpartition(".")
        if root == "attn_metadata":
            attn_fields[name] = value
        elif root == "attn_metadata.vendor_fields":
            vendor_fields[name] = value
    attn = AttnMetadata(
        is_decoding=inputs.attn_metadata.is_decoding,
        max_q_seq_len=per_seq if spec.max_q_policy == "bound" else -1,
        max_kv_seq_len=meta.kv_capacity if spec.max_kv_policy == "capacity" else -1,
        vendor_fields=vendor_fields,
        **attn_fields,
    )
    extras = dict(inputs.extras)
    extras.update({path.split(".", 1)[1]: value for path, value in fields.items() if path.startswith("extras.")})
    return StepInputs(
        input_ids=fields["input_ids"],
        position_ids=fields["position_ids"],
        past_key_values=inputs.past_key_values,
        attn_metadata=attn,
        extras=extras,
    )

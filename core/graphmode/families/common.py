"""What every graph family needs, once: the inert warm-up step, how a
captured cache is listed, the output cut to the live tokens, how a graph is
named, and what a failed capture or replay raises."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_map

from graphmode.context import AttnMetadata, KVCache, StepInputs
from graphmode.errors import CaptureError, GraphModeError
from graphmode.families.family import RunnerContext
from graphmode.meta import GraphMeta
from graphmode.variants import PLAIN

__all__ = ["capture_failed", "fresh_context", "graph_name", "guard_dropped_fields", "inert_step", "live_columns", "note_eager_failure",
           "note_replay_failure"]

#: What one of a family's buckets counts, in a graph's name, by ``GraphFamily.unit``.
_BUCKET_WORDS = {"batch": "bucket", "tokens": "token bucket"}


def graph_name(family: str, unit: str, bucket: int, q_len: int | None = None, variant: str = PLAIN) -> str:
    """How errors, debug mode and warm-up name one graph of a family: by its
    bucket, then its query length (when given) and graph variant (when not
    the plain one). A family of batch buckets (full decode graphs) is the
    default and goes unnamed: "bucket 8", "bucket 8, q_len 2", "bucket 8,
    lora=True"; any other names itself: "token bucket 16 (piecewise)",
    "token bucket 16 (piecewise, lora=True)"."""
    details = ([f"q_len {q_len}"] if q_len is not None else []) + ([variant] if variant != PLAIN else [])
    if unit == "batch":
        return ", ".join([f"bucket {bucket}", *details])
    return f"{_BUCKET_WORDS.get(unit, unit + ' bucket')} {bucket} ({', '.join([family, *details])})"

_FIELDS = frozenset(f.name for f in dataclasses.fields(AttnMetadata))


def inert_step(
    shared: RunnerContext, batch: int, past_key_values: KVCache, extras: dict[str, Any], q_len: int = 1
) -> StepInputs:
    """A decode step of ``batch`` sequences of ``q_len`` tokens that changes
    nothing: every slot -1 (no KV write), every row on the reserved block 0.
    The engine's declared step inputs not in ``extras`` get their declared
    padding (``BufferSpec.allocate``)."""
    device, int32 = shared.config.device, torch.int32
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
    for spec in shared.spec.buffers:
        if spec.name in shared.declared_extras and spec.name not in extras:
            extras[spec.name] = spec.allocate(batch, tokens, shared.config.max_blocks_per_seq, device)
    return StepInputs(zeros, zeros.clone(), past_key_values, attn, extras)


def live_columns(output: Any, tokens: int) -> Any:
    """A graph's output cut to the live tokens: views of the first ``tokens``
    columns (dimension 1, the model contract) of every tensor of two or more
    dimensions, valid until the next step."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return leaf.narrow(1, 0, tokens)
        return leaf

    return tree_map(cut, output)


def capture_failed(error: Exception, shared: RunnerContext, meta: GraphMeta, bucket: int, what: str, setting: str,
                   unpadded: str | None = None) -> None:
    """Raise what a failed capture becomes: the vendor's advice
    (``graphmode_capture_error``), chained to the error, or the error itself
    with a note naming ``what`` was being captured and the setting that
    chooses the family's sizes; ``unpadded`` (:func:`unpadded_extras`) noted too."""
    advice = shared.vendor.hook.graphmode_capture_error(error=error, meta=meta, bucket=bucket)
    if advice is not None:
        raise advice from error
    if hasattr(error, "add_note"):
        error.add_note(
            f"graphmode: while capturing {what} ({shared.vendor.name}); its sizes come from {setting}, "
            f"and execute_mode={shared.config.execute_mode!r}"
        )
        if unpadded is not None:
            error.add_note(unpadded)
    raise error


def row_names(batch: int, tokens: int) -> dict[int, str]:
    """A step's live row counts and what a row of each is (:func:`unpadded_extras`)."""
    return {batch: "sequence"} | ({tokens: "token"} if tokens != batch else {batch: "sequence (or token: one each)"})


def unpadded_extras(shared: RunnerContext, extras: dict[str, Any], rows: dict[int, str], padded: int) -> str | None:
    """Why a capture's forward may fail on the engine's extra inputs: an
    undeclared tensor extra with one row per sequence or token of the step
    (``rows``: its live row counts, each named) is passed as it is, while
    the graph runs ``padded`` rows, so a model combining it with the padded
    tensors fails on a size mismatch that names neither. None where no extra
    looks so."""
    named = [(name, value) for name, value in extras.items() if name not in shared.declared_extras
             and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] in rows
             and value.shape[0] != padded]
    if not named:
        return None
    name, value = named[0]
    per = rows[value.shape[0]]
    rest = "".join(f", {size}" for size in value.shape[1:])
    dims = " or ".join(f"({dim}{rest},)".replace(",,", ",") for dim in ("SEQUENCES", "TOKENS") if dim.lower()[:-1] in per)
    return (f"graphmode: extra model input {name!r} has {value.shape[0]} rows, one per {per} of the step, but the "
            f"graph runs {padded}: an extra without a buffer is passed as it is, unpadded. If the error above is "
            f"a size mismatch, declare it as a step input, build_graph_runner(step_inputs=[BufferSpec({name!r}, "
            f"{value.dtype}, shape={dims}, padding=...)]) (graphmode.spec), so that every graph pads and copies it")


def note_replay_failure(error: Exception, shared: RunnerContext, graph: str) -> None:
    """Note on an error raised inside the replay of ``graph`` (a kernel's
    index out of range: the emulator's, or an eager break point's) what
    was checked and what was not: outside debug mode, the step's device
    values, and how to have them checked (a block id or a slot past the
    cache fails there, as an IndexError from inside torch that names
    neither); in either mode, the engine's declared step inputs, whose
    values only the model knows the limits of (a LoRA adapter id past the
    model's adapters fails so, debug mode or not)."""
    if isinstance(error, GraphModeError) or not hasattr(error, "add_note"):
        return
    names = ", ".join(repr(spec.name) for spec in shared.config.step_inputs)
    inputs = (f" The values of the declared step inputs ({names}) are not checked, in debug mode either: the model "
              "indexes with them, and one past what it indexes (a LoRA adapter id past its adapters) fails so; "
              "check them where the engine builds them.") if names else ""
    if shared.debug is not None:
        if inputs:
            error.add_note(f"graphmode: raised replaying the graph of {graph}; debug mode found the step's device "
                           f"values (input ids, block ids, slots, lengths) right.{inputs}")
        return
    error.add_note(
        f"graphmode: raised replaying the graph of {graph}. A step's device values (input ids, block ids, "
        "slots, lengths) are checked only in debug mode: run it with GRAPHMODE_DEBUG=1 (or debug=True) to have a "
        f"bad one named, with its sequence and the fix.{inputs} If debug mode finds none, the vendor's graph or its "
        f"graphmode_update_graph_params hook raised: `graphmode conformance --vendor {shared.vendor.name}` checks "
        "both"
    )


def note_eager_failure(error: Exception, shared: RunnerContext, reason: str) -> None:
    """Note on an error the model raised in an eager step (``reason``: why
    it ran eagerly) that, outside debug mode, the step's device values were
    not checked, and how to have them checked: a block id or slot past the
    cache fails inside the model as an IndexError that names neither."""
    if isinstance(error, GraphModeError) or not hasattr(error, "add_note") or shared.debug is not None:
        return
    error.add_note(
        f"graphmode: raised by the model in an eager step ({reason}: no graph ran). A step's device values "
        "(input ids, block ids, slots, lengths) are checked only in debug mode: run it with GRAPHMODE_DEBUG=1 (or "
        "debug=True) to have a bad one named, with its sequence and the fix"
    )


def fresh_context(step: StepInputs) -> StepInputs:
    """``step`` with copies of its attention metadata and extras, for one
    forward: a model that rebinds a field (``attn_metadata.kv_seqlens =
    attn_metadata.kv_seqlens * 1``) changes its copy only. The warm-up and
    the capture once shared one context, so the capture read the tensor the
    warm-up made, frozen, instead of the buffer: every replay used the
    warm-up's lengths (0.49 off eager, its KV cache written wrong)."""
    attn = copy.copy(step.attn_metadata)
    if type(attn.vendor_fields) is dict:
        attn.vendor_fields = dict(attn.vendor_fields)
    return dataclasses.replace(step, attn_metadata=attn, extras=dict(step.extras))


def guard_dropped_fields(inputs: StepInputs, context: StepInputs) -> StepInputs:
    """The full graph's context as its warm-up and capture hand it to the
    model: reading a step field the engine's ``attn_metadata`` held but the
    context lacks raises :class:`CaptureError` naming it and the fix.

    A graph step hands the model an ``AttnMetadata`` made from the graph's
    buffers, so the fields of an engine's subclass of it (per-step fields of
    its own) and ``vendor_fields`` the vendor does not declare are not there.
    Without the guard, ``getattr(attn, name, default)``, ``hasattr`` and
    ``vendor_fields.get(name)`` would freeze the default into the graph
    silently, and a plain read would fail with a bare AttributeError. The
    error is no AttributeError or KeyError, so no default swallows it. The
    context itself is returned when nothing was dropped."""
    attn, graph_attn = inputs.attn_metadata, context.attn_metadata
    own = [f.name for f in dataclasses.fields(attn) if f.name not in _FIELDS] if dataclasses.is_dataclass(attn) else []
    vendor = sorted(set(attn.vendor_fields) - set(graph_attn.vendor_fields))
    if not (own or vendor):
        return context
    held = ([f"the fields {own} of its {type(attn).__name__}"] if own else []) + (
        [f"vendor_fields {vendor} (not declared by the vendor)"] if vendor else [])
    reason = (
        "a full graph's attn_metadata is a graphmode.AttnMetadata made from the graph's buffers, holding only the "
        f"fields graph mode and the vendor declare: the step's attn_metadata held {' and '.join(held)}, which that "
        "one lacks (a default from getattr or dict.get would be frozen into the graph). Pass a per-step tensor the "
        "model reads as a declared step input (build_graph_runner(step_inputs=[BufferSpec(name, ...)]), given to the "
        "runner as a keyword and to the model as one), or run such steps with execute_mode='eager'"
    )
    base: type = type(graph_attn)
    guarded: Any = object.__new__(_guarded_class(base, tuple(own), reason))
    guarded.__dict__.update(vars(graph_attn))
    if vendor:
        guarded.__dict__["vendor_fields"] = _GuardedFields(graph_attn.vendor_fields, vendor, reason)
    return dataclasses.replace(context, attn_metadata=guarded)


@functools.cache
def _guarded_class(base: type, dropped: tuple[str, ...], reason: str) -> type:
    """``base`` whose missing attributes in ``dropped`` raise (one class per
    engine: ``torch.compile`` guards on the class)."""

    def __getattr__(self: Any, name: str) -> Any:
        if name in dropped:
            raise CaptureError(f"the model read attn_metadata.{name}: {reason}")
        raise AttributeError(f"'{base.__name__}' object has no attribute '{name}'")

    return type(base.__name__, (base,), {"__getattr__": __getattr__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


class _GuardedFields(dict):
    """``vendor_fields`` whose reads of the keys ``dropped`` raise."""

    def __init__(self, fields: dict, dropped: list[str], reason: str) -> None:
        super().__init__(fields)
        self._dropped, self._reason = frozenset(dropped), reason

    def _refuse(self, key: Any) -> None:
        if key in self._dropped:
            raise CaptureError(f"the model read attn_metadata.vendor_fields[{key!r}]: {self._reason}")

    def __getitem__(self, key: Any) -> Any:
        self._refuse(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._refuse(key)
        return super().get(key, default)

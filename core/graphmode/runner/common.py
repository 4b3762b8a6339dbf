"""What every graph family needs, once: the inert warm-up step, how a
captured cache is listed, the output cut to the live tokens, and what a
failed capture or replay raises."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import GraphModeError
from graphmode.meta import GraphMeta
from graphmode.runner.family import Shared

__all__ = ["capture_failed", "inert_step", "live_columns", "note_dropped_fields", "note_replay_failure"]

_FIELDS = frozenset(f.name for f in dataclasses.fields(AttnMetadata))


def inert_step(
    shared: Shared, batch: int, past_key_values: Any, extras: dict[str, Any], q_len: int = 1
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


def capture_failed(error: Exception, shared: Shared, meta: GraphMeta, bucket: int, what: str, setting: str) -> None:
    """Raise what a failed capture becomes: the vendor's advice
    (``graphmode_capture_error``), chained to the error, or the error itself
    with a note naming ``what`` was being captured and the setting that
    chooses the family's sizes."""
    advice = shared.vendor.hook.graphmode_capture_error(error=error, meta=meta, bucket=bucket)
    if advice is not None:
        raise advice from error
    if hasattr(error, "add_note"):
        error.add_note(
            f"graphmode: while capturing {what} ({shared.vendor.name}); its sizes come from {setting}, "
            f"and execute_mode={shared.config.execute_mode!r}"
        )
    raise error


def note_replay_failure(error: Exception, shared: Shared, graph: str) -> None:
    """Note on an error raised inside the replay of ``graph`` (a kernel's
    index out of range: the emulator's, or an eager break point's), outside
    debug mode, that the step's device values were not checked and how to
    have them checked: a block id past the cache or a slot past it fails
    there, as an IndexError from inside torch that names neither."""
    if shared.debug is None and not isinstance(error, GraphModeError) and hasattr(error, "add_note"):
        error.add_note(
            f"graphmode: raised replaying the graph of {graph}. A step's device values (input ids, block ids, "
            "slots, lengths) are checked only in debug mode: run it with GRAPHMODE_DEBUG=1 (or debug=True) to have a "
            "bad one named, with its sequence and the fix. If debug mode finds none, the vendor's graph or its "
            f"graphmode_update_graph_params hook raised: `graphmode conformance --vendor {shared.vendor.name}` checks "
            "both"
        )


def note_dropped_fields(error: Exception, inputs: StepInputs, context: StepInputs, what: str) -> None:
    """Note on an error raised by the forward of a full graph's context
    (its warm-up or capture) what the engine's ``attn_metadata`` held that
    the context lacks: a graph step hands the model an ``AttnMetadata`` built
    from the graph's buffers, so the fields of an engine's subclass of it
    (per-step fields of its own) and ``vendor_fields`` the vendor does not
    declare are not there, and a model reading one fails with a bare
    AttributeError or KeyError naming neither graph mode nor the fix."""
    attn = inputs.attn_metadata
    own = [f.name for f in dataclasses.fields(attn) if f.name not in _FIELDS] if dataclasses.is_dataclass(attn) else []
    vendor = sorted(set(attn.vendor_fields) - set(context.attn_metadata.vendor_fields))
    if not (own or vendor) or not hasattr(error, "add_note"):
        return
    held = ([f"the fields {own} of its {type(attn).__name__}"] if own else []) + (
        [f"vendor_fields {vendor} (not declared by the vendor)"] if vendor else [])
    error.add_note(
        f"graphmode: raised by {what} (the model's forward on the graph's context), whose attn_metadata is a "
        f"graphmode.AttnMetadata made from the graph's buffers, holding only the fields graph mode and the vendor "
        f"declare: the step's attn_metadata held {' and '.join(held)}, which that one lacks. Pass a per-step "
        "tensor the model reads as a declared step input (build_graph_runner(step_inputs=[BufferSpec(name, ...)]), "
        "given to the runner as a keyword and to the model as one), or run such steps with execute_mode='eager'"
    )

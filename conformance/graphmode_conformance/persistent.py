"""Step tensors as an engine keeping a persistent batch passes them (vLLM's
input batch): views of tensors that live across steps, written in place.
The harness's sliced-table runs (``Harness.sliced_tables``) pass every step
this way, so that a fill keeping last step's tensor by reference, or
assuming a contiguous block table, shows."""

from __future__ import annotations

import dataclasses

import torch

from graphmode.context import StepInputs
from graphmode.emulator import is_host, mark_host

__all__ = ["in_persistent_tensors"]

_PERSISTENT_FIELDS = ("block_offsets", "q_start_loc", "q_seqlens", "kv_seqlens", "kv_start_indices", "kv_seqlens_cpu")


def in_persistent_tensors(kept: dict[str, torch.Tensor], inputs: StepInputs) -> StepInputs:
    """``inputs`` as an engine keeping a persistent batch (vLLM's) passes
    them: each tensor written in place into one ``kept`` per field, the step
    getting a view of its rows; the block table as the first columns of a
    wider one (not contiguous). Consecutive steps' tensors share storage, so
    a fill that keeps last step's tensor (a reference, not a copy) to skip
    what did not change sees this step's values in it."""

    def view(name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        extra = [0] * (tensor.dim() - 1) + [3 if name == "block_offsets" else 0]
        store = kept.get(name)
        if store is None or any(s + e > k for s, e, k in zip(tensor.shape, extra, store.shape)):
            shape = [2 * s + e for s, e in zip(tensor.shape, extra)]
            store = kept[name] = tensor.new_zeros(shape)
            if is_host(tensor):
                mark_host(store)
        rows = store[tuple(slice(0, s) for s in tensor.shape)]
        rows.copy_(tensor)
        return rows

    attn = inputs.attn_metadata.replace(**{f: view(f, getattr(inputs.attn_metadata, f)) for f in _PERSISTENT_FIELDS})
    ids, positions = view("input_ids", inputs.input_ids), view("position_ids", inputs.position_ids)
    assert ids is not None and positions is not None
    return dataclasses.replace(inputs, input_ids=ids, position_ids=positions, attn_metadata=attn)

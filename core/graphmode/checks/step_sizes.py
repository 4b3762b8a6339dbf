"""A step's sizes, its sequences and its new tokens, from its tensors' shapes.

Several tensors say each size: the per-sequence ones (block table, query
starts, query lengths, KV lengths) one row per sequence, the per-token ones
(ids, positions, slots) one entry per new token. When they disagree, the one
that differs from the others is named, rather than whichever was read
first: a step taking its batch from a ``q_seqlens`` of one entry too many
(vLLM's cumulative ``query_start_loc``, batch + 1 entries) would otherwise
be refused for what its right tensors say. Shapes only, no values: read once
per step layout (``graphmode.checks.step_checks``).
"""

from __future__ import annotations

from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import InputError

__all__ = ["batch_size", "token_count"]

# The per-sequence tensors, one row each, in the order errors list them.
_PER_SEQUENCE = ("block_offsets", "q_start_loc", "q_seqlens", "kv_seqlens")
# What each holds, for the error naming a tensor of one entry too many (a cumulative array).
_HOLDS = {
    "q_start_loc": "each sequence's first new token, batch entries (vLLM's query_start_loc[:-1])",
    "q_seqlens": "each sequence's number of new tokens, batch entries (vLLM's query_start_loc.diff())",
}


def batch_size(attn: AttnMetadata) -> int:
    """The step's number of sequences, agreed by the rows of its
    per-sequence tensors (each a tensor: checked before); the one that
    disagrees with the others is named. A tensor of another rank (a shape
    ``()`` length, a 3-D table) is left out, for the shape check to name."""
    counts = {name: tensor.shape[0] for name, tensor in ((n, getattr(attn, n)) for n in _PER_SEQUENCE)
              if tensor.dim() == (2 if name == "block_offsets" else 1)}
    if not counts:
        shapes = ", ".join(f"attn_metadata.{name} {tuple(getattr(attn, name).shape)}" for name in _PER_SEQUENCE)
        raise InputError(
            f"no per-sequence input has a row per sequence ({shapes}): block_offsets must be (batch, width), "
            "q_start_loc, q_seqlens and kv_seqlens (batch,)"
        )
    values = list(counts.values())
    majority = max(values, key=values.count)
    if values.count(majority) == len(values):
        return majority
    if values.count(majority) * 2 <= len(values):  # no majority: list them all
        listed = ", ".join(f"attn_metadata.{name} has {count}" for name, count in counts.items())
        raise InputError(
            f"the per-sequence inputs disagree on the step's number of sequences ({listed}); each holds one "
            "row per sequence of the step: build them from the same sequence list"
        )
    odd = next(name for name, count in counts.items() if count != majority)
    others = ", ".join(f"attn_metadata.{name}" for name in counts if counts[name] == majority)
    if counts[odd] == majority + 1 and odd in ("q_start_loc", "q_seqlens"):
        hint = f": a cumulative array, one entry longer than the batch? attn_metadata.{odd} holds {_HOLDS[odd]}"
    elif counts[odd] > majority:
        hint = f": a persistent buffer passed whole? Pass its first {majority} rows, {odd}[:{majority}]"
    else:
        hint = ""
    raise InputError(
        f"attn_metadata.{odd} has {counts[odd]} rows, but {others} have {majority}{hint}. Each per-sequence "
        f"input holds one row per sequence of the step; fix attn_metadata.{odd}"
    )


def token_count(inputs: StepInputs) -> int:
    """The step's number of new tokens, agreed by the three per-token inputs
    (ids, positions, slots); the one that disagrees with the other two is
    named, rather than whichever was checked first."""
    ids, positions, slots = inputs.input_ids, inputs.position_ids, inputs.attn_metadata.kv_start_indices
    for name, tensor in (("input_ids", ids), ("position_ids", positions)):
        if tensor.dim() != 2 or tensor.shape[0] != 1:
            raise InputError(
                f"{name} has shape {tuple(tensor.shape)}; it must be (1, T): one row holding every "
                f"sequence's new tokens back to back (use {name}[None] for a (T,) tensor)"
            )
    counts = {
        "input_ids": ids.shape[1],
        "position_ids": positions.shape[1],
        "attn_metadata.kv_start_indices": slots.shape[0] if slots.dim() else 0,
    }
    values = list(counts.values())
    if values[0] == values[1] == values[2]:
        return values[0]
    majority = max(values, key=values.count)
    if values.count(majority) == 1:
        listed = ", ".join(f"{name} has {count}" for name, count in counts.items())
        raise InputError(
            f"the per-token inputs disagree on the step's number of tokens ({listed}); each holds one "
            "entry per new token: build them from the same token list"
        )
    odd = next(name for name, count in counts.items() if count != majority)
    others = " and ".join(name for name in counts if name != odd)
    raise InputError(
        f"{odd} has {counts[odd]} tokens, but {others} have {majority}: each per-token input holds "
        f"one entry per new token of the step; fix {odd}"
    )

"""Comparing a graph step's result with eager's: the outputs (shape, dtype,
values; a failure names the likely cause from what the graph's output
buffer holds) and, after a replay, the padding tokens' finiteness. The
harness (:mod:`graphmode_conformance.harness`) runs the steps and checks
the KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphmode.families.piecewise.breaks import kernels_taking_out
from graphmode_conformance.structure import ConformanceFailure

__all__ = ["check_padding_finite", "compare_outputs", "tolerance"]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of graph against eager for a model of ``dtype``."""
    return (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)


def compare_outputs(where: str, graph: Any, eager: torch.Tensor, seqs: list[int], phase: str, raw: Any,
                    ops: Any) -> None:
    """Raise ConformanceFailure unless ``graph`` (the runner's result; ``raw``
    the object it returned, before any copy) equals ``eager`` in shape, dtype
    and values within :func:`tolerance`. ``seqs``: the sequence of each
    token; ``phase``: "capture" or "replay"; ``ops``: the model's attention
    ops (a piecewise failure may come from their out= path)."""
    if not isinstance(graph, torch.Tensor) or graph.shape != eager.shape:
        shape = tuple(graph.shape) if isinstance(graph, torch.Tensor) else type(graph).__name__
        fewer = isinstance(graph, torch.Tensor) and graph.dim() == eager.dim() and graph.shape[1] < eager.shape[1]
        cause = (
            "the graph computes fewer tokens than the batch: it was captured at a size other than "
            "its bucket (graphmode_update_context must give the model `bucket` rows)"
            if fewer
            else "outputs not cut to the live tokens (graphmode_get_outputs must slice to num_tokens)"
        )
        if fewer and _token_rows_held(raw) >= eager.shape[1]:
            sequences = len(set(seqs))
            by_batch = (
                f": it cut to batch_size ({sequences} sequences), not num_tokens"
                if graph.shape[1] == sequences else ""
            )
            cause = (
                f"outputs cut short: the graph's output holds {_token_rows_held(raw)} token rows, but "
                f"graphmode_get_outputs returned {graph.shape[1]} of the step's {eager.shape[1]} tokens"
                f"{by_batch} (with several new tokens per sequence, q_len > 1, tokens are batch_size * q_len)"
            )
        raise ConformanceFailure(
            f"{where}: graph output has shape {shape}, eager {tuple(eager.shape)}. Likely cause: {cause}"
        )
    if graph.dtype != eager.dtype:
        raise ConformanceFailure(
            f"{where}: graph output has dtype {graph.dtype}, eager {eager.dtype}. Likely cause: "
            "graphmode_get_outputs converted the graph's output (it must return the output buffer's rows as the "
            "model computed them; an engine that wants another dtype converts them itself)"
        )
    atol, rtol = tolerance(eager.dtype)
    if torch.allclose(graph, eager, atol=atol, rtol=rtol):
        return
    diff = (graph.float() - eager.float()).abs()
    index = int(diff.argmax())
    token, logit = divmod(index, diff.shape[-1])
    wrong_rows = (diff.amax(dim=-1)[0] > atol + rtol * eager.abs().amax()).nonzero().flatten().tolist()
    cut = _cut_from_other_rows(raw, eager, atol, rtol)
    if cut is not None:
        cause = cut
    elif phase == "capture":
        cause = (
            "the forward on the graph's buffers already differs from eager at the capture "
            "step: graphmode_make_buffers, graphmode_fill_buffers or graphmode_update_context "
            "give the model wrong inputs"
        )
    else:
        cause = (
            "the replay used stale inputs: a buffer graphmode_fill_buffers did not refill, a "
            "context field not pointing at its buffer (graphmode_update_context), a host value "
            "frozen at capture (a positive max length, host kv lengths not pushed by "
            "graphmode_update_graph_params, or a Python number the kernels of graphmode_attention_ops "
            "derived from host values at capture: a table cut to the longest sequence's blocks, a loop "
            "bound), or a graph captured at a size other than its bucket"
        )
    taking_out = kernels_taking_out(ops)
    if taking_out and cut is None:
        cause += (
            f"; or, in a piecewise step, the out= path of the vendor's {' and '.join(taking_out)} "
            "(piecewise graphs pass out=; the [kernels] check compares it with the result without out)"
        )
    raise ConformanceFailure(
        f"{where}: max |graph - eager| = {diff.max().item():.3g} at token {token} (sequence "
        f"{seqs[token]}), logit {logit}; tolerance atol={atol} rtol={rtol}; wrong tokens: "
        f"{wrong_rows[:8]}{' ...' if len(wrong_rows) > 8 else ''}. Likely cause: {cause}"
    )


@torch.inference_mode()
def _cut_from_other_rows(raw: Any, eager: torch.Tensor, atol: float, rtol: float) -> str | None:
    """Why outputs differ when the graph's output holds eager's values in its
    first rows but the result was cut from others; None otherwise."""
    if not isinstance(raw, torch.Tensor) or raw.dim() < 2 or raw.shape != eager.shape or raw.storage_offset() == 0:
        return None
    first = raw.as_strided(raw.shape, raw.stride(), 0)
    if not torch.allclose(first, eager, atol=atol, rtol=rtol):
        return None
    start = raw.storage_offset() // max(raw.stride(1), 1)
    return (
        f"outputs cut from the wrong rows: the graph's output holds eager's values in its first {raw.shape[1]} "
        f"token rows, but graphmode_get_outputs returned the rows from token {start} on (it must return the "
        "first num_tokens rows: padding rows follow the live ones)"
    )


def _token_rows_held(raw: Any) -> int:
    """How many token rows (dimension 1) the memory behind ``raw`` holds from
    its first row: the graph's output buffer when ``raw`` is a view of it."""
    if not isinstance(raw, torch.Tensor) or raw.dim() < 2 or raw.stride(1) == 0:
        return 0
    elements = raw.untyped_storage().nbytes() // raw.element_size() - raw.storage_offset()
    return elements // raw.stride(1) if raw.shape[0] == 1 else raw.shape[1]


def check_padding_finite(where: str, meta: Any, num_tokens: int) -> None:
    """After a replay, the graph's padding tokens (past the live ones) hold
    finite outputs while block 0 holds zeros (writing-a-plugin: cut away, but
    finite): a NaN there reaches live rows through any op mixing tokens (MoE
    routing, a collective). Not at a capture: a device computes nothing then."""
    for leaf in tree_leaves(meta.output_buffers.get("output")):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point() or leaf.dim() < 2:
            continue
        padding = leaf[:, num_tokens:]
        if padding.numel() == 0 or bool(torch.isfinite(padding).all()):
            continue
        bad = (~torch.isfinite(padding)).flatten(2).any(-1).any(0)
        tokens = (bad.nonzero().flatten() + num_tokens).tolist()
        kv = {b.name: b.padding for b in meta.spec.buffers}.get("kv_seqlens")
        raise ConformanceFailure(
            f"{where}: the graph's padding tokens {num_tokens}..{leaf.shape[1] - 1} give non-finite outputs "
            f"(at tokens {tokens[:8]}{' ...' if len(tokens) > 8 else ''}) with block 0 holding zeros. They are "
            "cut away, but a NaN there reaches live rows through any op mixing tokens (MoE routing, a "
            f"collective over the batch). Likely cause: a declared padding value (here kv_seqlens padding {kv}) "
            "that makes a kernel attend over nothing, with no rule for a row that sees no token "
            "(graphmode.attention.attend gives zeros); fix the padding in graphmode_graph_spec or the kernel "
            "(graphmode_attention_ops)"
        )

"""Batched LoRA for the reference model: adapters mixed in one batch.

Each sequence of a step may use another adapter (or none). The adapters of
one projection are stacked, ``a`` (adapters + 1, in, rank) and ``b``
(adapters + 1, rank, out), and adapter 0 is all zeros: "no adapter", which
sequences without one and padding rows select, so a padding row never reads
garbage. A step gathers each row's ``a`` and ``b`` by id and adds two
batched matmuls to the projection: ``x @ A[id] @ B[id]``. No host reads, no
shape that depends on the ids: it captures in a device graph, and the ids
are a step input (``BufferSpec("lora_ids", torch.int32, padding=0)``) copied
into the graph's buffer every step.

Whether the adapters run at all is a graph variant (``graph_variants=
{"lora": (False, True)}``): the model skips them with ``lora=False``, so a
step without adapters replays a plain graph without the matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphmode.context import AttnMetadata
from graphmode.errors import InputError

__all__ = ["LoraAdapters", "add_lora", "batched_lora", "check_ids", "lora_rows"]


def batched_lora(x: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The adapters' contribution to a projection of ``x`` (T, in): (T, out).

    ``ids`` (R,) int: the adapter of each of R groups of T / R consecutive
    tokens (a sequence of a step where each sequence carries as many tokens;
    R == T: one id per token). ``a`` (n, in, rank) and ``b`` (n, rank, out)
    stack the adapters, gathered by id; one matmul each, batched over R."""
    rows, tokens = ids.shape[0], x.shape[0]
    grouped = x.reshape(rows, tokens // rows, x.shape[-1])
    down = torch.bmm(grouped, a.index_select(0, ids))
    return torch.bmm(down, b.index_select(0, ids)).reshape(tokens, b.shape[-1])


def lora_rows(ids: torch.Tensor, attn: AttnMetadata, tokens: int, count: int | None = None) -> torch.Tensor:
    """The ids as :func:`batched_lora` groups them, for a step of ``tokens``;
    ids outside ``0..count`` refused where reading them costs nothing
    (:func:`check_ids`).

    One id per token is used as it is. One id per sequence is grouped with
    its sequence's tokens when host facts prove every sequence carries as
    many (``batch x max_q_seq_len == tokens``), else expanded to one id per
    token from the step's ``q_seqlens`` on the device (no host read, so a
    full graph captures it and reads each replay's lengths).

    In a piecewise graph's segments the step's metadata is shapes only
    (``meta`` tensors), with no map from token to sequence, and a step input
    declared per sequence arrives as the token bucket's rows (the live
    sequences first, then padding): indistinguishable from one id per token.
    So where piecewise graphs run, declare the ids per token, ``(TOKENS,)``,
    and pass ``ids.repeat_interleave(q_seqlens)``."""
    if count is not None:
        check_ids(ids, count)
    rows = ids.shape[0]
    if rows == tokens:
        return ids
    if attn.q_seqlens.shape[0] != rows:
        raise InputError(
            f"lora_ids has {rows} ids for a step of {attn.q_seqlens.shape[0]} sequences and {tokens} tokens: "
            "pass one adapter id per sequence, or one per token"
        )
    if attn.q_seqlens.device.type == "meta":  # a piecewise segment: no map from token to sequence
        raise InputError(
            f"lora_ids has {rows} ids for {tokens} tokens in a piecewise graph, whose segments see a step "
            "as rows of tokens: declare the ids per token, BufferSpec('lora_ids', torch.int32, "
            "shape=(TOKENS,), padding=0), and pass ids.repeat_interleave(q_seqlens) at every step"
        )
    if attn.max_q_seq_len > 0 and rows * attn.max_q_seq_len == tokens:
        return ids
    return ids.repeat_interleave(attn.q_seqlens.to(ids.device).long(), output_size=tokens)


def check_ids(ids: torch.Tensor, count: int) -> None:
    """Refuse an id outside ``0..count`` where that reads no device: host
    ids outside any capture or trace (eager steps on the host). A graph reads
    its ids from a device buffer, unread by the host: there, and for device
    ids, an id past the adapters fails ``index_select`` (the emulator's
    IndexError, a GPU's device-side assert), so it never reads another
    adapter's weights."""
    if ids.device.type != "cpu" or not ids.numel() or _tracing(ids):
        return
    outside = ((ids < 0) | (ids > count)).nonzero()
    if outside.numel():
        row = int(outside[0, 0])
        raise InputError(
            f"lora_ids holds {int(ids[row])} (sequence or token {row}), outside 0..{count}: the model has "
            f"{count} adapters (ids 1..{count}; 0: none). Pass ids in 0..{count}, or add more adapters "
            f"(add_lora(model, count=...))"
        )


def _tracing(ids: torch.Tensor) -> bool:
    """Whether the ids are symbolic or captured, their values unreadable (an
    emulated capture refuses host reads; a fake tensor has none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from graphmode.emulator import current_session

    return isinstance(ids, FakeTensor) or torch.compiler.is_compiling() or current_session() is not None


class LoraAdapters(nn.Module):
    """The stacked adapters of one projection; adapter 0 stays zero."""

    def __init__(self, count: int, rank: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(count + 1, in_features, rank))
        self.b = nn.Parameter(torch.zeros(count + 1, rank, out_features))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return batched_lora(x, ids, self.a, self.b)


def add_lora(model: Any, count: int, rank: int = 4, seed: int = 0, std: float = 0.05) -> Any:
    """``model`` (a :class:`graphmode.model.LlamaModel`) with ``count``
    random adapters (ids 1..count; 0 is none) on every layer's qkv and output
    projections, on the model's device and dtype. Its forward then takes
    ``lora_ids`` (one int per sequence, or per token) and ``lora`` (False:
    the adapters are skipped). Not for a tensor-parallel (sharded) model."""
    if count < 1 or rank < 1:
        raise ValueError(f"add_lora(count={count}, rank={rank}): both must be positive")
    if getattr(model, "tp_size", 1) != 1:
        raise ValueError("add_lora: the model is sharded (tensor parallel); add adapters before sharding is not supported either")
    generator = torch.Generator().manual_seed(seed)
    weight = model.embed_tokens.weight
    for layer in model.layers:
        attn = layer.self_attn
        for name, proj in (("qkv_lora", attn.qkv_proj), ("o_lora", attn.o_proj)):
            adapters = LoraAdapters(count, rank, proj.in_features, proj.out_features)
            with torch.no_grad():
                for param in (adapters.a, adapters.b):
                    param[1:].copy_(torch.randn(param[1:].shape, generator=generator) * std)
            setattr(attn, name, adapters.to(device=weight.device, dtype=weight.dtype))
    model.lora_count = count
    return model

"""One output buffer shared by every bucket's graph.

A graph's result tensor lives in the graph memory pool for as long as the
graph does, so with one result per bucket the pool holds the sum of all
buckets' results (for logits, bucket x vocabulary each: most of the pool).
Only one step's result is live at a time (a result is valid until the next
step), so every graph instead ends by copying its result into the first
``bucket`` token columns of one buffer per output tensor, sized for the
largest bucket and allocated outside the pool. The graph's own result is then
an intermediate like any other, whose memory later captures reuse.

With ``adopt=True`` (the piecewise family), when the first graph captured is
the largest bucket (warm-up captures largest first), its own result becomes
the buffers instead: that graph copies nothing, which matters where its
result is largest (32768 tokens of logits are 2 GiB, a 1.3 ms copy on an
H100), and no buffer is allocated beside it. The full decode graphs do not
adopt (``adopt=False``): an adopted result stays live in the pool, in a
segment it shares with the largest graph's intermediates, and every later
capture needs room beside it: on an H100 the pool of 48 buckets grew a
second 20 MiB segment for it, 1.71x the largest graph alone
(docs/performance.md, "the pool"). Their buffer (256 tokens of logits,
16 MiB) is allocated outside the pool before the first capture, and the
largest graph copies into it too (about 10 us of device time a step at 256
tokens on an H100).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from graphmode.errors import CaptureError

__all__ = ["SharedOutputs", "check_token_dimension"]


def check_token_dimension(output: Any, tokens: int, sequences: int | None = None) -> None:
    """Refuse, before a capture, a result tensor of two or more dimensions
    whose second dimension is not the graph's ``tokens`` (padding included).

    Every graph result is cut to the step's live tokens along dimension 1
    (the model contract, ``(1, T, ...)``), so such a tensor would come back
    cut along something else: ``(T, vocab)`` logits (vLLM's models return
    ``(num_tokens, hidden)``) lose all but ``T`` columns of the vocabulary,
    and one row per sequence (each sequence's last token) keeps padding rows
    in a verify step. A 1-D tensor of ``tokens`` values (token ids sampled
    inside the forward, one log-probability per token) is refused too: it
    would come back uncut, padding rows included; so is one of
    ``sequences`` values (the graph's rows, padding included, where a
    full graph takes several tokens per sequence: one value per sequence of
    a verify step). Scalars and other 1-D tensors are returned whole.

    Python values in the result (a number, a string: anything but tensors
    and None) are refused: a graph returns them as the capture's forward
    computed them, at every replay (a token count, a step's maximum came
    back frozen, silently)."""
    for path, leaf in tree_flatten_with_path(output)[0]:
        where = f"the model's result{keystr(path)}"
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"{where} is {type(leaf).__name__} {leaf!r}, a Python value: a graph replays the forward's tensor "
                "operations only, so every graph step would return the value this capture computed, whatever "
                "the step. Return it as a tensor the forward computes (torch.tensor(value) is frozen too: derive "
                "it from the inputs' tensors), or compute it outside the forward from the step's inputs"
            )
        if sequences is not None and sequences != tokens and isinstance(leaf, torch.Tensor) and leaf.dim() == 1 \
                and leaf.shape[0] == sequences:
            raise CaptureError(
                f"{where} has shape ({sequences},), one value per sequence of the graph being captured "
                f"({sequences} sequences, padding rows included, of {tokens // sequences} tokens each): graph "
                "results are cut to the live tokens along dimension 1, the model contract's (1, T, ...), and a "
                "1-D result is returned whole, so it would come back with the padding rows' values after the "
                "live ones. Return per-token values as (1, T) and pick each sequence's after the call "
                "(q_start_loc + q_seqlens - 1)"
            )
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 1 and leaf.shape[0] == tokens:
            raise CaptureError(
                f"{where} has shape ({tokens},), one value per token of the graph being captured ({tokens} "
                "tokens, padding included): graph results are cut to the live tokens along dimension 1, the model "
                "contract's (1, T, ...), and a 1-D result is returned whole, so it would come back with the padding "
                "tokens' values after the live ones. Return per-token values as (1, T): result[None]"
            )
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] != tokens:
            raise CaptureError(
                f"{where} has shape {tuple(leaf.shape)}, but the graph being captured runs {tokens} tokens "
                f"(padding included): graph results are cut to the live tokens along dimension 1, the model "
                "contract's (1, T, ...), so dimension 1 of every result of two or more dimensions must be the "
                "step's token count. Return per-token tensors: add the leading dimension to (T, hidden) states "
                "(result[None]), and pick rows such as each sequence's last token "
                "(q_start_loc + q_seqlens - 1) from the result after the call, not inside the forward"
            )


class SharedOutputs:
    """The shared buffers: allocated from the first warm-up result, or, when
    the first graph captured is the largest and ``adopt``, that graph's own result.

    An output tensor is shared when its second dimension is the step's token
    count (the model contract); any other output (a scalar, a tensor of
    another layout) stays the graph's own."""

    def __init__(self, max_tokens: int, adopt: bool = True) -> None:
        self.max_tokens = max_tokens
        self.adopt = adopt
        self.buffers: list[torch.Tensor | None] | None = None

    def prepare(self, example: Any, tokens: int, sequences: int | None = None) -> None:
        """Allocate the buffers from a result computed outside any graph,
        unless the graph about to be captured is the largest and its result
        is to be adopted (:meth:`publish`). Refuses a result that is not per
        token (:func:`check_token_dimension`)."""
        check_token_dimension(example, tokens, sequences)
        if self.buffers is not None or (self.adopt and tokens == self.max_tokens):
            return
        self.buffers = [
            torch.empty((leaf.shape[0], self.max_tokens, *leaf.shape[2:]), dtype=leaf.dtype, device=leaf.device)
            if _per_token(leaf, tokens) else None
            for leaf in tree_flatten(example)[0]
        ]

    def publish(self, output: Any, tokens: int) -> Any:
        """Inside the capture: copy ``output`` into the shared buffers and
        return the same structure made of their views."""
        leaves, spec = tree_flatten(output)
        if self.buffers is None:  # the largest bucket, captured first: its result is the buffer
            self.buffers = [leaf if _per_token(leaf, tokens) and _owns_storage(leaf) else None for leaf in leaves]
            return output
        buffers = self.buffers
        if len(leaves) != len(buffers):  # another structure than the first result: keep it
            return output
        published = []
        for leaf, buffer in zip(leaves, buffers):
            if buffer is not None and _per_token(leaf, tokens) and leaf.shape[2:] == buffer.shape[2:] \
                    and leaf.shape[0] == buffer.shape[0] and leaf.dtype == buffer.dtype:
                view = buffer.narrow(1, 0, tokens)
                view.copy_(leaf)
                published.append(view)
            else:
                published.append(leaf)
        return tree_unflatten(published, spec)


def _owns_storage(leaf: torch.Tensor) -> bool:
    """Whether ``leaf`` is the whole of a storage of its own (an operator's
    fresh result), not a view of something the graph reads, such as an input
    buffer, which later graphs' copies would overwrite."""
    return leaf._base is None and leaf.is_contiguous() and \
        leaf.untyped_storage().nbytes() == leaf.numel() * leaf.element_size()


def _per_token(leaf: Any, tokens: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] == tokens

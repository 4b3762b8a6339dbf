"""Debug mode: checks that need the step's device values.

The runner's normal checks (``graphmode.checks.validate``) read host facts
only, so that a step costs no synchronisation. Some engine mistakes show
only in the values: a slot in another sequence's block, two tokens writing
one slot, a block id past the cache, a length the table cannot hold, host
lengths that disagree with the device's, an input id outside the model's
vocabulary. A graph replays them silently (an
eager kernel might fault, or might not). With ``debug=True`` (or
``$GRAPHMODE_DEBUG=1``) every step, graph or eager, reads its attention
tensors to the host in one copy (one synchronisation) and refuses such
values, naming the row, the value, the limit and the fix. The part of these checks that host
values answer (the step's lengths against each other and its maxima) runs
without debug mode too: ``graphmode.checks.host_lengths``.

Device graphs are captured with their runtime's debug mode on
(``DeviceGraph.enable_debug_mode``), so that ``debug_dump`` works on them;
with ``$GRAPHMODE_DEBUG_DUMP`` set to a directory, each capture writes its
dump there.

It also compares, before every replay, the address of every tensor the
graph captured by reference (KV-cache tensors, extra inputs, the model's
parameters and buffers) with its address at capture, as vLLM's CUDA-graph
debug mode does: a tensor whose memory moved (``param.data = new``,
``tensor.set_(...)``) leaves the graph reading the old memory.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphmode.checks.host_lengths import check_kv_holds_q, check_query_lengths, check_uniform_step, first_bad
from graphmode.checks.validate import cache_geometry
from graphmode.context import KVCache, StepInputs
from graphmode.errors import InputError

__all__ = ["ENV_DEBUG_DUMP", "StepChecker"]

ENV_DEBUG_DUMP = "GRAPHMODE_DEBUG_DUMP"
# What torch (2.14+) raises for a CUDA graph's dump without the cuda-bindings package.
CUDA_BINDINGS_MISSING = "requires the cuda-bindings package"


@dataclass
class _Step:
    """One step's attention values on the host."""

    table: torch.Tensor  # (B, W) int64
    kv_lens: torch.Tensor  # (B,)
    slots: torch.Tensor  # (T,), T = B x q_len
    q_lens: torch.Tensor  # (B,)
    q_starts: torch.Tensor  # (B,)
    ids: torch.Tensor  # (T,)


class StepChecker:
    """The debug checks of one runner: ``check_step`` before every graph
    step, ``record`` after a capture, ``check_addresses`` before a replay."""

    def __init__(self, model: Any, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.geometry = cache_geometry(model)
        # The embedding's rows (model.config.vocab_size: the reference model's, a Hugging Face model's), if known.
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self.vocab = vocab if type(vocab) is int and vocab > 0 else None
        self._addresses: dict[str, list[tuple[str, int]]] = {}

    # -- values ---------------------------------------------------------------

    def check_step(self, inputs: StepInputs, batch: int, uniform: bool = True, ids: bool = True) -> None:
        """Refuse a step whose device values would make it read or write the
        wrong cache entries: a full graph's decode step (``uniform``: ``q_len``
        new tokens per sequence, proved on the host from ``max_q_seq_len``),
        or any other step (prefill, mixed, decode: each sequence's tokens from
        its ``q_seqlens``), a piecewise graph's or an eager one. ``ids``: check
        the input ids against the vocabulary too (not in an eager step, whose
        model may take placeholder ids beside embeddings of its own)."""
        step = _read(inputs, batch)
        tokens = inputs.num_tokens
        block_size = self.block_size
        width = step.table.shape[1]
        capacity = width * block_size
        cache_blocks = self._cache_blocks(inputs.past_key_values)
        if ids and self.vocab is not None:  # an id past the embedding: an IndexError inside the replay, a device assert on CUDA
            first_bad((step.ids < 0) | (step.ids >= self.vocab), lambda t: (
                f"token {t} has input id {int(step.ids[t])}, outside the model's vocabulary 0..{self.vocab - 1} "
                f"(config.vocab_size={self.vocab}): the embedding would index past its rows. Pass token ids the "
                "model knows (a tokenizer with added tokens needs the model's embeddings resized)"))
        # A row writing nothing (every slot -1) is padding an engine added itself (to a capture size, as
        # graph mode pads): it may read the reserved block, and hold no KV token (vLLM pads seq_lens with 0).
        writes, seq = torch.zeros(batch, dtype=torch.bool), torch.repeat_interleave(step.q_lens.clamp(min=0))
        if seq.shape[0] == tokens:  # else the length checks below refuse the step
            writes[seq[step.slots >= 0]] = True
        if uniform:
            self._check_uniform(inputs, step, batch)
            check_kv_holds_q(step.q_lens.tolist(), step.kv_lens.tolist(), "debug mode: ", writes.tolist())
        else:
            check_query_lengths(inputs.attn_metadata, tokens, step.q_lens, step.q_starts, step.kv_lens, "debug mode: ",
                                writes.tolist())
        first_bad(step.kv_lens > capacity, lambda r: (
            f"sequence {r} has kv_seqlens={int(step.kv_lens[r])}, above the {capacity} tokens its block table "
            f"can address ({width} blocks x block_size={block_size}); give it more blocks (a wider table)"))
        kv_max = inputs.attn_metadata.max_kv_seq_len
        if isinstance(kv_max, int) and kv_max >= 0:  # a graph's context has its own maximum: eager would clamp
            first_bad(step.kv_lens > kv_max, lambda r: (
                f"sequence {r} has kv_seqlens={int(step.kv_lens[r])}, above the step's max_kv_seq_len={kv_max}: "
                "kernels that size their work by the maximum (Camb, PPU, FlashAttention's max_seqlen_k) would read "
                "part of its cache eagerly, where a graph's own maximum reads all of it. Pass the step's real "
                "max_kv_seq_len (the largest kv_seqlens), or -1"))
        host = inputs.attn_metadata.kv_seqlens_cpu
        if host is not None:
            first_bad(host.reshape(-1).long() != step.kv_lens, lambda r: (
                f"sequence {r} has kv_seqlens_cpu={int(host[r])} on the host but kv_seqlens={int(step.kv_lens[r])} "
                "on the device; kernels that take host lengths (Ascend) would use the host value. Build both "
                "from the same lengths"))
        limit = f"the cache's {cache_blocks} blocks (0..{cache_blocks - 1})" if cache_blocks else "0 or more"
        out_of_range = (step.table < 0) | (step.table >= (cache_blocks or torch.iinfo(torch.int64).max))
        first_bad(out_of_range.any(1), lambda r: (
            f"sequence {r}'s block table holds block id {_bad(step.table[r], out_of_range[r])} (column "
            f"{int(out_of_range[r].nonzero()[0])}), outside {limit}; kernels would read memory outside the "
            "cache. Fill unused columns with 0 (the reserved block) and give sequences only allocated blocks"))
        owned = torch.arange(width)[None, :] < ((step.kv_lens + block_size - 1) // block_size)[:, None]
        # The blocks up to a row's last written position: its live tokens read no further (a drafter's
        # trailing padding tokens, slot -1, may lie in a block not given to the sequence yet).
        written = step.slots >= 0
        position = step.kv_lens[seq] - (step.q_starts + step.q_lens)[seq] + torch.arange(tokens)
        reach = torch.zeros(batch, dtype=torch.long).scatter_reduce_(0, seq[written], position[written] + 1, "amax")
        reserved = (torch.arange(width)[None, :] < ((reach + block_size - 1) // block_size)[:, None]) \
            & (step.table == 0)
        first_bad(reserved.any(1), lambda r: (
            f"sequence {r} uses block 0 (column {int(reserved[r].nonzero()[0])} of its table, within its "
            f"kv_seqlens={int(step.kv_lens[r])}) and writes the cache; block 0 is reserved for padding rows "
            "(rows whose slots are all -1): never give it to a sequence"))
        self._check_slots(step, owned)

    def _check_uniform(self, inputs: StepInputs, step: _Step, batch: int) -> None:
        """A full graph's decode step: every sequence has the graph's q_len
        new tokens, starting at row x q_len."""
        check_uniform_step(inputs.attn_metadata, batch, inputs.num_tokens, step.q_lens, step.q_starts, "debug mode: ")

    def _check_slots(self, step: _Step, owned: torch.Tensor) -> None:
        block_size, slots = self.block_size, step.slots
        # Token t belongs to sequence seq[t]; it is behind[t] tokens from its sequence's end.
        seq = torch.repeat_interleave(rows := torch.arange(step.q_lens.shape[0]), step.q_lens)
        behind = (step.q_starts + step.q_lens)[seq] - torch.arange(slots.shape[0])
        rows_owned = owned
        rows_owned, table, owned = owned, step.table[seq], owned[seq]  # owned per token
        writes = slots >= 0
        first_bad(slots < -1, lambda t: (
            f"token {t} (sequence {int(seq[t])}) has slot {int(slots[t])}; a slot is block x block_size + offset, "
            "or -1 to write nothing"))
        block_of = torch.where(writes, slots // block_size, -1)
        mine = ((table == block_of[:, None]) & owned).any(1)
        first_bad(writes & ~mine, lambda t: (
            f"token {t} (sequence {int(seq[t])}) writes slot {int(slots[t])} (block {int(block_of[t])}), outside "
            f"the sequence's own blocks {table[t][owned[t]].tolist()}: it would overwrite another "
            "sequence's (or the reserved block's) cache. Write the token to its sequence's slot"))
        # The new tokens are the sequence's last q_seqlens positions, in order.
        position = step.kv_lens[seq] - behind
        column = position.clamp(min=0) // block_size
        expected = table.gather(1, column[:, None])[:, 0] * block_size + position % block_size
        first_bad(writes & (slots != expected), lambda t: (
            f"token {t} (sequence {int(seq[t])}) writes slot {int(slots[t])}, but its position "
            f"kv_seqlens-{int(behind[t])}={int(position[t])} lives at slot {int(expected[t])} (block "
            f"{int(table[t, column[t]])}, offset {int(position[t]) % block_size}); the next step would read a "
            "token that was never written. Slot = block_offsets[seq, pos // block_size] x block_size + "
            "pos % block_size"))
        written = slots[writes]
        unique, counts = written.unique(return_counts=True)
        if (counts > 1).any():
            slot = int(unique[counts > 1][0])
            tokens = (slots == slot).nonzero().reshape(-1)
            raise InputError(
                f"debug mode: tokens {tokens.tolist()} (sequences {seq[tokens].tolist()}) all write slot {slot}: two "
                "tokens writing one slot leave one of them lost (which one is undefined on a device). Give each "
                "token its own slot"
            )
        # A block in two rows' tables (a finished row's stale table) passes the above: refuse live overwrites.
        hit = (step.table[None] == block_of[:, None, None]) & rows_owned[None] & writes[:, None, None]  # (T, B, W)
        position = torch.arange(step.table.shape[1]) * block_size + (slots % block_size)[:, None, None]
        hit &= (position < (step.kv_lens - step.q_lens)[None, :, None]) & (seq[:, None] != rows)[:, :, None]
        def overwrite(t: int) -> str:
            r, w = hit[t].nonzero()[0].tolist()
            return (f"token {t} (sequence {int(seq[t])}) writes slot {int(slots[t])}, sequence {r}'s cached token "
                    f"{w * block_size + int(slots[t]) % block_size} (column {w} of its table): it would overwrite a "
                    "live sequence's cache. Only one sequence writes a block: drop finished sequences' rows, copy a "
                    "shared block before writing into it")
        first_bad(hit.flatten(1).any(1), overwrite)

    def _cache_blocks(self, past_key_values: KVCache) -> int | None:
        """The block count of the smallest KV-cache tensor, in the layout of
        the model's attention ops; None when the layout is unknown."""
        if self.geometry is None:
            return None
        dim = self.geometry.blocks_dim
        sizes = [t.shape[dim] for t in tree_flatten(past_key_values)[0] if isinstance(t, torch.Tensor) and t.dim() > dim]
        return min(sizes) if sizes else None

    # -- addresses ------------------------------------------------------------

    def record(self, graph: str, extras: dict[str, Any]) -> None:
        """Remember where every tensor a graph (named as errors name it:
        "bucket 8, q_len 2", "token bucket 16 (piecewise)") captured by
        reference lives: its frozen extras and the model's parameters and
        buffers. (The KV cache's addresses are checked always, debug mode or
        not: ``cache_checks.CacheMemory``.)"""
        self._addresses[graph] = self._current(extras)

    def dump(self, graph: Any, file: str, what: str) -> None:
        """The device graph's debug dump of a new capture, written to
        ``$GRAPHMODE_DEBUG_DUMP/<file>.dump`` when that directory is set
        (CUDA: a DOT file; the emulator: its operators): ``bucket8-q1`` for a
        full graph, ``tokens8-segment2`` for a piecewise graph's segment.
        ``what``: how a warning names the graph."""
        folder = os.environ.get(ENV_DEBUG_DUMP)
        if not folder:
            return
        os.makedirs(folder, exist_ok=True)
        try:
            graph.debug_dump(os.path.join(folder, f"{file}.dump"))
        except NotImplementedError as error:
            warnings.warn(f"${ENV_DEBUG_DUMP}: {error}; no dump of {what}", stacklevel=2)
        except RuntimeError as error:
            # torch 2.14+ writes CUDA graphs' DOT files through the cuda-bindings
            # package (torch/cuda/graphs.py, _require_cuda_bindings), which a
            # torch built elsewhere than PyPI may lack: a missing dump, not a failed capture.
            if CUDA_BINDINGS_MISSING not in str(error):
                raise
            warnings.warn(f"${ENV_DEBUG_DUMP}: {error}; no dump of {what}", stacklevel=2)

    def check_addresses(self, graph: str, extras: dict[str, Any]) -> None:
        """Refuse a replay when a captured tensor's memory moved since capture."""
        then = self._addresses.get(graph)
        if then is None:
            return
        now = self._current(extras)
        for (name, before), (_, after) in zip(then, now):
            if before != after:
                raise InputError(
                    f"debug mode: {name} is at address {after:#x}, but the graph of {graph} captured it at "
                    f"{before:#x}: the graph would keep reading (and writing) the old memory. Change captured "
                    "tensors in place (.copy_()), or call runner.reset() after giving them new memory "
                    "(param.data = ..., tensor.set_(...), a reallocated cache)"
                )
        if len(then) != len(now):
            raise InputError(
                f"debug mode: the graph of {graph} captured {len(then)} tensors by reference, now there are "
                f"{len(now)} (parameters or buffers added or removed); call runner.reset() to capture again"
            )

    def _current(self, extras: dict[str, Any]) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        for name in sorted(extras):
            leaves = tree_flatten(extras[name])[0]
            found += [(f"extra input {name!r} (leaf {i})", t.data_ptr()) for i, t in enumerate(leaves)
                      if isinstance(t, torch.Tensor)]
        named = getattr(self.model, "named_parameters", None)
        if named is not None:
            found += [(f"model parameter {n!r}", p.data_ptr()) for n, p in named()]
            found += [(f"model buffer {n!r}", b.data_ptr()) for n, b in self.model.named_buffers()]
        return found


def _read(inputs: StepInputs, batch: int) -> _Step:
    """The step's attention tensors on the host, in one copy: one
    synchronisation however many tensors."""
    attn = inputs.attn_metadata
    parts = (attn.block_offsets, attn.kv_seqlens, attn.kv_start_indices, attn.q_seqlens, attn.q_start_loc,
             inputs.input_ids)
    flat = torch.cat([t.reshape(-1).long() for t in parts]).cpu()
    table_size = attn.block_offsets.numel()
    table = flat[:table_size].view(batch, -1)
    kv_lens, slots, q_lens, q_starts, ids = flat[table_size:].split(
        [batch, attn.kv_start_indices.numel(), batch, batch, inputs.input_ids.numel()]
    )
    return _Step(table, kv_lens, slots, q_lens, q_starts, ids)


def _bad(row: torch.Tensor, mask: torch.Tensor) -> int:
    return int(row[mask][0])

"""Debug mode: checks that need the step's device values.

The runner's normal checks (``graphmode.runner.validate``) read host facts
only, so that a step costs no synchronisation. Some engine mistakes show
only in the values: a slot in another sequence's block, two tokens writing
one slot, a block id past the cache, a length the table cannot hold, host
lengths that disagree with the device's, an input id outside the model's
vocabulary. A graph replays them silently (an
eager kernel might fault, or might not). With ``debug=True`` (or
``$GRAPHMODE_DEBUG=1``) every graph step reads its attention tensors to the
host in one copy (one synchronisation) and refuses such values, naming the
row, the value, the limit and the fix. The part of these checks that host
values answer (a piecewise step's host lengths against its maxima) runs
without debug mode too: :func:`check_piecewise_step`.

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

from graphmode.context import AttnMetadata, StepInputs
from graphmode.errors import InputError
from graphmode.runner.validate import cache_geometry

__all__ = ["ENV_DEBUG_DUMP", "StepChecker", "check_piecewise_step", "check_query_lengths", "check_uniform_step"]

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

    def check_step(self, inputs: StepInputs, batch: int, uniform: bool = True) -> None:
        """Refuse a graph step whose device values would make the graph read
        or write the wrong cache entries: a full graph's decode step
        (``uniform``: ``q_len`` new tokens per sequence, proved on the host
        from ``max_q_seq_len``), or any step a piecewise graph runs (prefill,
        mixed, decode: each sequence's tokens from its ``q_seqlens``)."""
        step = _read(inputs, batch)
        tokens = inputs.num_tokens
        block_size = self.block_size
        width = step.table.shape[1]
        capacity = width * block_size
        cache_blocks = self._cache_blocks(inputs.past_key_values)
        if self.vocab is not None:  # an id past the embedding: an IndexError inside the replay, a device assert on CUDA
            _first((step.ids < 0) | (step.ids >= self.vocab), lambda t: (
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
            _check_kv_holds_q(step.q_lens.tolist(), step.kv_lens.tolist(), "debug mode: ", writes.tolist())
        else:
            check_query_lengths(inputs.attn_metadata, tokens, step.q_lens, step.q_starts, step.kv_lens, "debug mode: ",
                                writes.tolist())
        _first(step.kv_lens > capacity, lambda r: (
            f"sequence {r} has kv_seqlens={int(step.kv_lens[r])}, above the {capacity} tokens its block table "
            f"can address ({width} blocks x block_size={block_size}); give it more blocks (a wider table)"))
        host = inputs.attn_metadata.kv_seqlens_cpu
        if host is not None:
            _first(host.reshape(-1).long() != step.kv_lens, lambda r: (
                f"sequence {r} has kv_seqlens_cpu={int(host[r])} on the host but kv_seqlens={int(step.kv_lens[r])} "
                "on the device; kernels that take host lengths (Ascend) would use the host value. Build both "
                "from the same lengths"))
        limit = f"the cache's {cache_blocks} blocks (0..{cache_blocks - 1})" if cache_blocks else "0 or more"
        out_of_range = (step.table < 0) | (step.table >= (cache_blocks or torch.iinfo(torch.int64).max))
        _first(out_of_range.any(1), lambda r: (
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
        _first(reserved.any(1), lambda r: (
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
        _first(slots < -1, lambda t: (
            f"token {t} (sequence {int(seq[t])}) has slot {int(slots[t])}; a slot is block x block_size + offset, "
            "or -1 to write nothing"))
        block_of = torch.where(writes, slots // block_size, -1)
        mine = ((table == block_of[:, None]) & owned).any(1)
        _first(writes & ~mine, lambda t: (
            f"token {t} (sequence {int(seq[t])}) writes slot {int(slots[t])} (block {int(block_of[t])}), outside "
            f"the sequence's own blocks {table[t][owned[t]].tolist()}: it would overwrite another "
            "sequence's (or the reserved block's) cache. Write the token to its sequence's slot"))
        # The new tokens are the sequence's last q_seqlens positions, in order.
        position = step.kv_lens[seq] - behind
        column = position.clamp(min=0) // block_size
        expected = table.gather(1, column[:, None])[:, 0] * block_size + position % block_size
        _first(writes & (slots != expected), lambda t: (
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
        _first(hit.flatten(1).any(1), overwrite)

    def _cache_blocks(self, past_key_values: Any) -> int | None:
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


def check_uniform_step(attn: AttnMetadata, batch: int, tokens: int, q_lens: torch.Tensor, q_starts: torch.Tensor,
                       prefix: str = "") -> None:
    """Refuse host copies of a full graph's decode step's lengths that are
    not the graph's: every sequence has ``q_len = tokens / batch`` new tokens
    (host facts proved it from ``max_q_seq_len``, which bounds every entry),
    starting at row x q_len. The graph replays its own q_len pattern, so an
    engine's other values ran silently, and eager steps of the same inputs
    gave other results. Debug mode checks every graph step; without it, a
    host-built step of several tokens per sequence is checked
    (``FullGraphs.run``: host tensors, no synchronisation). A length above
    ``max_q_seq_len`` is named first: a maximum that understates the step's
    query lengths is how an unequal step (``[3, 1]`` under 2) passes as
    uniform."""
    q_len = tokens // batch
    rows = torch.arange(batch)
    q_max = attn.max_q_seq_len
    if q_max >= 0:
        _first(q_lens > q_max, lambda r: (
            f"max_q_seq_len={q_max}, but sequence {r} has q_seqlens={int(q_lens[r])}: the maximum understates the "
            f"step's query lengths, so its {tokens} tokens for {batch} sequences (batch x max_q_seq_len) passed as "
            f"a decode step of {q_len} token(s) per sequence, whose graph replays {q_len} for every sequence "
            "while eager steps read the real lengths. Pass the step's real max_q_seq_len (the largest q_seqlens, "
            f"{int(q_lens.max())}): a step of unequal query lengths then runs eagerly (piecewise in "
            "execute_mode='full_and_piecewise')"), prefix)
    _first(q_lens != q_len, lambda r: (
        f"sequence {r} (row {r}) has q_seqlens={int(q_lens[r])}, but this graph decode step has "
        f"{q_len} new token(s) per sequence ({tokens} tokens for {batch} sequences, "
        f"max_q_seq_len={attn.max_q_seq_len}); pass the step's real q_seqlens and "
        "max_q_seq_len (a step of unequal query lengths runs eagerly), or is_decoding=False"), prefix)
    _first(q_starts != rows * q_len, lambda r: (
        f"sequence {r} has q_start_loc={int(q_starts[r])}; in a decode step of {q_len} token(s) per "
        f"sequence, sequence {r}'s tokens start at token {r * q_len}: q_start_loc must be "
        f"arange(batch) x {q_len}"), prefix)


def check_query_lengths(attn: AttnMetadata, tokens: int, q_lens: torch.Tensor, q_starts: torch.Tensor,
                        kv_lens: torch.Tensor, prefix: str = "", writes: list[bool] | None = None) -> None:
    """Refuse host copies of a step's lengths that a piecewise step (prefill,
    mixed, decode: each sequence's tokens from its ``q_seqlens``) cannot
    have: a negative query length, lengths not summing to the step's
    tokens, ``q_start_loc`` other than their exclusive cumulative sum, fewer
    KV than new tokens, and lengths above the step's maxima (unless -1): the
    break points hand the kernels the step's own maxima, and one sizing its
    work by them (CUDA's Triton prefill grid, FlashAttention's
    max_seqlen_k) skips the rows or cached tokens past one too small. Debug
    mode checks every such step (:func:`check_piecewise_step` a step built
    on the host, in part)."""
    q, starts, kv = q_lens.tolist(), q_starts.tolist(), kv_lens.tolist()
    if sum(q) != tokens:
        raise InputError(
            f"{prefix}q_seqlens {q} sum to {sum(q)}, but the step has {tokens} new tokens (input_ids' length); "
            "pass each sequence's new token count"
        )
    q_max, kv_max, start = attn.max_q_seq_len, attn.max_kv_seq_len, 0
    for row, (count, first, length) in enumerate(zip(q, starts, kv)):
        if count < 0:  # 0 is a padding row's (docs/engines.md, "Rows of zero new tokens")
            raise InputError(
                f"{prefix}sequence {row} has q_seqlens={count}, below 0: pass each sequence's new token count "
                "(0 for a padding row)"
            )
        for value, name, bound in ((count, "q_seqlens", q_max), (length, "kv_seqlens", kv_max)):
            if 0 <= bound < value:
                maximum = "max_q_seq_len" if name == "q_seqlens" else "max_kv_seq_len"
                raise InputError(
                    f"{prefix}sequence {row} has {name}={value}, above {maximum}={bound}: kernels that size their "
                    f"work by {maximum} (CUDA's Triton prefill grid) would skip part of the sequence. Pass the "
                    f"step's real {maximum} (the largest {name}), or -1"
                )
        if first != start:
            raise InputError(
                f"{prefix}sequence {row} has q_start_loc={first}, but its tokens start at token {start} (the "
                "earlier sequences' q_seqlens summed): q_start_loc must be the exclusive cumulative sum of q_seqlens"
            )
        start += count
    _check_kv_holds_q(q, kv, prefix, writes)


def check_piecewise_step(attn: AttnMetadata, tokens: int, on_host: bool) -> None:
    """The host facts a piecewise step is checked for, without debug mode:
    its break points hand the kernels the step's own maxima and host lengths
    (graph steps' contexts have their own), so a ``max_kv_seq_len`` below
    the host lengths ``kv_seqlens_cpu`` is refused (Camb's decode kernel
    clamps the lengths it reads to it: a silently wrong result). A step built
    on the host (``on_host``) is also checked, from its lengths, for what
    :func:`check_query_lengths` reads first: its query lengths sum to its
    tokens, ``q_start_loc`` is their exclusive cumulative sum, the lengths
    stay within its maxima (CUDA's Triton prefill sizes its grid by
    ``max_q_seq_len``), and ``kv_seqlens_cpu`` (which Ascend's kernels read)
    equals ``kv_seqlens``. Negative query lengths and KV lengths below
    the query lengths are debug mode's (two more reductions a step). Host tensors cost no synchronisation: a few
    reductions, whatever the batch; rows are walked only when one fails, to
    name the first bad one."""
    host, kv_max = attn.kv_seqlens_cpu, attn.max_kv_seq_len
    q_lens, kv_lens, starts = attn.q_seqlens, attn.kv_seqlens, attn.q_start_loc
    if host is not None and kv_max >= 0 and int(host.max()) > kv_max:
        if on_host and not torch.equal(host, kv_lens) and int(kv_lens.max()) <= kv_max:
            _host_lengths_differ(host, kv_lens)  # the maximum is right: the host lengths are not
        row = int((host > kv_max).nonzero()[0])
        raise InputError(
            f"max_kv_seq_len={kv_max}, but attn_metadata.kv_seqlens_cpu holds {int(host[row])} (sequence {row}): "
            "kernels that size their work by the maximum (Camb, PPU, FlashAttention's max_seqlen_k) would read "
            "part of that sequence's cache. Pass the step's real max_kv_seq_len (the largest kv_seqlens), or -1; "
            "or, if max_kv_seq_len is right, kv_seqlens_cpu is not the host copy of kv_seqlens: build both from "
            "the same lengths"
        )
    if not on_host:
        return
    # Each sequence's start plus its length is the running total of the lengths, ending at the step's
    # tokens: a start off it has the sequence read another's queries and leaves its own output rows
    # stale in the graph's buffer (piecewise != eager).
    ends = q_lens.cumsum(0)
    if int(ends[-1]) != tokens or not torch.equal(starts + q_lens, ends) \
            or 0 <= attn.max_q_seq_len < int(q_lens.max()) or 0 <= kv_max < int(kv_lens.max()):
        check_query_lengths(attn, tokens, q_lens, starts, kv_lens)
    if host is not None and not torch.equal(host, kv_lens):  # any dtypes
        _host_lengths_differ(host, kv_lens)


def _host_lengths_differ(host: torch.Tensor, kv_lens: torch.Tensor) -> None:
    row = int((host != kv_lens).nonzero()[0])
    raise InputError(
        f"sequence {row} has kv_seqlens_cpu={int(host[row])} but kv_seqlens={int(kv_lens[row])}; kernels "
        "that take host lengths (Ascend) would use the first. Build both from the same lengths"
    )


def _check_kv_holds_q(q_lens: list[int], kv_lens: list[int], prefix: str, writes: list[bool] | None = None) -> None:
    """Refuse a row holding fewer KV tokens than its new ones, but a padding
    row's 0 (``writes``: which rows write the cache; one writing nothing may
    hold none, as vLLM pads)."""
    for row, (count, length) in enumerate(zip(q_lens, kv_lens)):
        if length < count and not (length == 0 and writes is not None and not writes[row]):
            raise InputError(
                f"{prefix}sequence {row} has kv_seqlens={length}, below {count} (its new tokens): a sequence "
                "holds at least this step's tokens; pass its cached tokens plus this step's"
            )


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


def _first(bad: torch.Tensor, message: Any, prefix: str = "debug mode: ") -> None:
    """Raise InputError(message(row)) for the first row where ``bad`` holds."""
    if bad.any():
        raise InputError(prefix + message(int(bad.nonzero()[0])))


def _bad(row: torch.Tensor, mask: torch.Tensor) -> int:
    return int(row[mask][0])

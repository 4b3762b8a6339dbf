"""Always-on checks of a step's lengths from host values: the host copies
of its query and KV lengths against each other and against its maxima.

They cost no synchronisation where the values are host tensors (a step built
on the host, ``kv_seqlens_cpu``), so they run without debug mode; debug mode
(``graphmode.checks.debug``) runs the same checks on every graph step's
device values, read to the host in one copy.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmode.context import AttnMetadata
from graphmode.errors import InputError

__all__ = ["check_device_verify_step", "check_host_kv_lengths", "check_kv_holds_q", "check_kv_max_holds_host", "check_piecewise_step", "check_query_lengths",
           "check_uniform_step", "first_bad"]


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
        first_bad(q_lens > q_max, lambda r: (
            f"max_q_seq_len={q_max}, but sequence {r} has q_seqlens={int(q_lens[r])}: the maximum understates the "
            f"step's query lengths, so its {tokens} tokens for {batch} sequences (batch x max_q_seq_len) passed as "
            f"a decode step of {q_len} token(s) per sequence, whose graph replays {q_len} for every sequence "
            "while eager steps read the real lengths. Pass the step's real max_q_seq_len (the largest q_seqlens, "
            f"{int(q_lens.max())}): a step of unequal query lengths then runs eagerly (piecewise in "
            "execute_mode='full_and_piecewise')"), prefix)
    first_bad(q_lens != q_len, lambda r: (
        f"sequence {r} (row {r}) has q_seqlens={int(q_lens[r])}, but this graph decode step has "
        f"{q_len} new token(s) per sequence ({tokens} tokens for {batch} sequences, "
        f"max_q_seq_len={attn.max_q_seq_len}); pass the step's real q_seqlens and "
        "max_q_seq_len (a step of unequal query lengths runs eagerly), or is_decoding=False"), prefix)
    first_bad(q_starts != rows * q_len, lambda r: (
        f"sequence {r} has q_start_loc={int(q_starts[r])}; in a decode step of {q_len} token(s) per "
        f"sequence, sequence {r}'s tokens start at token {r * q_len}: q_start_loc must be "
        f"arange(batch) x {q_len}"), prefix)


def check_host_kv_lengths(attn: AttnMetadata, batch: int, tokens: int, kv_lens: torch.Tensor) -> None:
    """Refuse a device-built verify step that its host kv lengths prove is
    not uniform: host facts read ``tokens == batch x max_q_seq_len`` as
    ``q_len`` new tokens in every sequence, but a sequence's KV length counts
    its new tokens, so one whose ``kv_seqlens_cpu`` is below ``q_len`` (a
    padding row of kv length 0 among them) adds fewer, and another must add
    more than the maximum. No device value is read: ``FullGraphs.run`` calls
    this for verify steps whose query lengths are device values, where the
    host holds ``kv_seqlens_cpu`` (the engine's, or Ascend's derived copy).
    A step whose every host kv length is at least ``q_len`` (any sequence
    with a cached prefix) is not told apart on the host: debug mode's."""
    q_len = tokens // batch
    if int(kv_lens.min()) >= q_len:
        return
    row = int((kv_lens < q_len).nonzero()[0])
    kv = int(kv_lens[row])
    raise InputError(
        f"max_q_seq_len={attn.max_q_seq_len}, but sequence {row} has kv_seqlens_cpu={kv}: a sequence's KV length "
        f"counts this step's new tokens, so it adds at most {kv}, and the step's {tokens} tokens for {batch} "
        f"sequences (batch x max_q_seq_len) need another sequence to add more than {q_len}: the maximum "
        f"understates the step's query lengths (or kv_seqlens_cpu is not the step's), and its graph would replay "
        f"{q_len} tokens for every sequence while eager steps read the real lengths. Pass the step's real "
        "max_q_seq_len (the largest q_seqlens): a step of unequal query lengths then runs eagerly (piecewise in "
        "execute_mode='full_and_piecewise')"
    )


def check_device_verify_step(attn: AttnMetadata, batch: int, tokens: int) -> None:
    """:func:`check_uniform_step` for a device-built verify step that its
    host facts cannot prove uniform (tokens equal to batch x
    ``max_q_seq_len``, and no host kv length below it): its ``q_seqlens``
    and ``q_start_loc`` read to the host in one device-to-host copy, a
    synchronisation. [3, 1] and [2, 2] under ``max_q_seq_len=2`` look the
    same from the host, and the graph of 2 tokens per sequence replayed the
    first silently (0.04 to 0.37 off eager, issue 40); one read per verify
    step is the price of never replaying it (``FullGraphs.run`` counts it in
    ``runner.stats.verify_length_reads``: a step built on the host costs
    none)."""
    q_lens, q_starts = attn.q_seqlens, attn.q_start_loc
    both = torch.cat((q_lens.long(), q_starts.long())).cpu()
    check_uniform_step(attn, batch, tokens, both[:batch], both[batch:])


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
    check_kv_holds_q(q, kv, prefix, writes)


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
    check_kv_max_holds_host(attn, on_host)
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


def check_kv_max_holds_host(attn: AttnMetadata, on_host: bool) -> None:
    """Refuse a known ``max_kv_seq_len`` below the host lengths
    ``kv_seqlens_cpu``, the one reduction of host values it takes: the step's
    kernels would disagree with the step. Eagerly and at piecewise break
    points the kernels get the step's maximum (Camb's decode kernel clamps
    the lengths it reads to it, PPU's refuses them); a full graph's context
    has its own, so its replay read the whole lengths while eager clamped
    them: graph != eager, silently. Where the step was built on the host
    (``on_host``) and ``kv_seqlens`` is within the maximum, the host copy is
    the one that is wrong, and is named instead. A step built on the host
    without ``kv_seqlens_cpu`` has its lengths on the host already:
    ``kv_seqlens`` is read instead (a batch of values, no synchronisation)."""
    kv_max, kv_lens = attn.max_kv_seq_len, attn.kv_seqlens
    host, field = attn.kv_seqlens_cpu, "kv_seqlens_cpu"
    if host is None and on_host:
        host, field = kv_lens, "kv_seqlens"
    if host is None or kv_max < 0 or int(host.max()) <= kv_max:
        return
    if on_host and host is not kv_lens and not torch.equal(host, kv_lens) and int(kv_lens.max()) <= kv_max:
        _host_lengths_differ(host, kv_lens)  # the maximum is right: the host lengths are not
    row = int((host > kv_max).nonzero()[0])
    said = (f"max_kv_seq_len={kv_max}, but attn_metadata.kv_seqlens_cpu holds {int(host[row])} (sequence {row})"
            if field == "kv_seqlens_cpu" else
            f"sequence {row} has kv_seqlens={int(host[row])}, above max_kv_seq_len={kv_max}")
    raise InputError(
        f"{said}: "
        "kernels that size their work by the maximum (Camb, PPU, FlashAttention's max_seqlen_k) would read "
        "part of that sequence's cache, where a graph's own maximum reads all of it. Pass the step's real "
        "max_kv_seq_len (the largest kv_seqlens), or -1" + (
            "; or, if max_kv_seq_len is right, kv_seqlens_cpu is not the host copy of kv_seqlens: build both from "
            "the same lengths" if field == "kv_seqlens_cpu" else "")
    )


def _host_lengths_differ(host: torch.Tensor, kv_lens: torch.Tensor) -> None:
    row = int((host != kv_lens).nonzero()[0])
    raise InputError(
        f"sequence {row} has kv_seqlens_cpu={int(host[row])} but kv_seqlens={int(kv_lens[row])}; kernels "
        "that take host lengths (Ascend) would use the first. Build both from the same lengths"
    )


def check_kv_holds_q(q_lens: list[int], kv_lens: list[int], prefix: str, writes: list[bool] | None = None) -> None:
    """Refuse a row holding fewer KV tokens than its new ones, but a padding
    row's 0 (``writes``: which rows write the cache; one writing nothing may
    hold none, as vLLM pads)."""
    for row, (count, length) in enumerate(zip(q_lens, kv_lens)):
        if length < count and not (length == 0 and writes is not None and not writes[row]):
            raise InputError(
                f"{prefix}sequence {row} has kv_seqlens={length}, below {count} (its new tokens): a sequence "
                "holds at least this step's tokens; pass its cached tokens plus this step's"
            )


def first_bad(bad: torch.Tensor, message: Any, prefix: str = "debug mode: ") -> None:
    """Raise InputError(message(row)) for the first row where ``bad`` holds."""
    if bad.any():
        raise InputError(prefix + message(int(bad.nonzero()[0])))

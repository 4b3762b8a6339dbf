"""ReferenceEngine: schedules sequences over a paged KV cache and builds each
step's inputs, the way a serving engine does.

It drives the reference model in tests, the conformance suite and the
benchmark: it allocates blocks (never block 0, which is reserved for padding),
frees them when a sequence finishes so that others reuse them, and knows which
cache slots each step writes and which slots live sequences own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from graphmode.context import AttnMetadata, StepInputs
from graphmode.emulator.host import is_host, mark_host
from graphmode.staging import to_host

__all__ = ["ReferenceEngine", "Sequence", "pad_step", "with_padding_rows"]


@dataclass
class Sequence:
    seq_id: int
    blocks: list[int] = field(default_factory=list)
    kv_len: int = 0


class ReferenceEngine:
    """num_cache_blocks: blocks in the KV cache, block 0 included (reserved).
    table_width: columns of every block table (the runner's max_blocks_per_seq);
    None sizes each step's table to its longest sequence.
    host_inputs: build each step's tensors on the host, as engines that
    schedule on the CPU do (marked as host memory on the emulator)."""

    def __init__(
        self,
        num_cache_blocks: int,
        block_size: int,
        device: torch.device | str,
        *,
        vocab_size: int,
        table_width: int | None = None,
        seed: int = 0,
        host_inputs: bool = False,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.table_width = table_width
        self.host_inputs = host_inputs
        self.rng = random.Random(seed)
        # Blocks in random order, so that block tables are not sorted.
        self.free_blocks = list(range(1, num_cache_blocks))
        self.rng.shuffle(self.free_blocks)
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self.step_slots: list[int] = []

    # -- sequences ----------------------------------------------------------

    def add(self) -> int:
        seq = Sequence(self._next_id)
        self._next_id += 1
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    def finish(self, seq_id: int) -> None:
        """Drop a sequence; its blocks go back to the front of the free list,
        so the next sequence reuses them."""
        seq = self.sequences.pop(seq_id)
        self.free_blocks.extend(reversed(seq.blocks))

    def rollback(self, seq_id: int, tokens: int) -> None:
        """Take back a sequence's last ``tokens`` tokens (the drafts a
        speculative verify step rejected): its cache length shrinks, and
        blocks left holding none of its tokens go back to the free list. The
        slots keep the rejected keys and values until a later token is
        written there."""
        seq = self.sequences[seq_id]
        if not 0 <= tokens <= seq.kv_len:
            raise ValueError(f"rollback of {tokens} tokens: sequence {seq_id} holds {seq.kv_len}")
        seq.kv_len -= tokens
        keep = -(-seq.kv_len // self.block_size)
        self.free_blocks.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]

    def live(self) -> list[int]:
        return list(self.sequences)

    def owned_slots(self) -> list[int]:
        """Every cache slot holding a token of a live sequence."""
        return [
            seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size
            for seq in self.sequences.values()
            for pos in range(seq.kv_len)
        ]

    def _slot_for_next_token(self, seq: Sequence) -> int:
        if seq.kv_len == len(seq.blocks) * self.block_size:
            if not self.free_blocks:
                raise RuntimeError("the reference engine ran out of KV-cache blocks")
            seq.blocks.append(self.free_blocks.pop())
        slot = seq.blocks[seq.kv_len // self.block_size] * self.block_size + seq.kv_len % self.block_size
        seq.kv_len += 1
        return slot

    # -- steps --------------------------------------------------------------

    def prefill(self, seq_ids: list[int], lengths: list[int]) -> StepInputs:
        """A prefill (or chunked-prefill) step adding ``lengths[i]`` tokens to
        each sequence."""
        return self._step(seq_ids, lengths, is_decoding=False)

    def decode(self, seq_ids: list[int], q_len: int | list[int] = 1) -> StepInputs:
        """A decode step: ``q_len`` new tokens per sequence (1; more in a
        speculative verify or MTP step), or ``q_len[i]`` for sequence i."""
        lengths = list(q_len) if isinstance(q_len, list) else [q_len] * len(seq_ids)
        return self._step(seq_ids, lengths, is_decoding=True)

    def _step(self, seq_ids: list[int], lengths: list[int], is_decoding: bool) -> StepInputs:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        for seq_id, length in zip(seq_ids, lengths):
            seq = self.sequences[seq_id]
            starts.append(len(tokens))
            for _ in range(length):
                positions.append(seq.kv_len)
                slots.append(self._slot_for_next_token(seq))
                tokens.append(self.rng.randrange(self.vocab_size))
        seqs = [self.sequences[s] for s in seq_ids]
        width = self.table_width or max(len(s.blocks) for s in seqs)
        table = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        kv_lens = [s.kv_len for s in seqs]
        self.step_slots = slots
        device, int32 = self.device, torch.int32
        attn = AttnMetadata(
            is_decoding=is_decoding,
            block_offsets=torch.tensor(table, dtype=int32, device=device),
            q_start_loc=torch.tensor(starts, dtype=int32, device=device),
            q_seqlens=torch.tensor(lengths, dtype=int32, device=device),
            kv_seqlens=torch.tensor(kv_lens, dtype=int32, device=device),
            kv_start_indices=torch.tensor(slots, dtype=torch.int64, device=device),
            max_q_seq_len=max(lengths),
            max_kv_seq_len=max(kv_lens),
            # Host memory, on the emulator too (where every tensor is a CPU tensor).
            kv_seqlens_cpu=mark_host(torch.tensor(kv_lens, dtype=int32)),
        )
        ids = torch.tensor([tokens], dtype=torch.int64, device=device)
        pos = torch.tensor([positions], dtype=torch.int64, device=device)
        step = StepInputs(ids, pos, None, attn)
        return to_host(step, device) if self.host_inputs else step


def pad_step(step: StepInputs, bucket: int) -> StepInputs:
    """The decode step with inert rows appended up to ``bucket`` (token 0,
    slot -1, the reserved block, length 1), as graph mode pads it: running
    eager on it runs the same shapes as the bucket's graph."""
    attn = step.attn_metadata
    extra = bucket - attn.batch_size
    if extra == 0:
        return step

    def grow(tensor: torch.Tensor, value: int) -> torch.Tensor:
        pad = torch.full((extra, *tensor.shape[1:]), value, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, pad])

    padded = attn.replace(
        block_offsets=grow(attn.block_offsets, 0),
        q_start_loc=torch.arange(bucket, dtype=attn.q_start_loc.dtype, device=attn.q_start_loc.device),
        q_seqlens=grow(attn.q_seqlens, 1),
        kv_seqlens=grow(attn.kv_seqlens, 1),
        kv_start_indices=grow(attn.kv_start_indices, -1),
        kv_seqlens_cpu=grow(attn.kv_seqlens_cpu, 1) if attn.kv_seqlens_cpu is not None else None,
    )
    ids = grow(step.input_ids[0], 0)[None]
    positions = grow(step.position_ids[0], 0)[None]
    return StepInputs(ids, positions, step.past_key_values, padded, step.extras)


def with_padding_rows(step: StepInputs, rows: list[int]) -> StepInputs:
    """The step with padding rows of no new token inserted so that they sit
    at indices ``rows`` of the result, as vLLM pads ``seq_lens`` with 0: no
    token, no slot, ``kv_seqlens`` 0 and a block table of the reserved block
    0, ``q_start_loc`` where the next sequence's tokens start. Tokens, ids,
    positions and slots are the step's own; the maxima stay valid."""
    attn = step.attn_metadata
    batch = attn.batch_size + len(rows)
    padding = set(rows)
    if not all(0 <= row < batch for row in padding) or len(padding) != len(rows):
        raise ValueError(f"padding rows {rows} must be distinct indices in 0..{batch - 1}")
    live = [row for row in range(batch) if row not in padding]
    on_host = is_host(attn.q_seqlens)  # a host-built step's (on the emulator): its new rows are host memory too

    def spread(tensor: torch.Tensor, host: bool = on_host) -> torch.Tensor:
        grown = torch.zeros((batch, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        grown[torch.tensor(live, dtype=torch.long, device=tensor.device)] = tensor
        return mark_host(grown) if host else grown

    q_lens = spread(attn.q_seqlens)
    starts = torch.cumsum(q_lens, 0, dtype=attn.q_start_loc.dtype) - q_lens  # exclusive: a padding row starts where the next does
    host = attn.kv_seqlens_cpu
    padded = attn.replace(
        block_offsets=spread(attn.block_offsets), q_start_loc=mark_host(starts) if on_host else starts, q_seqlens=q_lens,
        kv_seqlens=spread(attn.kv_seqlens), kv_seqlens_cpu=spread(host, True) if host is not None else None,
    )
    return StepInputs(step.input_ids, step.position_ids, step.past_key_values, padded, step.extras)

"""The CUDA plugin's prefill attention through PyTorch's SDPA equals the
reference prefill attention: whole prompts, chunks after cached tokens,
one-token sequences of a mixed step, sequences grouped by shape, block
tables padded with the reserved block. Run on the CPU (SDPA's CPU kernels
and the reference decode kernel); on CUDA the same code takes the fused
kernels."""

from __future__ import annotations

import random

import pytest
import torch

from graphmode.context import AttnMetadata
from graphmode.kernels.sdpa_prefill import sdpa_prefill
from graphmode.model.ops import ReferenceAttentionOps

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def prefill_case(shapes: list[tuple[int, int]], seed: int = 0):
    """Queries, a random paged cache and the metadata of one step whose
    sequences have ``(cached tokens before the step, new tokens)``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needs = [-(-(context + new) // BLOCK) for context, new in shapes]
    width = max(needs) + 1  # one column of reserved block 0 at least
    blocks = list(range(1, sum(needs) + 1))
    rng.shuffle(blocks)
    tables, slots, starts = [], [], []
    for need, (context, new) in zip(needs, shapes):
        table, blocks = blocks[:need], blocks[need:]
        starts.append(len(slots))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context, context + new)]
        tables.append(table + [0] * (width - need))
    cache = [torch.randn(sum(needs) + 1, BLOCK, KV_HEADS, DIM) for _ in range(2)]
    int32 = torch.int32
    kv = [context + new for context, new in shapes]
    attn = AttnMetadata(
        is_decoding=False,
        block_offsets=torch.tensor(tables, dtype=int32),
        q_start_loc=torch.tensor(starts, dtype=int32),
        q_seqlens=torch.tensor([new for _, new in shapes], dtype=int32),
        kv_seqlens=torch.tensor(kv, dtype=int32),
        kv_start_indices=torch.tensor(slots, dtype=torch.int64),
        max_q_seq_len=max(new for _, new in shapes),
        max_kv_seq_len=max(kv),
    )
    query = torch.randn(len(slots), HEADS, DIM)
    return query, cache, attn


@pytest.mark.parametrize(
    "shapes",
    [
        [(0, 9)],  # one prompt
        [(0, 5), (0, 5), (0, 7)],  # a group of two equal prompts and another
        [(6, 5)],  # a chunk after 6 cached tokens (bottom-right causal)
        [(9, 1), (0, 6), (3, 1), (0, 1), (5, 4)],  # mixed: decodes, a prompt, a chunk
        [(2, 1), (7, 1)],  # decodes only (a verify-free mixed step)
    ],
)
def test_sdpa_prefill_equals_the_reference_prefill(shapes):
    query, (k_cache, v_cache), attn = prefill_case(shapes)
    ops = ReferenceAttentionOps()
    expected = ops.prefill_attention(query, k_cache, v_cache, attn, DIM**-0.5)
    got = sdpa_prefill(ops, query, k_cache, v_cache, attn, DIM**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sdpa_prefill_refuses_lengths_that_miss_this_steps_tokens():
    query, (k_cache, v_cache), attn = prefill_case([(0, 6)])
    bad = attn.replace(kv_seqlens=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="adds 6 tokens but kv_seqlens is 4"):
        sdpa_prefill(ReferenceAttentionOps(), query, k_cache, v_cache, bad, DIM**-0.5)


def test_sdpa_prefill_writes_into_out_and_zeroes_rows_no_sequence_owns():
    query, (k_cache, v_cache), attn = prefill_case([(9, 1), (0, 6), (5, 4)])
    ops = ReferenceAttentionOps()
    expected = ops.prefill_attention(query, k_cache, v_cache, attn, DIM**-0.5)
    out = torch.full_like(query, float("nan"))
    assert sdpa_prefill(ops, query, k_cache, v_cache, attn, DIM**-0.5, out) is out
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Two more query rows than the sequences own: those rows come back zero.
    padded = torch.cat([query, torch.randn(2, HEADS, DIM)])
    out = torch.full_like(padded, float("nan"))
    sdpa_prefill(ops, padded, k_cache, v_cache, attn, DIM**-0.5, out)
    torch.testing.assert_close(out[: len(query)], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[len(query):], torch.zeros(2, HEADS, DIM))
    with pytest.raises(ValueError, match="out must match"):
        sdpa_prefill(ops, query, k_cache, v_cache, attn, DIM**-0.5, out[:3])

"""The Triton prefill kernel (the CUDA plugin's prefill and mixed-step
attention) equals the reference prefill attention: whole prompts, chunks
after cached tokens, one-token sequences of a mixed step, block tables
padded with the reserved block, rows no sequence owns, GQA groups that are
not a power of two.

On CUDA with Triton the cases run on the GPU in bfloat16 and float32; with
Triton but no GPU they run in Triton's interpreter (float32 and float16) in
a process started with TRITON_INTERPRET=1; CI has neither and skips them.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import hangs
import pytest
import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.context import AttnMetadata
from graphmode.kernels.triton_decode import triton_available

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs a CUDA device and Triton")
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def prefill_case(shapes: list[tuple[int, int]], seed: int = 0, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 dim: int = DIM, block: int = BLOCK):
    """Queries, a random paged cache and the metadata of one step whose
    sequences have ``(cached tokens before the step, new tokens)``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needs = [-(-(context + new) // block) for context, new in shapes]
    width = max(needs) + 1  # one column of reserved block 0 at least
    blocks = list(range(1, sum(needs) + 1))
    rng.shuffle(blocks)
    tables, slots, starts = [], [], []
    for need, (context, new) in zip(needs, shapes):
        table, blocks = blocks[:need], blocks[need:]
        starts.append(len(slots))
        slots += [table[p // block] * block + p % block for p in range(context, context + new)]
        tables.append(table + [0] * (width - need))
    cache = [torch.randn(sum(needs) + 1, block, kv_heads, dim) for _ in range(2)]
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
    query = torch.randn(len(slots), heads, dim)
    return query, cache, attn




CASES = [
    [(0, 9)],  # one prompt
    [(0, 5), (0, 5), (0, 7)],  # prompts back to back
    [(6, 5)],  # a chunk after 6 cached tokens (bottom-right causal)
    [(9, 1), (0, 6), (3, 1), (0, 1), (5, 4)],  # mixed: decodes, a prompt, a chunk
    [(2, 1), (7, 1)],  # decodes only
    [(0, 70), (100, 33)],  # longer than a block of keys (64) and of tokens
]
# (heads, kv_heads, dim, block size): GQA groups of 2, 4 and 7 (not a power of two), MHA, head dims 16, 64, 80
# and 128 (on Hopper, 16-bit and one head per program: head dims 64 and 128 through tensor descriptors).
SHAPES = [(4, 2, 16, 4), (14, 2, 64, 16), (8, 8, 80, 64), (8, 2, 128, 32)]


def check(shapes, shape, dtype, device, padding=0, max_q=None, seed=0) -> None:
    from graphmode.kernels.triton_prefill import paged_prefill

    heads, kv_heads, dim, block = shape
    query, (k_cache, v_cache), attn = prefill_case(shapes, seed, heads, kv_heads, dim, block)
    expected = ReferenceAttentionOps().prefill_attention(query, k_cache, v_cache, attn, dim**-0.5)
    padded = torch.cat([query, torch.randn(padding, heads, dim)])
    out = torch.full_like(padded, float("nan")).to(device, dtype)
    to = lambda t: t.to(device)  # noqa: E731
    got = paged_prefill(padded.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                        to(attn.block_offsets), to(attn.q_start_loc), to(attn.q_seqlens), to(attn.kv_seqlens),
                        attn.max_q_seq_len if max_q is None else max_q, dim**-0.5, out)
    assert got is out
    tolerance = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out[: len(query)].float().cpu(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(out[len(query):].float().cpu(), torch.zeros(padding, heads, dim)), "rows no sequence owns"


def check_all(device, dtypes) -> None:
    for dtype in dtypes:
        for shape in SHAPES:
            for index, shapes in enumerate(CASES):
                check(shapes, shape, dtype, device, padding=index % 3, seed=index)
        # max_q_seq_len not known (-1): the token count bounds the grid
        check(CASES[3], SHAPES[1], dtype, device, padding=2, max_q=-1)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_kernel_equals_the_reference_on_cuda(dtype):
    check_all("cuda", [dtype])


@gpu
@pytest.mark.parametrize("descriptors", [True, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("per_program", [None, 1, 2])
def test_every_grouping_of_query_heads_equals_the_reference_on_cuda(monkeypatch, per_program, descriptors):
    """One, two or all query heads of a KV head per program; 16 rows per
    program, so that the short cases take the chosen grouping too. One head
    per program reads through tensor descriptors on Hopper where the shapes
    allow (16-bit, head dim and page a power of two from 16), and through
    pointers otherwise or with descriptors off."""
    from graphmode.kernels import triton_prefill

    monkeypatch.setattr(triton_prefill, "ROWS", 16)
    monkeypatch.setattr(triton_prefill, "HEADS_PER_PROGRAM", per_program)
    monkeypatch.setattr(triton_prefill, "TENSOR_DESCRIPTORS", descriptors)
    monkeypatch.setattr(triton_prefill, "DESC_ROWS", 16)
    monkeypatch.setattr(triton_prefill, "DESC_MIN_TOKENS", 0)
    check_all("cuda", [torch.bfloat16, torch.float32])


@gpu
@pytest.mark.parametrize("descriptors", [True, False], ids=["descriptors", "pointers"])
def test_slots_past_the_length_and_the_reserved_block_are_never_read(monkeypatch, descriptors):
    """NaN in every cache slot a sequence does not own (the rest of its last
    page, block 0): the output is the reference's, NaN-free. Descriptors
    fetch whole pages, so the slots past the length reach the kernel."""
    from graphmode.kernels import triton_prefill
    from graphmode.kernels.triton_prefill import paged_prefill

    monkeypatch.setattr(triton_prefill, "TENSOR_DESCRIPTORS", descriptors)
    monkeypatch.setattr(triton_prefill, "DESC_MIN_TOKENS", 0)
    shapes, (heads, kv_heads, dim, block) = [(0, 150), (37, 200), (5, 1)], (14, 2, 64, 64)
    query, (k_cache, v_cache), attn = prefill_case(shapes, 3, heads, kv_heads, dim, block)
    expected = ReferenceAttentionOps().prefill_attention(query, k_cache, v_cache, attn, dim**-0.5)
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for row, kv_len in zip(attn.block_offsets.tolist(), attn.kv_seqlens.tolist()):
        for position in range(kv_len):
            owned[row[position // block], position % block] = True
    for cache in (k_cache, v_cache):
        cache[~owned] = float("nan")
    cuda = [t.to("cuda") for t in (attn.block_offsets, attn.q_start_loc, attn.q_seqlens, attn.kv_seqlens)]
    query, k_cache, v_cache = (t.to("cuda", torch.bfloat16) for t in (query, k_cache, v_cache))
    if descriptors and torch.cuda.get_device_capability()[0] >= 9:
        assert triton_prefill._descriptors_fit(query, k_cache, v_cache), "the descriptor path is tested"
    out = paged_prefill(query, k_cache, v_cache, *cuda, attn.max_q_seq_len, dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


@gpu
def test_prefill_kernel_at_bench_shapes_on_cuda():
    """The bench model's heads (14 over 2 KV heads, head dim 64) and block
    size 64, 2048-token prompts beside chunks and decodes: over
    DESC_MIN_TOKENS tokens, so tensor descriptors on Hopper."""
    from graphmode.kernels.triton_prefill import DESC_MIN_TOKENS

    shapes = [(0, 2048), (0, 2000), (1000, 512), (4000, 1), (0, 128)]
    assert sum(new for _, new in shapes) >= DESC_MIN_TOKENS
    check(shapes, (14, 2, 64, 64), torch.bfloat16, "cuda", padding=5)


def interpreter_check() -> None:
    """Run in a process started with TRITON_INTERPRET=1 (below); the
    interpreter mishandles bfloat16 products, so float32 and float16."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_all("cpu", [torch.float32, torch.float16])


def _interpreter_works() -> bool:
    from test_triton_kernel import _interpreter_works as works

    return works()


@pytest.mark.skipif(CUDA or not _interpreter_works(), reason="needs Triton's interpreter and no GPU (the GPU runs the cases)")
def test_prefill_kernel_equals_the_reference_in_the_triton_interpreter():
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           "import test_triton_prefill as t; t.interpreter_check(); print('interpreter ok')"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = hangs.run([sys.executable, "-c", code], ci_seconds=60, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "interpreter ok" in done.stdout, done.stderr[-3000:]


def test_the_prefill_ops_off_cuda_are_the_reference_prefill(monkeypatch):
    """Without the interpreter, CPU tensors take the reference kernel, into
    ``out`` when given."""
    from graphmode.kernels.triton_decode import TritonAttentionOps

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    query, (k_cache, v_cache), attn = prefill_case(CASES[3])
    expected = ReferenceAttentionOps().prefill_attention(query, k_cache, v_cache, attn, DIM**-0.5)
    out = torch.empty_like(query)
    assert TritonAttentionOps().prefill_attention(query, k_cache, v_cache, attn, DIM**-0.5, out) is out
    assert torch.equal(out, expected)

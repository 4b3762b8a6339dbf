"""The Triton paged-decode kernel against the reference kernel.

Kernel tests run on CUDA with Triton and skip elsewhere (CI has neither);
one runs the kernels in Triton's interpreter on the CPU when Triton is
installed. The choice of kernels and the fallback off CUDA run everywhere.

Tolerance, max abs difference from the reference kernel run in float32 on
the same (upcast) inputs, values and queries drawn from N(0, 1):
bfloat16 2e-2, float16 4e-3, float32 1e-4 (the kernel rounds its output,
and the softmax weights before the product with V, to the input dtype).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hangs
import pytest
import torch

import graphmode
from graphmode.attention import ReferenceAttentionOps, write_slots
from graphmode.context import AttnMetadata
from graphmode.kernels import cuda_attention_ops
from graphmode.kernels.triton_decode import TritonAttentionOps, triton_available
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs a CUDA device and Triton")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def make_case(batch, heads, kv_heads, dim, block_size, width, lengths, dtype, device, padding=0, seed=0):
    """Random caches, queries and distinct random block tables for ``batch``
    sequences of ``lengths``, then ``padding`` rows as graph mode pads them
    (the reserved block 0, length 1)."""
    generator = torch.Generator().manual_seed(seed)
    rows = batch + padding
    num_blocks = batch * width + 1
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    table = torch.zeros((rows, width), dtype=torch.int32)
    table[:batch] = (torch.randperm(num_blocks - 1, generator=generator)[: batch * width] + 1).view(batch, width)
    lens = torch.ones(rows, dtype=torch.int32)
    lens[:batch] = torch.as_tensor(lengths, dtype=torch.int32)
    query = torch.randn((rows, heads, dim), generator=generator).to(device=device, dtype=dtype)
    return query, k_cache, v_cache, table.to(device), lens.to(device)


def lengths_of(kind: str, batch: int, block_size: int, capacity: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    if kind == "one":
        return [1] * batch
    if kind == "block":
        return [block_size] * batch
    if kind == "full":
        return [capacity] * batch
    if kind == "odd":
        return [int(x) * 2 + 1 for x in torch.randint(0, capacity // 2, (batch,), generator=generator)]
    if kind == "random":
        return [int(x) for x in torch.randint(1, capacity + 1, (batch,), generator=generator)]
    raise ValueError(kind)


def reference(query, k_cache, v_cache, table, lens, scale):
    """The reference kernel in float32 on the same inputs."""
    rows = query.shape[0]
    attn = AttnMetadata(True, table, torch.arange(rows, dtype=torch.int32, device=query.device),
                        torch.ones(rows, dtype=torch.int32, device=query.device), lens,
                        torch.full((rows,), -1, dtype=torch.int64, device=query.device), 1, -1)
    return ReferenceAttentionOps().paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), attn, scale)


def check_against_reference(case, dtype, label) -> float:
    from graphmode.kernels.triton_decode import paged_decode

    query, k_cache, v_cache, table, lens = case
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))  # poison: every element must be written
    out.copy_(paged_decode(query, k_cache, v_cache, table, lens, scale))
    expected = reference(query, k_cache, v_cache, table, lens, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert not out.isnan().any(), f"{label}: NaN in the output"
    diff = (out.float() - expected).abs().max().item()
    assert diff <= TOLERANCE[dtype], f"{label}: max abs diff {diff:.3g} > {TOLERANCE[dtype]:.3g}"
    return diff


# -- on CUDA -----------------------------------------------------------------


@gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_bf16_matches_reference_for_every_length_pattern_and_batch(ratio, dim, block_size):
    heads, width = 8, 512 // block_size
    for batch in (1, 5, 64, 256):
        for kind in ("one", "block", "odd", "full", "random"):
            lengths = lengths_of(kind, batch, block_size, width * block_size, seed=batch)
            case = make_case(batch, heads, heads // ratio, dim, block_size, width, lengths, torch.bfloat16,
                             "cuda", padding=3, seed=batch)
            check_against_reference(case, torch.bfloat16, f"GQA {ratio}, D {dim}, bs {block_size}, B {batch}, {kind}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_match_reference(dtype):
    for batch in (1, 37):
        lengths = lengths_of("random", batch, 16, 16 * 40, seed=batch)
        case = make_case(batch, 16, 4, 128, 16, 40, lengths, dtype, "cuda", padding=2, seed=batch)
        check_against_reference(case, dtype, f"{dtype}, B {batch}")


@gpu
@pytest.mark.parametrize("splits", ["one partition", "several partitions"])
def test_the_reserved_block_is_never_read(splits):
    """NaN in block 0: live rows match the reference and padding rows (whose
    table is all block 0) are zeros, with one partition and with several."""
    from graphmode.kernels.triton_decode import paged_decode

    width = 2 if splits == "one partition" else 40
    lengths = lengths_of("random", 5, 16, 16 * width, seed=3)
    query, k_cache, v_cache, table, lens = make_case(5, 8, 2, 64, 16, width, lengths, torch.bfloat16, "cuda", padding=3)
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    out = paged_decode(query, k_cache, v_cache, table, lens, 0.125)
    expected = reference(query, k_cache, v_cache, table, lens, 0.125)
    assert not out.isnan().any()
    assert out[5:].eq(0).all(), "padding rows must read nothing"
    assert (out[:5].float() - expected[:5]).abs().max().item() <= TOLERANCE[torch.bfloat16]


@gpu
def test_bench_shapes_match_reference():
    """The bench model's attention: 14 query heads on 2 KV heads (a group of
    7, not a power of two), head dim 64, block size 64."""
    for batch in (1, 8, 64, 256):
        lengths = lengths_of("random", batch, 64, 17 * 64, seed=batch)
        case = make_case(batch, 14, 2, 64, 64, 17, lengths, torch.bfloat16, "cuda", seed=batch)
        check_against_reference(case, torch.bfloat16, f"bench shapes, B {batch}")


@gpu
@pytest.mark.parametrize("kind", ["one", "random", "full"])
def test_more_partitions_than_one_merge_pass_reads(kind):
    """Batch 1 on one KV head with a 4096-token table: more partitions than
    the merge kernel reads at a time, so it merges them in several passes."""
    from graphmode.kernels.triton_decode import MERGE_CHUNK, num_partitions

    partitions = num_partitions(2, 1, 64 * 64, torch.device("cuda"))
    assert partitions > MERGE_CHUNK
    lengths = lengths_of(kind, 1, 64, 64 * 64, seed=3)
    case = make_case(1, 8, 1, 128, 64, 64, lengths, torch.bfloat16, "cuda", padding=1, seed=3)
    check_against_reference(case, torch.bfloat16, f"{kind} lengths over {partitions} partitions")


@gpu
def test_zero_length_gives_zeros_and_lengths_past_the_table_read_the_table():
    from graphmode.kernels.triton_decode import paged_decode

    query, k_cache, v_cache, table, lens = make_case(4, 8, 2, 64, 16, 4, [0, 5, 64, 64], torch.bfloat16, "cuda")
    out = paged_decode(query, k_cache, v_cache, table, lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    past = lens.clone()
    past[3] = 1000  # the table holds 64
    torch.testing.assert_close(paged_decode(query, k_cache, v_cache, table, past, 0.125)[3], out[3], rtol=0, atol=0)


@gpu
def test_captured_graph_reads_new_tables_and_lengths_at_replay():
    """The kernel in a CUDA graph: captured once, replayed on new block
    tables and lengths written into the same buffers, it gives the reference
    result for each (no length is frozen at capture, nothing syncs)."""
    from graphmode.kernels.triton_decode import paged_decode

    batch, width, block_size = 4, 16, 16
    query, k_cache, v_cache, table, lens = make_case(batch, 8, 2, 64, block_size, width, [1, 2, 3, 4],
                                                     torch.bfloat16, "cuda")
    paged_decode(query, k_cache, v_cache, table, lens, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(query, k_cache, v_cache, table, lens, 0.125)
    for seed in range(3):
        lengths = lengths_of("random", batch, block_size, width * block_size, seed=seed)
        _, _, _, new_table, new_lens = make_case(batch, 8, 2, 64, block_size, width, lengths, torch.bfloat16,
                                                 "cuda", seed=seed + 10)
        table.copy_(new_table)
        lens.copy_(new_lens)
        query.normal_()
        graph.replay()
        expected = reference(query, k_cache, v_cache, table, lens, 0.125)
        assert (out.float() - expected).abs().max().item() <= TOLERANCE[torch.bfloat16]


@gpu
def test_kv_write_matches_reference_and_slot_minus_one_writes_nothing():
    from graphmode.kernels.triton_decode import write_kv

    generator = torch.Generator().manual_seed(3)
    k_cache = torch.randn((9, 16, 2, 64), generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn((9, 16, 2, 64), generator=generator).to("cuda", torch.bfloat16)
    qkv = torch.randn((6, 3, 2, 64), generator=generator).to("cuda", torch.bfloat16)
    key, value = qkv[:, 0], qkv[:, 1]  # strided views, as the model's split gives
    slots = torch.tensor([17, -1, 143, 16, -1, 31], device="cuda")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_slots(expected_k, slots, key)
    write_slots(expected_v, slots, value)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@gpu
def test_graph_runner_with_triton_kernels_matches_reference_model():
    """The tiny model (float32) through graphmode's runner with the Triton
    ops, padding rows included, against the same weights eagerly with the
    reference ops."""
    config = ModelConfig.tiny()
    triton_model = build_reference_model(config, device="cuda", ops=TritonAttentionOps())
    reference_model = build_reference_model(config, device="cuda", ops=ReferenceAttentionOps())
    width, block_size = 8, 16
    engine = ReferenceEngine(16 * width + 1, block_size, "cuda", vocab_size=config.vocab_size, table_width=width)
    triton_cache = triton_model.make_kv_cache(16 * width + 1, block_size)
    reference_cache = reference_model.make_kv_cache(16 * width + 1, block_size)
    runner = graphmode.build_graph_runner(triton_model, max_batches=16, max_blocks_per_seq=width, block_size=block_size,
                                          device="cuda", vendor="cuda")
    seqs = [engine.add() for _ in range(11)]
    step = engine.prefill(seqs, [engine.rng.randrange(1, 60) for _ in seqs])
    with torch.inference_mode():
        for model, cache in ((triton_model, triton_cache), (reference_model, reference_cache)):
            model(step.input_ids, step.position_ids, cache, step.attn_metadata)
        for _ in range(4):
            step = engine.decode(seqs)  # 11 sequences in the bucket of 16: 5 padding rows
            graph = runner(step.input_ids, step.position_ids, triton_cache, step.attn_metadata).clone()
            eager = reference_model(step.input_ids, step.position_ids, reference_cache, step.attn_metadata)
            torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4)
    assert runner.stats.replays == 3


# -- in Triton's interpreter, on the CPU ---------------------------------------


def _interpreter_works() -> bool:
    """Triton's interpreter before 3.7 breaks on a loop bound loaded from
    memory with numpy >= 2.4 (``int()`` of a one-element array)."""
    if not triton_available():
        return False
    import numpy
    import triton
    from packaging.version import Version

    return Version(triton.__version__) >= Version("3.7") or Version(numpy.__version__) < Version("2.4")


def interpreter_check() -> None:
    """Run in a process started with TRITON_INTERPRET=1 (see below). The
    interpreter mishandles bfloat16 products, so float16 and float32 only."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype, ratio, dim, block_size, kind, batch in [
        (torch.float32, 1, 64, 16, "random", 2),
        (torch.float16, 4, 128, 16, "odd", 3),
        (torch.float16, 8, 64, 64, "full", 1),
        (torch.float16, 4, 64, 64, "one", 5),
        (torch.float32, 7, 64, 64, "block", 2),
    ]:
        heads = 8 if ratio != 7 else 14
        width = 4
        lengths = lengths_of(kind, batch, block_size, width * block_size, seed=batch)
        case = make_case(batch, heads, heads // ratio, dim, block_size, width, lengths, dtype, "cpu", padding=1)
        check_against_reference(case, dtype, f"interpreter {dtype} GQA {ratio} D {dim} bs {block_size} {kind}")
    ops = TritonAttentionOps()
    generator = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn((5, 16, 2, 64), generator=generator), torch.randn((5, 16, 2, 64), generator=generator)
    key, value = torch.randn((3, 2, 64), generator=generator), torch.randn((3, 2, 64), generator=generator)
    slots = torch.tensor([20, -1, 79])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_slots(expected_k, slots, key)
    write_slots(expected_v, slots, value)
    attn = AttnMetadata(True, torch.zeros((3, 1), dtype=torch.int32), torch.arange(3, dtype=torch.int32),
                        torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), slots, 1, -1)
    ops.fill_kv_cache(key, value, k_cache, v_cache, attn)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.skipif(not _interpreter_works(), reason="needs Triton (>= 3.7 with numpy >= 2.4) for its interpreter")
def test_kernels_match_reference_in_the_triton_interpreter():
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           "import test_triton_kernel as t; t.interpreter_check(); print('interpreter ok')"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = hangs.run([sys.executable, "-c", code], ci_seconds=60, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "interpreter ok" in done.stdout, done.stderr[-3000:]


# -- everywhere ----------------------------------------------------------------


def test_the_kernel_module_imports_without_importing_triton():
    code = ("import sys, torch; before = 'triton' in sys.modules; "
            "import graphmode.kernels.triton_decode, graphmode.default; "
            "graphmode.default.graphmode_attention_ops(); print(before, 'triton' in sys.modules)")
    done = hangs.run([sys.executable, "-c", code], ci_seconds=5, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = done.stdout.split()
    assert after == before, "importing the kernel module, or choosing the ops, imported Triton"


def test_off_cuda_the_triton_ops_are_the_reference_ops(monkeypatch):
    """Without the interpreter, CPU tensors take the reference kernels:
    same results bit for bit, and Triton is not needed."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    query, k_cache, v_cache, table, lens = make_case(3, 8, 2, 64, 16, 4, [5, 64, 17], torch.float32, "cpu")
    attn = AttnMetadata(True, table, torch.arange(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), lens,
                        torch.tensor([3, -1, 40]), 1, -1)
    key = value = torch.randn(3, 2, 64)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = []
    for ops, (k, v) in zip((TritonAttentionOps(), ReferenceAttentionOps()), caches):
        ops.fill_kv_cache(key, value, k, v, attn)
        outs.append(ops.paged_decode_attention(query, k, v, attn, 0.125))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_attention_choice(monkeypatch):
    monkeypatch.delenv("GRAPHMODE_ATTENTION", raising=False)
    assert type(cuda_attention_ops("reference")) is ReferenceAttentionOps
    auto = TritonAttentionOps if (CUDA and triton_available()) else ReferenceAttentionOps
    assert type(cuda_attention_ops()) is auto
    monkeypatch.setenv("GRAPHMODE_ATTENTION", "reference")
    assert type(graphmode.load_vendor("cuda").attention_ops()) is ReferenceAttentionOps
    monkeypatch.setenv("GRAPHMODE_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"attention='flash'.*GRAPHMODE_ATTENTION.*auto, triton, reference"):
        cuda_attention_ops()


@pytest.mark.skipif(triton_available(), reason="Triton is installed here")
def test_forcing_triton_without_triton_says_how_to_get_it():
    with pytest.raises(ValueError, match=r"needs Triton.*pip install triton.*'reference'"):
        cuda_attention_ops("triton")

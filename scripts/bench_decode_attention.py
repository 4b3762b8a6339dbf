"""Time one layer's paged decode attention, Triton kernel against the
reference kernel, at the bench model's shapes (14 query heads, 2 KV heads,
head dim 64, block size 64, bf16, lengths drawn up to 1024, random tables).

Each kernel is captured in a CUDA graph and its replays timed with events
(median of 200), on 8 rotating KV caches larger than L2 together. Prints
the time, the KV bytes read over that time, and the max abs difference of
the Triton result from the reference kernel run in float32.

    python scripts/bench_decode_attention.py [--batches 1,8,64,256]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from graphmode.attention import ReferenceAttentionOps
from graphmode.context import AttnMetadata
from graphmode.devices import require_gpu
from graphmode.kernels.triton_decode import TritonAttentionOps


def time_graph(runs, repeats: int = 200) -> float:
    """Median seconds of one of ``runs``, from replays of a graph capturing
    them all in turn."""
    for run in runs:
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    times = []
    for _ in range(repeats + 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[10:]) / len(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64,256")
    args = parser.parse_args()
    require_gpu(__file__)
    heads, kv_heads, dim, block_size, context = 14, 2, 64, 64, 1024
    width = -(-(context + 64) // block_size)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: paged decode attention, one layer, H {heads}, K {kv_heads}, D {dim}, "
          f"block {block_size}, table width {width}")
    print("batch   tokens  triton us  TB/s   reference us  speed-up  max abs diff")
    for batch in [int(b) for b in args.batches.split(",")]:
        num_blocks = batch * width + 1
        caches = [(torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
                   torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16))
                  for _ in range(8 if batch >= 64 else 1)]
        table = (torch.randperm(num_blocks - 1, device="cuda")[: batch * width] + 1).view(batch, width).int()
        lens = torch.randint(1, context + 1, (batch,), device="cuda", dtype=torch.int32)
        query = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        attn = AttnMetadata(True, table, torch.arange(batch, device="cuda", dtype=torch.int32),
                            torch.ones(batch, device="cuda", dtype=torch.int32), lens,
                            torch.full((batch,), -1, device="cuda"), 1, -1)
        times = {}
        for name, ops in (("triton", TritonAttentionOps()), ("reference", ReferenceAttentionOps())):
            runs = [lambda ops=ops, k=k, v=v: ops.paged_decode_attention(query, k, v, attn, dim ** -0.5)
                    for k, v in caches]
            times[name] = time_graph(runs, repeats=200 if name == "triton" else 20)
        k, v = caches[0]
        out = TritonAttentionOps().paged_decode_attention(query, k, v, attn, dim ** -0.5)
        expected = ReferenceAttentionOps().paged_decode_attention(query.float(), k.float(), v.float(), attn, dim ** -0.5)
        diff = (out.float() - expected).abs().max().item()
        tokens = int(lens.sum())
        kv_bytes = tokens * 2 * kv_heads * dim * 2
        print(f"{batch:5d} {tokens:8d} {times['triton'] * 1e6:10.1f} {kv_bytes / times['triton'] / 1e12:5.2f} "
              f"{times['reference'] * 1e6:14.1f} {times['reference'] / times['triton']:8.1f}x  {diff:.2e}")


if __name__ == "__main__":
    main()

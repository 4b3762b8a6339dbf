"""Time the Triton prefill kernel's launch configurations at the bench
model's 16x2048 prefill (bf16, 14 query and 2 KV heads, head_dim 64, 64-token
pages, 16 prompts of 2048 tokens, one call = one layer). Needs a GPU.

    python scripts/sweep_triton_prefill.py

Each configuration (rows per program, cached tokens per iteration, warps,
software pipelining stages, query heads per program) sets the module constants of
``graphmode.kernels.triton_prefill``, is checked against the first one's
result (relative error; BLOCK_N changes the summation order) and timed with
``triton.testing.do_bench`` (median); the table ends with the best five.
"""

from __future__ import annotations

import torch

from graphmode.devices import require_gpu

# (rows, block_n, warps, stages, query heads per program; None: the whole group)
CONFIGS = [(128, 64, 8, 2, None), (128, 64, 4, 2, None), (64, 64, 4, None, 1), (128, 64, 4, 2, 1),
           (128, 64, 8, 2, 1), (128, 64, 4, 3, 1), (128, 128, 8, 2, 1), (128, 128, 8, 3, 1), (64, 128, 4, 3, 1),
           (128, 64, 8, 3, 2), (256, 64, 8, 2, 2), (128, 32, 4, 3, 1), (64, 64, 4, 3, 1), (256, 64, 8, 3, 1)]


def main() -> None:
    require_gpu(__file__)
    import triton.testing  # after the check: a CPU-only torch comes without triton

    from graphmode.kernels import triton_prefill

    torch.manual_seed(0)
    seqs, length, heads, kv_heads, dim, page = 16, 2048, 14, 2, 64, 64
    tokens, per_seq = seqs * length, length // page
    k = torch.randn(seqs * per_seq + 1, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = (torch.randperm(seqs * per_seq, device="cuda") + 1).view(seqs, per_seq).to(torch.int32)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.arange(0, tokens, length, device="cuda", dtype=torch.int32)
    lengths = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
    flops = 4 * seqs * heads * dim * length * (length + 1) / 2  # causal QK and PV

    def call() -> torch.Tensor:
        return triton_prefill.paged_prefill(q, k, v, table, starts, lengths, lengths, length, dim**-0.5)

    reference, results = None, []
    for rows, block_n, warps, stages, per_program in CONFIGS:
        module = triton_prefill
        module.ROWS, module.BLOCK_N, module.NUM_WARPS, module.NUM_STAGES = rows, block_n, warps, stages
        module.HEADS_PER_PROGRAM = per_program
        out = call().float()
        reference = out if reference is None else reference
        error = ((out - reference).norm() / reference.norm()).item()
        ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        results.append((ms, rows, block_n, warps, stages, per_program))
        print(f"rows {rows:4d} block_n {block_n:4d} warps {warps} stages {stages} heads {per_program}: {ms:.3f} ms, "
              f"{flops / ms / 1e9:.0f} TFLOP/s, relative error {error:.1e}", flush=True)
    print("best:", sorted(results, key=lambda result: result[0])[:5])
    # PyTorch's fused attention on the same prompts as a dense batch (key and
    # value heads repeated, no paging): a ceiling for the kernel
    dense = q.view(seqs, length, heads, dim).transpose(1, 2)
    keys = torch.randn(seqs, heads, length, dim, device="cuda", dtype=torch.bfloat16)
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    dense, keys, keys, is_causal=True), warmup=25, rep=100, return_mode="median")
            print(f"scaled_dot_product_attention {backend} (dense, causal): {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.0f} TFLOP/s")
        except RuntimeError as error:
            print(f"scaled_dot_product_attention {backend}: {str(error).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()

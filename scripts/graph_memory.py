"""Graph memory planned before the KV cache against what the warm-up took,
and the graph pool against its largest graph alone. Needs a GPU.

    python scripts/graph_memory.py                                       # bench model and 1B Llama, both modes, compile off and on, then the pool
    python scripts/graph_memory.py --models bench --compile off,on       # one model
    python scripts/graph_memory.py --models llama-1b --modes graph --compile off --no-pool

For each model, execute mode and compile setting, as an engine would: build
the runner, ``runner.plan_memory(probe)`` on a probe cache of 4 blocks, then
allocate a KV cache of ``--kv-fraction`` of the memory free after the plan,
``runner.warmup(kv_cache)``, and print the plan against
``runner.graph_memory`` (the driver's free memory after synchronize and
empty_cache, docs/engines.md "Graph memory before the KV cache"), with the
checks the issue sets: within 5% or 32 MiB, whichever is larger, and the
plan at most a quarter of the warm-up's time (compilation left out). Before
a model's first configuration, the forwards an engine runs before planning
(its profiling run) pay the process's first-use work, printed apart.

The pool (``--pool``, default on): the bench model in graph mode, every
default bucket against the largest alone, each into a new runner on the same
cache (twice, the first run of a process paying first-use allocations), as
``torch.cuda.memory_reserved`` growth (docs/performance.md's measure) and as
the driver's count; then what the pool of every bucket holds: its segments
and its live blocks by allocation site.

Models: ``bench`` is the reference decoder in its benchmark configuration
(ModelConfig.bench(): 24 layers, hidden 896, vocabulary 32000, bf16);
``llama-1b`` a random-weight transformers LlamaConfig of Llama-3.2-1B's shape
(graphmode.integrations.huggingface PRESETS, bf16) through the HF adapter.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

import graphmode
from graphmode.devices import script_device
from graphmode.model import ModelConfig, build_reference_model

MiB = 2**20


def build_model(name: str, device: torch.device) -> Any:
    if name in ("bench", "tiny"):
        return build_reference_model(ModelConfig.bench() if name == "bench" else ModelConfig.tiny(), device=device)
    from graphmode.integrations.huggingface import load_model, random_config

    return load_model(random_config(name), device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def cache_bytes(cache: Any) -> int:
    return sum(k.nbytes + v.nbytes for k, v in cache)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiling_forwards(model: Any, args: argparse.Namespace) -> float:
    """What an engine runs before it plans (vLLM's profiling run): eager
    decode forwards at batch 1 and at the largest batch on a probe cache,
    inert (every slot -1, every row on block 0). They pay the process's
    first-use work (CUDA modules, cuBLAS, Triton's kernels), which would
    otherwise fall on the first configuration's plan. Seconds."""
    device = torch.device(args.device)
    probe = model.make_kv_cache(num_cache_blocks=4, block_size=args.block_size)
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in (1, args.max_batches):
            int32 = torch.int32
            attn = graphmode.AttnMetadata(
                is_decoding=True, block_offsets=torch.zeros((batch, 1), dtype=int32, device=device),
                q_start_loc=torch.arange(batch, dtype=int32, device=device),
                q_seqlens=torch.ones(batch, dtype=int32, device=device),
                kv_seqlens=torch.ones(batch, dtype=int32, device=device),
                kv_start_indices=torch.full((batch,), -1, dtype=torch.int64, device=device),
                max_q_seq_len=1, max_kv_seq_len=1, kv_seqlens_cpu=torch.ones(batch, dtype=int32),
            )
            ids = torch.zeros((1, batch), dtype=torch.int64, device=device)
            model(ids, ids.clone(), probe, attn)
    sync(device)
    return time.perf_counter() - started


def plan_against_warmup(model: Any, name: str, mode: str, compiled: bool, args: argparse.Namespace) -> tuple[bool, bool]:
    """One configuration: (the plan within 5% or 32 MiB of the warm-up, the
    plan at most a quarter of the warm-up's time). Times are device-synchronised;
    with compile=True the compilation (``runner.stats.compile_seconds``, paid
    by whichever runs the compiled forward first, the plan) is printed apart
    and left out of the ratio, as an engine compiles before it plans."""
    device = torch.device(args.device)
    width = -(-args.context // args.block_size)
    runner = graphmode.build_graph_runner(
        model, max_batches=args.max_batches, max_blocks_per_seq=width, block_size=args.block_size,
        execute_mode=mode, compile=compiled,
    )
    probe = model.make_kv_cache(num_cache_blocks=4, block_size=args.block_size)
    block_bytes = cache_bytes(probe) // 4
    sync(device)
    started = time.perf_counter()
    plan = runner.plan_memory(probe)
    sync(device)
    plan_s, plan_compile = time.perf_counter() - started, runner.stats.compile_seconds
    del probe
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 256 * MiB  # the emulator: a budget
    blocks = int(args.kv_fraction * (free - plan.bytes)) // block_bytes
    kv_cache = model.make_kv_cache(num_cache_blocks=blocks, block_size=args.block_size)
    sync(device)
    started = time.perf_counter()
    runner.warmup(kv_cache, progress=False)
    sync(device)
    warmup_s, warmup_compile = time.perf_counter() - started, runner.stats.compile_seconds - plan_compile
    actual = runner.graph_memory
    assert actual is not None
    difference = actual.bytes - plan.bytes
    limit = max(0.05 * plan.bytes, 32 * MiB)
    within = abs(difference) <= limit
    ratio = (plan_s - plan_compile) / max(warmup_s - warmup_compile, 1e-9)
    compile_text = f" (compile {plan_compile:.1f} s and {warmup_compile:.1f} s, left out)" if compiled else ""
    print(
        f"{name:9s} {mode:18s} compile={'on ' if compiled else 'off'} {actual.graphs:3d} graphs: "
        f"planned {plan.bytes / MiB:8.1f} MiB ({plan.sampled} captured, {plan.estimated} estimated; kept by "
        f"planning {plan.kept / MiB:6.1f}), warm-up took {actual.bytes / MiB:8.1f} MiB, {difference / MiB:+7.1f} MiB "
        f"({100 * difference / max(plan.bytes, 1):+.1f}%) {'within' if within else 'OUTSIDE'} "
        f"{limit / MiB:.0f} MiB; KV cache {blocks} blocks ({cache_bytes(kv_cache) / 2**30:.2f} GiB); "
        f"plan {plan_s:.2f} s, warm-up {warmup_s:.2f} s{compile_text}: plan/warm-up {ratio:.2f} "
        f"({'at most' if ratio <= 0.25 else 'ABOVE'} 0.25)",
        flush=True,
    )
    print(f"    plan: {plan.families}; warm-up: {actual.families} (bytes by family)", flush=True)
    runner.reset()
    del runner, kv_cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return within, ratio <= 0.25


def pool_ratio(args: argparse.Namespace) -> None:
    """Every default bucket against the largest alone, each into a new runner."""
    device = torch.device("cuda")
    model = build_model("bench", device)
    width = -(-args.context // args.block_size)
    kv_cache = model.make_kv_cache(num_cache_blocks=args.max_batches * width + 1, block_size=args.block_size)

    def capture(buckets: list[int] | None) -> tuple[int, int, int]:
        runner = graphmode.build_graph_runner(
            model, max_batches=args.max_batches, max_blocks_per_seq=width, block_size=args.block_size,
            capture_batch_sizes=buckets,
        )
        runner.graph_meta()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        runner.warmup(kv_cache, progress=False)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device) - before
        assert runner.graph_memory is not None
        count = len(runner.capture_sizes)
        runner.reset()
        return count, reserved, runner.graph_memory.bytes

    for run in (1, 2):
        count, every, every_driver = capture(None)
        _, alone, alone_driver = capture([args.max_batches])
        print(
            f"pool, run {run}: {count} buckets {every / MiB:.1f} MiB reserved ({every_driver / MiB:.1f} MiB by the "
            f"driver), largest ({args.max_batches}) alone {alone / MiB:.1f} MiB ({alone_driver / MiB:.1f}): "
            f"ratio {every / max(alone, 1):.2f} ({every_driver / max(alone_driver, 1):.2f} by the driver)",
            flush=True,
        )
    pool_contents(model, kv_cache, width, args)


def pool_contents(model: Any, kv_cache: Any, width: int, args: argparse.Namespace) -> None:
    """The graph pool's segments after every bucket, and its live blocks by
    where they were allocated (as scripts/profile_capture.py)."""
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
    runner = graphmode.build_graph_runner(
        model, max_batches=args.max_batches, max_blocks_per_seq=width, block_size=args.block_size,
    )
    runner.warmup(kv_cache, progress=False)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    segments = [s for s in snapshot["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    print(f"graph pools after every bucket: {len(segments)} segments, "
          f"{sum(s['total_size'] for s in segments) / MiB:.1f} MiB")
    sites: dict[str, list[int]] = {}
    for segment in segments:
        print(f"  segment {segment['total_size'] / MiB:6.1f} MiB, pool {tuple(segment['segment_pool_id'])}, "
              f"allocated {segment['allocated_size'] / MiB:6.2f} MiB")
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if "graphmode" in f["filename"] or "llama" in f["filename"]][:3]
            sites.setdefault(" <- ".join(frames) or "(no Python frame)", []).append(block["size"])
    print("  live blocks by allocation site (count, MiB):")
    for site, sizes in sorted(sites.items(), key=lambda item: -sum(item[1])):
        print(f"    {len(sizes):4d} {sum(sizes) / MiB:8.2f}  {site}")
    runner.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bench,llama-1b")
    parser.add_argument("--modes", default="graph,full_and_piecewise")
    parser.add_argument("--compile", default="off,on", help="off, on, or off,on")
    parser.add_argument("--max-batches", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=1088, help="tokens a block table addresses")
    parser.add_argument("--kv-fraction", type=float, default=0.5, help="of the memory free after the plan")
    parser.add_argument("--pool", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test on the emulator (--models tiny,llama-tiny "
                        "--compile off --no-pool --max-batches 8)")
    args = parser.parse_args()
    device = script_device(__file__, args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU emulator"
    print(f"{name}, torch {torch.__version__}", flush=True)
    results = []
    for name in args.models.split(","):
        if not name:
            continue
        model = build_model(name, device)
        print(f"{name}: profiling forwards (first-use work, before any plan) {profiling_forwards(model, args):.2f} s",
              flush=True)
        for mode in args.modes.split(","):
            for setting in args.compile.split(","):
                try:
                    results.append(plan_against_warmup(model, name, mode, setting == "on", args))
                except Exception as error:  # report and go on: one configuration failing says nothing of the rest
                    print(f"{name} {mode} compile={setting}: FAILED {type(error).__name__}: {error}", flush=True)
                    results.append((False, False))
                    gc.collect()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if results:
        print(f"{sum(r[0] for r in results)} of {len(results)} configurations within 5% or 32 MiB; "
              f"{sum(r[1] for r in results)} of {len(results)} plans at most a quarter of the warm-up's time",
              flush=True)
    if args.pool and device.type == "cuda":
        pool_ratio(args)


if __name__ == "__main__":
    main()

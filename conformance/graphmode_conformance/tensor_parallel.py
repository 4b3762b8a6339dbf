"""Tensor-parallel conformance: graph equals eager at TP=N, and TP=N matches
TP=1, with the all-reduces inside the captured graphs. Run one process per
device with torchrun:

    torchrun --nproc-per-node 2 -m graphmode_conformance.tensor_parallel --device cuda
    torchrun --nproc-per-node 2 -m graphmode_conformance.tensor_parallel --device cpu   # gloo + emulator

Every rank checks its own results; rank 0 prints the table. Comparisons:
graph against eager at the bucket's shape (padded eager) must be bitwise
identical; graph against eager at the batch's shape and TP=N against the
unsharded model must agree within --rtol of the largest logit (the sums are
taken in another order). ``--scenario`` runs a rank disagreement instead,
which must be reported as an error naming every rank's value, not hang.
``--execute-mode full_and_piecewise`` runs the prefills in piecewise graphs
(the ranks agree on each token bucket; each prompt comes in two chunks
drawn to fit the largest) and the decodes in full graphs; the prefills' logits are checked as
the decodes' are, and their KV writes through the decodes that read them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist

import graphmode
from graphmode.buckets import parse_sizes
from graphmode.devices import usable_device
from graphmode.distributed import init_process_group, torchrun_rank
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine, pad_step
from graphmode.model.parallel import shard_model

PIECEWISE_TOKENS = 512  # the largest token bucket in piecewise modes
# The most tokens one prefill step takes (sequences beyond go to the next
# step, as an engine batches prefills): a step's logits are (1, T, vocab),
# 2.5 GB at 8192 tokens of the bench model's 151936 words, and 256 prompts of
# up to 1019 tokens in one step made 40 GB a copy, out of memory on an H100.
PREFILL_TOKENS = 8192


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def prefill_steps(seqs: list[int], lengths: list[int]) -> list[tuple[list[int], list[int]]]:
    """``seqs`` with their prompt ``lengths`` in prefill steps of at most
    :data:`PREFILL_TOKENS` tokens each (a longer prompt alone in its step)."""
    steps: list[tuple[list[int], list[int]]] = []
    for seq, length in zip(seqs, lengths, strict=True):
        if not steps or sum(steps[-1][1]) + length > PREFILL_TOKENS:
            steps.append(([], []))
        steps[-1][0].append(seq)
        steps[-1][1].append(length)
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vendor", default=None)
    parser.add_argument("--config", choices=["tiny", "bench"], default=None)
    parser.add_argument("--batches", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rtol", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=120, help="seconds before a collective counts as hung")
    parser.add_argument("--scenario", choices=["agree", "different-capture-lists", "different-batches", "different-families", "different-variants"],
                        default="agree")
    parser.add_argument("--json", default=None)
    parser.add_argument("--execute-mode", default="graph", choices=["graph", "full_and_piecewise"],
                        help="full_and_piecewise: prefills in piecewise graphs (token buckets to 512), decodes in full graphs")
    args = parser.parse_args(argv)

    # One line where the device is missing (a CPU-only torch), not torch's AttributeError at set_device.
    usable_device(args.device, "graphmode_conformance.tensor_parallel",
                  hint="pass --device cpu to run it on the CPU graph emulator over gloo")
    rank, world, device = torchrun_rank(args.device)
    on_gpu = device.type != "cpu"
    config = ModelConfig.bench() if (args.config or ("bench" if on_gpu else "tiny")) == "bench" else ModelConfig.tiny()
    batches = parse_sizes(args.batches or ("1-64,128,256" if on_gpu else "1-8,12,16"))
    rtol = args.rtol or (0.05 if config.dtype != torch.float32 else 1e-4)
    vendor = graphmode.select_vendor(args.vendor, device)
    backend = init_process_group(vendor, device, timeout=datetime.timedelta(seconds=args.timeout))
    group = dist.group.WORLD
    assert group is not None  # init_process_group made it

    block_size = 64 if on_gpu else 16
    context = 1024 if on_gpu else 64
    width = -(-(context + args.steps) // block_size)
    cache_blocks = max(batches) * width + 1
    full = build_reference_model(config, vendor, device)
    sharded = shard_model(build_reference_model(config, vendor, device), group)
    capture_sizes = [1, 2, 4] if (args.scenario == "different-capture-lists" and rank == 1) else None
    try:
        runner = graphmode.build_graph_runner(
            sharded, max_batches=max(batches), max_blocks_per_seq=width, block_size=block_size, device=device,
            vendor=vendor.name, process_group=group, capture_batch_sizes=capture_sizes,
            execute_mode=args.execute_mode,
            capture_token_sizes=[8, 16, 32, 64, 128, 256, PIECEWISE_TOKENS] if args.execute_mode != "graph" else None,
            # A graph variant the reference model ignores, so that ranks can disagree on it.
            graph_variants={"microbatch": (False, True)} if args.scenario == "different-variants" else None,
        )
    except graphmode.GraphModeError as error:
        return report_scenario(args.scenario, rank, error)
    caches = {name: model.make_kv_cache(cache_blocks, block_size)
              for name, model in (("graph", sharded), ("eager", sharded), ("padded", sharded), ("tp1", full))}
    engine = ReferenceEngine(cache_blocks, block_size, device, vocab_size=config.vocab_size, table_width=width, seed=99)
    if rank == 0:
        print(f"tensor-parallel conformance: {world} ranks, {backend}, {vendor.name} on {device} "
              f"({torch.cuda.get_device_name(device) if on_gpu else 'CPU emulator'}), torch {torch.__version__}, "
              f"{config.num_hidden_layers} layers {str(config.dtype).replace('torch.', '')}, buckets {list(runner.capture_sizes)}, "
              f"{args.execute_mode} mode",
              flush=True)
    rows, failures, started = [], 0, time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            seqs = [engine.add() for _ in range(batch)]
            # In piecewise modes each prompt comes in two chunks (chunked
            # prefill) that fit the largest token bucket, so that the prefills
            # run in piecewise graphs; their logits are checked against eager
            # and TP=1 below, with the decodes'.
            longest, chunks = context - args.steps, 1
            if args.execute_mode != "graph":
                longest, chunks = max(2, min(longest, PIECEWISE_TOKENS // batch) // 2), 2
            prefill_diff = (0.0, 0.0)
            for _ in range(chunks):
                lengths = [engine.rng.randrange(1, longest) for _ in seqs]
                for step_seqs, step_lengths in prefill_steps(seqs, lengths):
                    prompt = engine.prefill(step_seqs, step_lengths)
                    prefill = runner(prompt.input_ids, prompt.position_ids, caches["graph"],
                                     prompt.attn_metadata).clone()
                    prefill_eager = sharded(prompt.input_ids, prompt.position_ids, caches["eager"], prompt.attn_metadata)
                    prefill_tp1 = full(prompt.input_ids, prompt.position_ids, caches["tp1"], prompt.attn_metadata)
                    prefill_diff = (max(prefill_diff[0], relative(prefill, prefill_eager)),
                                    max(prefill_diff[1], relative(prefill, prefill_tp1)))
                    del prefill, prefill_eager, prefill_tp1
            for name in ("eager", "padded"):
                for (gk, gv), (k, v) in zip(caches["graph"], caches[name]):
                    k.copy_(gk)
                    v.copy_(gv)
            bucket = runner.bucket_of(batch)
            assert bucket is not None, f"batch {batch} has no bucket in {list(runner.capture_sizes)}"
            same_shape, (graph_eager, tp_diff) = 0, prefill_diff
            for _ in range(args.steps):
                step = engine.decode(seqs)
                if args.scenario == "different-batches" and rank == 1:
                    step = engine.decode(seqs[:-1]) if batch > 1 else step
                if args.scenario == "different-families" and rank == 1:  # as many tokens as rank 0's sequences
                    step = engine.prefill([engine.add()], [batch])
                variant = {"microbatch": rank == 1} if args.scenario == "different-variants" else {}
                try:
                    graph = runner(step.input_ids, step.position_ids, caches["graph"], step.attn_metadata,
                                   **variant).clone()
                except graphmode.GraphModeError as error:
                    return report_scenario(args.scenario, rank, error)
                eager = sharded(step.input_ids, step.position_ids, caches["eager"], step.attn_metadata)
                padded = pad_step(step, bucket)
                at_bucket = sharded(padded.input_ids, padded.position_ids, caches["padded"], padded.attn_metadata)[:, :batch]
                reference = full(step.input_ids, step.position_ids, caches["tp1"], step.attn_metadata)
                same_shape += int(torch.equal(graph, at_bucket))
                graph_eager = max(graph_eager, relative(graph, eager))
                tp_diff = max(tp_diff, relative(graph, reference))
            ok = same_shape == args.steps and graph_eager <= rtol and tp_diff <= rtol
            failures += not ok
            rows.append(dict(batch=batch, bucket=bucket, bitwise_vs_padded_eager=same_shape,
                             graph_vs_eager=graph_eager, tp_vs_tp1=tp_diff, ok=ok))
            if rank == 0:
                print(f"batch {batch:4d} bucket {bucket:4d}: graph vs eager at bucket shape bitwise "
                      f"{same_shape}/{args.steps}, vs eager {graph_eager:.2e}, TP={world} vs TP=1 {tp_diff:.2e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
            for seq in seqs:
                engine.finish(seq)
    if args.scenario != "agree":
        print(f"rank {rank}: scenario {args.scenario} raised no error: FAIL", flush=True)
        return 1
    # Summed on the runner's gloo group: host values need no device collective.
    totals = torch.tensor([failures])
    ranks = runner.rank_sync  # None on a single rank: its own count is the total
    if ranks is not None:
        dist.all_reduce(totals, group=ranks.control)
    if rank == 0:
        print(f"\n{len(rows)} batch sizes x {args.steps} steps on {world} ranks in {time.perf_counter() - started:.0f}s; "
              f"{runner.stats.summary()}")
        if args.execute_mode != "graph":
            print(f"prefills: {runner.stats.piecewise_replays} replays of {runner.stats.piecewise_captures} "
                  f"piecewise graphs, {sum(runner.stats.eager_steps.values())} steps eager")
        print(f"graph vs eager at the bucket's shape: {sum(r['bitwise_vs_padded_eager'] == args.steps for r in rows)}/"
              f"{len(rows)} batch sizes bitwise identical; worst graph vs eager {max(r['graph_vs_eager'] for r in rows):.2e}; "
              f"worst TP={world} vs TP=1 {max(r['tp_vs_tp1'] for r in rows):.2e} (tolerance {rtol})")
        print("PASS" if totals.item() == 0 else f"FAIL: {int(totals.item())} batch sizes failed on some rank")
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"world": world, "backend": backend, "device": str(device), "rows": rows}, out, indent=1)
    # Graphs hold NCCL kernels of the group's communicator: release them
    # before the communicator goes (on H200s, tearing down with them alive hung).
    runner.reset()
    if on_gpu:
        torch.cuda.synchronize(device)
    if ranks is not None:
        dist.barrier(group=ranks.control)
    dist.destroy_process_group()
    return 0 if totals.item() == 0 else 1


def report_scenario(scenario: str, rank: int, error: BaseException) -> NoReturn:
    """In a disagreement scenario the error is the expected outcome: report
    it and leave at once. Tearing the groups down after a refused step is not
    reliable: with live gloo groups a rank can abort at exit on torch 2.13
    ("terminate called without an active exception"), and
    ``destroy_process_group`` can wait forever for the other rank on torch 2.5."""
    print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
    sys.stderr.flush()
    os._exit(0 if scenario != "agree" else 1)


if __name__ == "__main__":
    sys.exit(main())

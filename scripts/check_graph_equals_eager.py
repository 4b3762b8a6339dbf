"""Graph output equals eager output on the reference model, for every batch size.

For each batch size: new sequences with random prompt lengths are prefilled
(eagerly, into one cache, then copied so both paths start identical), then
``--steps`` decode steps run twice on the same inputs: once through the
runner (graphs) and once through the model (eager), each on its own KV cache.
Block tables are random (blocks are handed out shuffled and reused after
sequences finish).

Comparison. The graph runs at its bucket's shape; eager runs at the batch's.
When they are equal the same kernels run on the same shapes, and logits and
KV cache must be bitwise identical. When the batch is padded, the graph's
GEMMs have more rows than eager's and may pick other kernels, so a third path
runs eager on the padded batch (inert rows: slot -1, reserved block): the
graph must be bitwise identical to it, logits and KV cache, which shows the
graph computes exactly what eager computes at that shape. The difference to
unpadded eager is reported, and must stay within --rtol of the largest logit.

    python scripts/check_graph_equals_eager.py --device cuda --config bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import graphmode
from graphmode.buckets import parse_sizes
from graphmode.devices import script_device
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine, pad_step


def caches_equal(first, second) -> bool:
    return all(torch.equal(a, b) for pair_a, pair_b in zip(first, second) for a, b in zip(pair_a, pair_b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vendor", default=None)
    parser.add_argument("--config", choices=["tiny", "bench"], default="bench")
    parser.add_argument("--batches", default="1-64,100,200,256")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024, help="longest sequence, in tokens")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--rtol", type=float, default=0.05)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = script_device(__file__, args.device)
    config = ModelConfig.bench() if args.config == "bench" else ModelConfig.tiny()
    vendor = graphmode.select_vendor(args.vendor, device)
    model = build_reference_model(config, vendor, device)
    batches = parse_sizes(args.batches)
    max_batch = max(batches)
    width = -(-(args.context + args.steps) // args.block_size)
    cache_blocks = max_batch * width + 1
    runner = graphmode.build_graph_runner(
        model, max_batches=max_batch, max_blocks_per_seq=width, block_size=args.block_size, device=device, vendor=vendor.name
    )
    graph_cache = model.make_kv_cache(cache_blocks, args.block_size)
    eager_cache = model.make_kv_cache(cache_blocks, args.block_size)
    padded_cache = model.make_kv_cache(cache_blocks, args.block_size)
    engine = ReferenceEngine(
        cache_blocks, args.block_size, device, vocab_size=config.vocab_size, table_width=width, seed=1234
    )
    print(f"graphmode {vendor.name} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, "
          f"torch {torch.__version__}, {config.num_hidden_layers} layers {str(config.dtype)}, "
          f"buckets {list(runner.capture_sizes)}", flush=True)

    rows, failures = [], 0
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            seqs = [engine.add() for _ in range(batch)]
            prompt = [engine.rng.randrange(1, args.context - args.steps + 1) for _ in seqs]
            step = engine.prefill(seqs, prompt)
            runner(step.input_ids, step.position_ids, graph_cache, step.attn_metadata)
            for cache in (eager_cache, padded_cache):
                for (gk, gv), (k, v) in zip(graph_cache, cache):
                    k.copy_(gk)
                    v.copy_(gv)
            bucket = runner.bucket_of(batch)
            bitwise_steps, padded_bitwise_steps, worst = 0, 0, 0.0
            for _ in range(args.steps):
                step = engine.decode(seqs)
                graph_out = runner(step.input_ids, step.position_ids, graph_cache, step.attn_metadata).clone()
                eager_out = model(step.input_ids, step.position_ids, eager_cache, step.attn_metadata)
                padded = pad_step(step, bucket)
                padded_out = model(padded.input_ids, padded.position_ids, padded_cache, padded.attn_metadata)[:, :batch]
                bitwise_steps += int(torch.equal(graph_out, eager_out))
                padded_bitwise_steps += int(torch.equal(graph_out, padded_out))
                scale = eager_out.abs().max().item()
                worst = max(worst, (graph_out.float() - eager_out.float()).abs().max().item() / scale)
            kv_equal = caches_equal(graph_cache, eager_cache)
            kv_padded_equal = caches_equal(graph_cache, padded_cache)
            kv_worst = max(
                ((g.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30)).item()
                for pair_g, pair_e in zip(graph_cache, eager_cache)
                for g, e in zip(pair_g, pair_e)
            )
            ok = padded_bitwise_steps == args.steps and kv_padded_equal
            if bucket == batch:
                ok = ok and bitwise_steps == args.steps and kv_equal
            else:
                ok = ok and worst <= args.rtol and kv_worst <= args.rtol
            failures += not ok
            rows.append(dict(batch=batch, bucket=bucket, bitwise_steps=bitwise_steps, steps=args.steps,
                             bitwise_vs_padded_eager=padded_bitwise_steps, kv_identical_to_padded_eager=kv_padded_equal,
                             max_rel_diff=worst, kv_identical=kv_equal, kv_max_rel_diff=kv_worst, ok=ok))
            print(f"batch {batch:4d} bucket {bucket:4d}: vs eager at bucket shape: bitwise {padded_bitwise_steps}/{args.steps}, "
                  f"KV {'identical' if kv_padded_equal else 'DIFFERENT'}; vs eager at batch shape: bitwise "
                  f"{bitwise_steps}/{args.steps}, max rel diff {worst:.2e}, KV "
                  f"{'identical' if kv_equal else f'max rel diff {kv_worst:.2e}'} {'ok' if ok else 'FAIL'}", flush=True)
            for seq in seqs:
                engine.finish(seq)
    elapsed = time.perf_counter() - started
    bucket_rows = [r for r in rows if r["bucket"] == r["batch"]]
    other_rows = [r for r in rows if r["bucket"] != r["batch"]]
    print(f"\n{len(rows)} batch sizes x {args.steps} steps in {elapsed:.0f}s; {runner.stats.summary()}")
    same_shape = sum(r["bitwise_vs_padded_eager"] == r["steps"] and r["kv_identical_to_padded_eager"] for r in rows)
    print(f"graph vs eager at the same (bucket) shape: {same_shape}/{len(rows)} batch sizes bitwise identical, logits and KV cache")
    print(f"bucket-sized batches vs eager: {sum(r['bitwise_steps'] == r['steps'] and r['kv_identical'] for r in bucket_rows)}/{len(bucket_rows)} bitwise identical")
    if other_rows:
        print(f"padded batches vs eager at the batch's own shape: {sum(r['bitwise_steps'] == r['steps'] for r in other_rows)}/{len(other_rows)} bitwise identical; "
              f"worst relative logit difference {max(r['max_rel_diff'] for r in other_rows):.2e}, "
              f"worst relative KV difference {max(r['kv_max_rel_diff'] for r in other_rows):.2e} (tolerance {args.rtol})")
    print("PASS" if failures == 0 else f"FAIL: {failures} batch sizes")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": str(device), "vendor": vendor.name, "torch": torch.__version__, "rows": rows}, out, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

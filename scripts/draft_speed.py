"""Speculative decoding with a draft model, measured three ways on one
workload: tokens/s without speculation, with verify graphs only (the target's
verify steps replay graphs, the draft model's steps run eagerly) and with
draft graphs (the draft model's steps replay its own runner's graphs, captured
into the target runner's memory pool). Greedy tokens must be identical in
all three.

    python scripts/draft_speed.py --device cuda --config llama-1b --draft-layers 2 --dtype float32
    python scripts/draft_speed.py --device cpu --config llama-tiny --draft-layers 1 --requests 4  # emulator

The draft is ``--draft-model DIR`` (an HF causal LM of the target's
vocabulary) or ``--draft-layers N``: the target's first N layers with its
embeddings, final norm and head (``examples/draft_model.first_layers``), a
smaller config sharing the target's vocabulary. With random weights drafts
are rarely accepted (on the H100 at llama-1b, 3 of 5319 on 2026-11-26; an
independently drawn random draft would share nothing at all), so the three
figures compare what drafting costs (graphs against eager steps) more than
what speculation gains. Every runner is warmed up
(all its graphs captured) and each configuration primed with the same
workload, untimed, before its timed run. Tokens that differ between runs are
judged by ``hf_parity.py``'s tolerance rule (a difference where the
reference's top-2 margin is within twice the logit difference is numerics,
not an error; bfloat16 runs can show such); the run fails on a violation.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import graphmode
from graphmode.devices import script_device
from graphmode.integrations.huggingface import PRESETS, load_model, random_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import draft_model  # noqa: E402
import hf_parity  # noqa: E402
import serve_hf  # noqa: E402

MODES = {"no speculation": None, "verify graphs only": "eager", "draft graphs": "graph"}


def make_requests(args: argparse.Namespace, vocab: int, count: int, new_tokens: int) -> list[serve_hf.Request]:
    generator = torch.Generator().manual_seed(0)
    return [serve_hf.Request(torch.randint(vocab, (args.prompt_len,), generator=generator).tolist(),
                             max_new_tokens=max(1, new_tokens - 5 * (i % 4)))
            for i in range(count)]


def run(target, small, args: argparse.Namespace, draft_mode: str | None, *, count: int, new_tokens: int,
        observe: Callable | None = None):
    """One workload served: (the requests, seconds, step counts, the runners' summaries)."""
    speculate = args.speculate if draft_mode is not None else 0
    width = -(-(args.prompt_len + new_tokens + speculate) // args.block_size)
    blocks = args.max_batch * width + 1
    kv_cache = target.make_kv_cache(blocks, args.block_size)
    runner = graphmode.build_graph_runner(target, max_batches=args.max_batch, max_blocks_per_seq=width,
                                          block_size=args.block_size, max_q_len=speculate + 1)
    batch = serve_hf.PagedBatch(blocks, args.block_size, width, torch.device(args.device))
    runner.warmup(kv_cache, q_lens=[speculate + 1], progress=False)  # every verify step carries k drafts
    drafter = serve_hf.draft
    if draft_mode is not None:
        drafter = draft_model.build_draft(small, runner, batch, blocks, execute_mode=draft_mode)
        drafter.runner.warmup(drafter.kv_cache, progress=False)
    requests = make_requests(args, target.config.vocab_size, count, new_tokens)
    sync(args.device)
    begin = time.perf_counter()
    steps = serve_hf.serve(runner, kv_cache, batch, requests, max_batch=args.max_batch, speculate=speculate,
                           eos=hf_parity.eos_of(target), drafter=drafter, observe=observe)
    sync(args.device)
    seconds = time.perf_counter() - begin
    summaries = [f"target runner: {runner.stats.summary()}"]
    if isinstance(drafter, draft_model.DraftModel):
        summaries.append(f"draft runner: {drafter.runner.stats.summary()}")
    return requests, seconds, steps, summaries


def observed(target, small, args: argparse.Namespace, draft_mode: str | None):
    """The workload again, untimed, with the logits rows that chose each token."""
    rows: dict[int, list[torch.Tensor]] = {}
    requests, *_ = run(target, small, args, draft_mode, count=args.requests, new_tokens=args.new_tokens,
                       observe=lambda r, logits: rows.setdefault(id(r), []).append(logits.to("cpu", torch.float32, copy=True)))
    return [(r.output, torch.cat(rows[id(r)])) for r in requests]


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", choices=sorted(PRESETS), default="llama-1b", help="a random target of this shape")
    source.add_argument("--model", help="a local Hugging Face model directory as the target")
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft-layers", type=int, default=2, metavar="N", help="the target's first N layers draft")
    drafts.add_argument("--draft-model", metavar="DIR", help="a local HF causal LM of the target's vocabulary drafts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculate", type=int, default=3, metavar="K", help="drafts per verify step")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    script_device(__file__, args.device)

    dtype = getattr(torch, args.dtype)
    target = load_model(args.model or random_config(args.config), args.device, dtype)
    if args.draft_model is not None:
        small = load_model(args.draft_model, args.device, dtype)
    else:
        small = draft_model.first_layers(target, args.draft_layers)
    draft_model.check_vocabulary(target, small)
    billions = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (target, small)]
    print(f"target {args.model or args.config} ({target.config.num_hidden_layers} layers, {billions[0]:.2f} B), draft "
          f"{args.draft_model or f'its first {args.draft_layers} layers'} ({small.config.num_hidden_layers} layers, "
          f"{billions[1]:.2f} B), {dtype}, on {args.device} (torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}); {args.requests} requests, "
          f"batch up to {args.max_batch}, {args.prompt_len} prompt tokens, up to {args.new_tokens} new, K={args.speculate}")
    results = {}
    for name, mode in MODES.items():
        # Primed with the same workload untimed: every kernel of every shape it
        # meets compiled or tuned, the allocator warm (a short priming left the
        # first mode timed 1.4x slow on an H100).
        run(target, small, args, mode, count=args.requests, new_tokens=args.new_tokens)
        requests, seconds, steps, summaries = run(target, small, args, mode, count=args.requests,
                                                  new_tokens=args.new_tokens)
        results[name] = tokens = [r.output for r in requests]
        generated = sum(map(len, tokens))
        accepted = f", accepted {steps['accepted']}/{steps['drafted']} drafts" if steps["drafted"] else ""
        print(f"{name}: {generated / seconds:.1f} tokens/s ({generated} tokens in {seconds:.2f} s; "
              f"steps {dict(steps)}{accepted})")
        for line in summaries:
            print(f"  {line}")
    reference = results["no speculation"]
    differing = [name for name, tokens in results.items() if tokens != reference]
    violations = 0
    if not differing:
        print("greedy tokens identical in all three")
    else:
        print(f"greedy tokens differ from no speculation in: {', '.join(differing)}; the tolerance rule decides")
        base = observed(target, small, args, MODES["no speculation"])
        for name in differing:
            violations += hf_parity.compare(f"{name} vs no speculation", observed(target, small, args, MODES[name]), base)
    print("PASS" if not violations else "FAIL")
    return 0 if not violations else 1


if __name__ == "__main__":
    sys.exit(main())

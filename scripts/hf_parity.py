"""A Hugging Face model through graphmode: greedy tokens from graph replays
against graphmode's eager steps and against ``model.generate(do_sample=False)``
(HF's own sdpa attention and cache), and eager against graph step latency.

    python scripts/hf_parity.py --device cuda --config llama-1b --dtype bfloat16
    python scripts/hf_parity.py --device cpu --config llama-tiny --dtype float32   # the emulator
    python scripts/hf_parity.py --device cuda --config llama-1b --speculate 3      # verify steps as graphs

Tolerance rule (bf16 makes bit-equality meaningless): two runs of a request
produce the same tokens up to the first step where they differ; there, both
saw the same context, so their logits rows a (graph) and b (reference) differ
only by numerics, d = max |a - b|. If b's top-2 margin exceeds 2 d, a's
argmax cannot differ from b's (each logit moved by at most d), so a differing
token there is a VIOLATION: a real error. With a margin <= 2 d the tie is
within numerics: reported, not a failure; later tokens of that request are
not compared (their contexts differ). Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import graphmode
from graphmode.devices import script_device
from graphmode.integrations.huggingface import ATTENTION, PRESETS, load_model, random_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import serve_hf  # noqa: E402


def make_requests(count: int, prompt_len: int, new_tokens: int, vocab: int) -> list[serve_hf.Request]:
    generator = torch.Generator().manual_seed(0)
    return [
        serve_hf.Request(torch.randint(vocab, (prompt_len - 3 * (i % 3),), generator=generator).tolist(),
                         max_new_tokens=max(1, new_tokens - 5 * (i % 4)), arrival=2 * i)
        for i in range(count)
    ]


def run_graphmode(model, args, execute_mode: str):
    """Tokens and the logits rows that chose them, per request; runner stats."""
    width = -(-(args.prompt_len + args.new_tokens + args.speculate) // args.block_size)
    kv_cache = model.make_kv_cache(args.max_batch * width + 1, args.block_size)
    runner = graphmode.build_graph_runner(model, max_batches=args.max_batch, max_blocks_per_seq=width,
                                          block_size=args.block_size, execute_mode=execute_mode,
                                          max_q_len=args.speculate + 1)
    batch = serve_hf.PagedBatch(args.max_batch * width + 1, args.block_size, width, torch.device(args.device))
    requests = make_requests(args.requests, args.prompt_len, args.new_tokens, model.config.vocab_size)
    rows: dict[int, list[torch.Tensor]] = {id(r): [] for r in requests}
    steps = serve_hf.serve(runner, kv_cache, batch, requests, max_batch=args.max_batch, eos=eos_of(model),
                           speculate=args.speculate, drafter=always_draft,
                           observe=lambda request, logits: rows[id(request)].append(logits.to("cpu", torch.float32, copy=True)))
    return [(r.output, torch.cat(rows[id(r)])) for r in requests], steps, runner.stats


def always_draft(tokens: list[int], k: int) -> list[int]:
    """The n-gram draft, else the last token k times: every step verifies k
    drafts (a random model's text rarely repeats), so every decode step is a
    graph of k + 1 tokens per sequence."""
    return serve_hf.draft(tokens, k) or [tokens[-1]] * k


def run_hf_generate(model, args):
    """HF's greedy generate with its own attention (sdpa) and cache."""
    hf = model.hf_model
    hf.config._attn_implementation = "sdpa"
    try:
        results = []
        for request in make_requests(args.requests, args.prompt_len, args.new_tokens, model.config.vocab_size):
            prompt = torch.tensor([request.prompt], device=args.device)
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=request.max_new_tokens,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, prompt.shape[1]:].tolist()
            results.append((tokens, torch.cat([row.float().cpu() for row in out.logits])))
        return results
    finally:
        hf.config._attn_implementation = ATTENTION


def eos_of(model) -> set[int]:
    eos = model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def compare(name: str, runs, references) -> int:
    """Apply the tolerance rule; print one line per request; return violations."""
    violations, exact, noise = 0, 0, []
    for index, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(runs, references)):
        first = next((t for t, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        agree = min(len(tokens), len(ref_tokens)) if first is None else first
        noise += [(logits[t] - ref_logits[t]).abs().max().item() for t in range(agree)]
        if first is None:
            exact += len(tokens) == len(ref_tokens)
            if len(tokens) != len(ref_tokens):
                print(f"  {name} request {index}: lengths differ ({len(tokens)} vs {len(ref_tokens)}): VIOLATION")
                violations += 1
            continue
        d = (logits[first] - ref_logits[first]).abs().max().item()
        top2 = ref_logits[first].topk(2).values
        margin = (top2[0] - top2[1]).item()
        verdict = "VIOLATION" if margin > 2 * d else "within numerics"
        violations += verdict == "VIOLATION"
        print(f"  {name} request {index}: first differing token {first} of {len(ref_tokens)}: "
              f"{tokens[first]} vs {ref_tokens[first]}, reference top-2 margin {margin:.4f}, "
              f"max |logit diff| {d:.4f}: {verdict}")
    spread = f"max |logit diff| on agreeing tokens {max(noise):.4f}" if noise else "no agreeing tokens"
    print(f"{name}: {exact}/{len(runs)} requests identical, {violations} violations; {spread}")
    return violations


def time_steps(model, args) -> None:
    """Median decode-step latency, eager (the model) against graph (replays)."""
    context = args.prompt_len
    for size in args.latency_batches:
        width = -(-(context + 1) // args.block_size)
        kv_cache = model.make_kv_cache(size * width + 1, args.block_size)
        batch = serve_hf.PagedBatch(size * width + 1, args.block_size, width, torch.device(args.device))
        requests = [serve_hf.Request([1] * context, 1) for _ in range(size)]
        batch.step(requests, [r.prompt for r in requests], False)  # allocate the context's blocks
        step = batch.step(requests, [[1]] * size, True)
        runner = graphmode.build_graph_runner(model, max_batches=size, max_blocks_per_seq=width, block_size=args.block_size,
                                              capture_batch_sizes=[size])
        timings = {}
        for name, forward in (("eager", model), ("graph", runner)):
            samples = []
            with torch.inference_mode():
                for i in range(args.latency_steps + 3):
                    sync(args.device)
                    begin = time.perf_counter()
                    forward(past_key_values=kv_cache, **step)
                    sync(args.device)
                    if i >= 3:  # the first steps capture and warm up
                        samples.append(time.perf_counter() - begin)
            timings[name] = statistics.median(samples) * 1e3
        assert runner.stats.replays == args.latency_steps + 2, runner.stats.summary()
        print(f"  batch {size:3d}, context {context}: eager {timings['eager']:.2f} ms, graph "
              f"{timings['graph']:.2f} ms, {timings['eager'] / timings['graph']:.2f}x")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", choices=sorted(PRESETS), default="llama-1b", help="a random model of this shape")
    source.add_argument("--model", help="a local Hugging Face model directory instead")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--latency-batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--latency-steps", type=int, default=50)
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="verify up to K n-gram drafted tokens per step (decode graphs of K+1 tokens per sequence)")
    args = parser.parse_args()
    script_device(__file__, args.device)

    dtype = getattr(torch, args.dtype)
    model = load_model(args.model or random_config(args.config), args.device, dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{args.model or args.config}: {params:.2f} B parameters, {dtype}, on {args.device} "
          f"(torch {torch.__version__}, {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}), "
          f"attention ops {type(model.ops).__name__}")

    graph, steps, stats = run_graphmode(model, args, "graph")
    print(f"graph run: steps {dict(steps)}; runner: {stats.summary()}")
    ok = stats.replays > 0 and stats.captures + stats.replays == steps["decode"] + steps["verify"]
    if not ok:
        print("NOT ALL DECODE AND VERIFY STEPS WERE GRAPH STEPS")
    eager, _, eager_stats = run_graphmode(model, args, "eager")
    print(f"eager run: runner: {eager_stats.summary()}")
    hf = run_hf_generate(model, args)
    violations = compare("graph vs graphmode eager", graph, eager)
    violations += compare("graph vs HF generate", graph, hf)
    violations += compare("graphmode eager vs HF generate", eager, hf)
    print("decode step latency (median):")
    time_steps(model, args)
    print("PASS" if ok and not violations else "FAIL")
    return 0 if ok and not violations else 1


if __name__ == "__main__":
    sys.exit(main())

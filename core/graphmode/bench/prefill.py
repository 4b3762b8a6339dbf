"""``graphmode bench --workload prefill``: prefill, chunked-prefill and decode
steps, eager against piecewise graphs, full-and-piecewise graphs, both over
the compiled forward (``compile=True``: "piecewise+compile",
"full_and_piecewise+compile", CUDA only) and torch.compile, side by side.

Per case (see ``bench/cases.py``) and mode: the median step (ms), its
speed-up over eager, the largest difference from eager's logits at each
sequence's last token, and the device's peak memory. The cases run one after
another, every mode on a case before the next case; each mode is built once
and keeps its graphs for the whole run.

Token buckets are the cases' token counts exactly, so no step is padded;
full graphs serve the decode cases' batch sizes in full-and-piecewise mode.
The torch.compile column is ``reduce-overhead`` by default: the CUDA plugin's
prefill attention is opaque to Dynamo (``torch.compiler.disable``), so the
forward compiles into pieces between the attention calls, each replayed from
CUDA graph trees: the same split as piecewise graphs, with Inductor's fused
kernels inside. ``--compile-mode default`` times Inductor's kernels without
graphs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from graphmode.bench.cases import Case, PrefillWorkload, parse_cases
from graphmode.bench.common import CPU_CASES, GPU_CASES, PREFILL_MODES, chosen_modes
from graphmode.bench.measure import machine, measure, release
from graphmode.bench.modes import Compiled, Eager, GraphmodeRunner
from graphmode.model import ModelConfig

__all__ = ["expected_memory", "print_prefill_table", "run_prefill", "size"]

GIB = 2**30


def run_prefill(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config_name = args.config or ("bench" if cuda else "tiny")
    config = ModelConfig.bench() if config_name == "bench" else ModelConfig.tiny()
    try:
        cases = parse_cases(args.cases or (GPU_CASES if cuda else CPU_CASES),
                            decode_context=1024 if config_name == "bench" else 48)
    except ValueError as error:
        raise SystemExit(f"graphmode bench --workload prefill: --cases: {error}") from None
    wanted = chosen_modes(args.modes, PREFILL_MODES, "prefill")
    try:
        workload = PrefillWorkload.build(config, device, cases, block_size=64 if config_name == "bench" else 16,
                                         attention=args.attention)
    except ValueError as error:
        raise SystemExit(f"graphmode bench --workload prefill: {error}") from None
    buckets = sorted({case.tokens for case in cases})
    decode_batches = sorted({case.sequences for case in cases if case.is_decoding})
    results: dict[str, Any] = {
        "workload": "prefill", "machine": machine(device), "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv), "model": config_name, "attention": type(workload.model.ops).__name__,
        "token_buckets": buckets, "full_graph_batches": decode_batches, "warmup": args.warmup, "steps": args.steps,
        "cases": [{"name": c.name, "sequences": c.sequences, "tokens": c.tokens, "context": list(c.context)}
                  for c in cases],
        "memory_estimate": expected_memory(workload, buckets),
        "latency_ms": {}, "speedup": {}, "max_abs_diff": {}, "prepare_s": {}, "peak_memory_bytes": {},
        "errors": {}, "stats": {},
    }
    print(f"graphmode bench --workload prefill on {results['machine']['device']}, torch {torch.__version__}, "
          f"model {config_name} ({config.num_hidden_layers} layers, {str(config.dtype).replace('torch.', '')}), "
          f"attention {results['attention']}", flush=True)
    print_memory_estimate(results["memory_estimate"])
    modes = build_modes(wanted, workload, args, buckets, decode_batches)
    results["warmup_s"] = {}
    for mode in modes:
        if isinstance(mode, GraphmodeRunner):  # as an engine does at start: every graph, largest first
            started = time.perf_counter()
            mode.runner.warmup(workload.kv_cache, progress=False)
            results["warmup_s"][mode.name] = time.perf_counter() - started
            print(f"{mode.name}: warm-up captured every graph in {results['warmup_s'][mode.name]:.2f} s", flush=True)
    for mode in modes:
        for key in ("latency_ms", "speedup", "max_abs_diff", "prepare_s", "peak_memory_bytes", "errors"):
            results[key][mode.name] = {}
    total = args.warmup + args.steps
    for case in cases:
        steps, rows, eager_sample = workload.steps(case, total), workload.last_tokens(case), None
        for mode in modes:
            got = measure(mode, steps, args.warmup, rows, device)
            record(results, mode.name, case, got)
            if got.error is not None:
                print(f"{mode.name:32s} {case.name:12s} failed: {got.error}", flush=True)
                continue
            if isinstance(mode, Eager):
                eager_sample = got.sample
            if eager_sample is not None and got.sample is not None:
                results["max_abs_diff"][mode.name][case.name] = (got.sample - eager_sample).abs().max().item()
            print(f"{mode.name:32s} {case.name:12s} {got.ms:9.3f} ms", flush=True)
        del steps
        release(device)
    for mode in modes:
        eager = results["latency_ms"].get("eager", {})
        for case in cases:
            ms = results["latency_ms"][mode.name].get(case.name)
            if ms and eager.get(case.name):
                results["speedup"][mode.name][case.name] = eager[case.name] / ms
        if isinstance(mode, GraphmodeRunner):
            stats = mode.runner.stats
            results["stats"][mode.name] = {
                "piecewise_captures": stats.piecewise_captures, "piecewise_replays": stats.piecewise_replays,
                "captures": stats.captures, "replays": stats.replays, "eager_steps": dict(stats.eager_steps),
                "padded_tokens": stats.padded_tokens, "compile_seconds": round(stats.compile_seconds, 2),
            }
    print_prefill_table(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


def build_modes(wanted: list[str], workload: PrefillWorkload, args: argparse.Namespace, buckets: list[int],
                decode_batches: list[int]) -> list[Any]:
    """The modes in table order: eager first (the others are compared with it)."""
    modes: list[Any] = [Eager(workload.model)] if "eager" in wanted else []
    for execute_mode in ("piecewise", "full_and_piecewise"):
        if execute_mode in wanted:
            mode = GraphmodeRunner(workload.model, workload, "cuda", execute_mode=execute_mode,
                                   capture_token_sizes=buckets, capture_batch_sizes=decode_batches or None)
            mode.name = execute_mode
            modes.append(mode)
    for execute_mode in ("piecewise", "full_and_piecewise"):  # the same over the compiled forward, split at attention
        name = f"{execute_mode}+compile"
        if name not in wanted:
            continue
        if workload.device.type != "cuda":
            print(f"{name}: not timed off CUDA (compile=True is refused on the CPU emulator)", flush=True)
        elif not args.no_compile:
            mode = GraphmodeRunner(workload.model, workload, "cuda", execute_mode=execute_mode, compile=True,
                                   capture_token_sizes=buckets, capture_batch_sizes=decode_batches or None)
            mode.name = name
            modes.append(mode)
    if "compile" in wanted:
        if workload.device.type != "cuda":
            print("torch.compile: not timed off CUDA (the CPU emulator records no compiled kernels)", flush=True)
        elif not args.no_compile:
            modes.append(Compiled(workload.model, workload, args.compile_mode))
    return modes


def record(results: dict[str, Any], name: str, case: Case, got: Any) -> None:
    if got.error is not None:
        results["errors"][name][case.name] = got.error
        results["latency_ms"][name][case.name] = None
        return
    results["latency_ms"][name][case.name] = got.ms
    results["prepare_s"][name][case.name] = got.prepare_s
    if got.peak_bytes is not None:
        results["peak_memory_bytes"][name][case.name] = got.peak_bytes


def expected_memory(workload: PrefillWorkload, buckets: list[int]) -> dict[str, int]:
    """What the run should need on the device, in bytes (an estimate):
    weights; the KV cache; the eager activations of the largest step (its
    logits, every token's, plus one layer's MLP and float32 norm and rotary
    temporaries); what piecewise graphs add: one attention-output buffer per
    layer and one logits buffer, both for the largest bucket, and the
    segments' outputs that the break points read (queries, keys, values of
    every layer), kept for every bucket."""
    config, model = workload.model.config, workload.model
    item = torch.empty((), dtype=config.dtype).element_size()
    tokens, layers = max(buckets), config.num_hidden_layers
    q_width = config.num_attention_heads * config.head_dim
    qkv_width = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    activations = tokens * item * (config.vocab_size + 4 * config.intermediate_size) + tokens * 4 * (
        3 * config.hidden_size + 2 * q_width)
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "kv_cache": sum(t.numel() * t.element_size() for pair in workload.kv_cache for t in pair),
        "largest_step_tokens": tokens,
        "eager_activations": activations,
        "piecewise_buffers": layers * tokens * q_width * item + tokens * config.vocab_size * item,
        "piecewise_kept": layers * sum(buckets) * qkv_width * item,
    }


def print_memory_estimate(estimate: dict[str, int]) -> None:
    parts = ", ".join(f"{name.replace('_', ' ')} {size(value)}" for name, value in estimate.items()
                      if name != "largest_step_tokens")
    print(f"expected device memory (largest step {estimate['largest_step_tokens']} tokens): {parts}", flush=True)


def size(value: float) -> str:
    """Bytes as GiB, or MiB below a tenth of a GiB."""
    return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / 2**20:.1f} MiB"


def _short(mode: str) -> str:
    return mode.replace("full_and_piecewise", "full+piecewise").replace("torch.compile ", "compile ")


def print_prefill_table(results: dict[str, Any]) -> None:
    """The latency table, then speed-ups, differences and peak memory."""
    modes = list(results["latency_ms"])
    cases = results["cases"]
    head = f"{'case':12s} {'seqs':>5s} {'tokens':>7s} " + " ".join(f"{_short(m):>24s}" for m in modes)
    print(f"\nmedian step, ms (device-synchronised; {results['steps']} timed after {results['warmup']} warm-up)")
    print(head)
    for case in cases:
        cells = []
        for mode in modes:
            value = results["latency_ms"][mode].get(case["name"])
            cells.append(f"{value:24.3f}" if value is not None else f"{'failed':>24s}")
        print(f"{case['name']:12s} {case['sequences']:5d} {case['tokens']:7d} " + " ".join(cells))
    others = [m for m in modes if m != "eager"]
    if "eager" in modes and others:
        print("\nspeed-up over eager (eager ms / mode ms)")
        print(f"{'case':12s} " + " ".join(f"{_short(m):>24s}" for m in others))
        for case in cases:
            cells = [results["speedup"][m].get(case["name"]) for m in others]
            print(f"{case['name']:12s} " + " ".join(f"{v:23.2f}x" if v else f"{'-':>24s}" for v in cells))
        print("\nmax |logits - eager logits| at each sequence's last token, first timed step")
        print(f"{'case':12s} " + " ".join(f"{_short(m):>24s}" for m in others))
        for case in cases:
            diffs = [results["max_abs_diff"][m].get(case["name"]) for m in others]
            print(f"{case['name']:12s} " + " ".join(f"{v:24.3g}" if v is not None else f"{'-':>24s}" for v in diffs))
    if any(results["peak_memory_bytes"][m] for m in modes):
        print("\npeak device memory while the case ran, GiB (graphs of modes built before included)")
        print(f"{'case':12s} " + " ".join(f"{_short(m):>24s}" for m in modes))
        for case in cases:
            peaks = [results["peak_memory_bytes"][m].get(case["name"]) for m in modes]
            print(f"{case['name']:12s} " + " ".join(f"{v / GIB:24.2f}" if v else f"{'-':>24s}" for v in peaks))
    for mode, stats in results["stats"].items():
        print(f"{mode}: {stats}")
    for mode, errors in results["errors"].items():
        for case, error in errors.items():
            print(f"{mode} {case}: {error}")

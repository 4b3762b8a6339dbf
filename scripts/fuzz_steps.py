"""An engine fuzzer: random legal steps through graph runners, each against eager.

Every vendor (cuda, ascend, camb, maca, ppu) on the CPU emulator, in one
process each (``--workers`` of them at a time), serves random steps of two
kinds of engine over the reference engine and the tiny reference model:

- a **speculative** engine: decode steps that verify drafts (``1 + k`` tokens
  per sequence, uniform or not) and roll back the rejected ones
  (``ReferenceEngine.rollback``), beside plain one-token decodes;
- a **chunked-prefill** engine: prompts fed in chunks, mixed with other
  sequences' decode tokens in one step.

Every few hundred steps a fresh runner is built with another configuration
(execute mode, ``max_q_len``, host-built or device-built steps, Ascend's
update path, sometimes debug mode). Each step may omit ``kv_seqlens_cpu``,
pass it unmarked (the emulator must count it as host memory), and carry
padding rows of no new token at any position (first, middle, last; vLLM pads
``seq_lens`` so). Each step runs through the runner on one KV cache and
through the model eagerly on another, on the same inputs, and is checked:

- **refusal**: the runner raised on a step the docs call legal;
- **mismatch**: its output differs from eager's (or is not finite), or its
  cache differs from eager's at the step's slots;
- **foreign KV bytes**: bytes of its cache that changed outside the slots
  the step writes (the caches start random, so any write shows).

It prints one line, ``steps N, refusals R, mismatches M, foreign KV bytes F``
(and per-vendor details on stderr), and exits 1 unless all three are 0::

    python scripts/fuzz_steps.py --steps 40000
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

VENDORS = ("cuda", "ascend", "camb", "maca", "ppu")
MODES = ("graph", "piecewise", "full_and_piecewise", "eager")
MAX_BATCHES = 8
WIDTH = 4  # block-table columns: 64 tokens per sequence at most
BLOCK_SIZE = 16
CACHE_BLOCKS = MAX_BATCHES * WIDTH + 1  # every sequence at full length, and block 0
TOLERANCE = 1e-4  # graph against eager on the same inputs: only padded shapes' rounding differs


@dataclass
class Tally:
    """What one vendor's fuzz found."""

    vendor: str
    steps: int = 0
    refusals: int = 0
    mismatches: int = 0
    foreign_bytes: int = 0
    kinds: Counter = field(default_factory=Counter)  # steps by kind and by what they carried
    examples: list[str] = field(default_factory=list)  # the first failures, in words
    seconds: float = 0.0

    def note(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)

    def add(self, other: Tally) -> None:
        self.steps += other.steps
        self.refusals += other.refusals
        self.mismatches += other.mismatches
        self.foreign_bytes += other.foreign_bytes


@dataclass
class Config:
    """One runner's configuration, drawn at random."""

    mode: str
    max_q_len: int
    host_inputs: bool
    speculative: bool
    debug: bool
    vendor_options: dict[str, Any]


def draw_config(vendor: str, rng: random.Random) -> Config:
    mode = rng.choice(MODES)
    speculative = rng.random() < 0.5
    # Camb's decode kernel takes one query per sequence (GraphSpec.max_q_len 1): its verify steps run eagerly.
    max_q_len = 1 if vendor == "camb" or not speculative else rng.choice((2, 3))
    options: dict[str, Any] = {}
    if vendor == "ascend":  # multi-token decode graphs only on the graph_update path
        options["update_path"] = "graph_update" if max_q_len > 1 else rng.choice(("graph_update", "task_group"))
    return Config(mode, max_q_len, rng.random() < 0.3, speculative, rng.random() < 0.1, options)


class Served:
    """One runner under fuzz, its engine, model and the two caches."""

    def __init__(self, vendor: str, config: Config, seed: int) -> None:
        import graphmode
        from graphmode.model import ModelConfig, build_reference_model
        from graphmode.model.engine import ReferenceEngine

        self.config, self.rng = config, random.Random(seed)
        model_config = ModelConfig.tiny()
        self.model = build_reference_model(model_config, vendor, "cpu")
        self.engine = ReferenceEngine(CACHE_BLOCKS, BLOCK_SIZE, "cpu", vocab_size=model_config.vocab_size,
                                      table_width=WIDTH, seed=seed, host_inputs=config.host_inputs)
        self.runner = graphmode.build_graph_runner(
            self.model, max_batches=MAX_BATCHES, max_blocks_per_seq=WIDTH, block_size=BLOCK_SIZE, device="cpu",
            vendor=vendor, execute_mode=config.mode, max_q_len=config.max_q_len, debug=config.debug,
            capture_batch_sizes=[1, 2, 4, 8], capture_token_sizes=[4, 8, 16, 32, 64],
            vendor_options=config.vendor_options or None,
        )
        self.graph_cache = self.model.make_kv_cache(CACHE_BLOCKS, BLOCK_SIZE)
        torch.manual_seed(seed)
        for pair in self.graph_cache:  # random, so that any write shows; block 0 included
            for tensor in pair:
                tensor.normal_()
        self.eager_cache = [tuple(t.clone() for t in pair) for pair in self.graph_cache]
        self.views = [self.model.ops.block_view(t, model_config.head_dim).reshape(CACHE_BLOCKS * BLOCK_SIZE, -1)
                      for pair in self.graph_cache for t in pair]
        self.eager_views = [self.model.ops.block_view(t, model_config.head_dim).reshape(CACHE_BLOCKS * BLOCK_SIZE, -1)
                            for pair in self.eager_cache for t in pair]
        self.prompt_left: dict[int, int] = {}  # sequences still prefilling: prompt tokens not fed yet

    # -- the engine's schedule --------------------------------------------------

    def schedule(self, tally: Tally) -> tuple[Any, list[int], list[int]]:
        """The next step (StepInputs), its sequences in row order (padding
        rows left out) and, for a verify step, the drafts each carried
        (rolled back in part after it)."""
        rng, engine = self.rng, self.engine
        capacity = WIDTH * BLOCK_SIZE
        for seq in list(engine.sequences.values()):  # finished: near the table's reach, or by chance
            if seq.kv_len + self.config.max_q_len + 16 > capacity or rng.random() < 0.03:
                engine.finish(seq.seq_id)
                self.prompt_left.pop(seq.seq_id, None)
        while len(engine.sequences) < MAX_BATCHES and (not engine.sequences or rng.random() < 0.15):
            self.prompt_left[engine.add()] = rng.randrange(1, 40)
        seqs = list(engine.sequences)
        rng.shuffle(seqs)
        seqs = seqs[: rng.randint(1, len(seqs))]
        prefilling = [s for s in seqs if self.prompt_left.get(s)]
        drafts: list[int] = []
        if prefilling:  # chunked prefill: a chunk of each prompt, a decode token for the others
            lengths = []
            for s in seqs:
                left = self.prompt_left.get(s, 0)
                chunk = min(left, rng.choice((1, 3, 8, 16))) if left else 1
                if left:
                    self.prompt_left[s] = left - chunk
                lengths.append(chunk)
            step = engine.prefill(seqs, lengths)
            tally.kinds["chunked prefill" if any(self.prompt_left.get(s) for s in prefilling) else "prefill"] += 1
        elif self.config.speculative and rng.random() < 0.8:
            k = rng.randint(0, max(self.config.max_q_len, 3) - 1)  # past max_q_len too: those run eagerly
            uniform = rng.random() < 0.8
            lengths = [1 + (k if uniform else rng.randint(0, k)) for _ in seqs]
            step = engine.decode(seqs, lengths)
            drafts = [n - 1 for n in lengths]
            tally.kinds["verify" if uniform else "verify, unequal"] += 1
        else:
            step = engine.decode(seqs)
            tally.kinds["decode"] += 1
        return self._varied(step, tally), seqs, drafts

    def _varied(self, step: Any, tally: Tally) -> Any:
        """The step with padding rows of no token, ``kv_seqlens_cpu`` left
        out or unmarked, at random."""
        from graphmode.model.engine import with_padding_rows

        rng = self.rng
        batch = step.attn_metadata.batch_size
        if batch < MAX_BATCHES and rng.random() < 0.5:
            total = batch + rng.randint(1, MAX_BATCHES - batch)
            rows = sorted(rng.sample(range(total), total - batch))
            step = with_padding_rows(step, rows)
            where = {"first" if r == 0 else "last" if r == total - 1 else "middle" for r in rows}
            tally.kinds.update(f"padding row {w}" for w in where)
        attn = step.attn_metadata
        chance = rng.random()
        if chance < 0.3:
            step = dataclasses.replace(step, attn_metadata=attn.replace(kv_seqlens_cpu=None))
            tally.kinds["kv_seqlens_cpu omitted"] += 1
        elif chance < 0.45:  # a plain CPU tensor, as an engine on the emulator passes it without mark_host
            step = dataclasses.replace(step, attn_metadata=attn.replace(kv_seqlens_cpu=attn.kv_seqlens_cpu.clone()))
            tally.kinds["kv_seqlens_cpu unmarked"] += 1
        return step

    # -- one step, checked --------------------------------------------------

    def run(self, step: Any, seqs: list[int], drafts: list[int], tally: Tally) -> None:
        attn = step.attn_metadata
        slots = attn.kv_start_indices.reshape(-1)
        slots = slots[slots >= 0].long()
        before = [view.clone() for view in self.views]
        with torch.inference_mode():
            try:
                graph = self.runner(step.input_ids, step.position_ids, self.graph_cache, attn).clone()
            except Exception as error:  # a legal step refused
                tally.refusals += 1
                tally.note(f"refused ({self.describe(step)}): {type(error).__name__}: {str(error)[:300]}")
                self.model(step.input_ids, step.position_ids, self.graph_cache, attn)  # keep the caches alike
                graph = None
            eager = self.model(step.input_ids, step.position_ids, self.eager_cache, attn)
        tally.steps += 1
        if graph is not None:
            self.check(step, graph, eager, slots, before, tally)
        if drafts:  # the verifier accepts some drafts of each sequence, rejects the rest
            for seq_id, count in zip(seqs, drafts):
                self.engine.rollback(seq_id, self.rng.randint(0, count))

    def check(self, step: Any, graph: torch.Tensor, eager: torch.Tensor, slots: torch.Tensor,
              before: list[torch.Tensor], tally: Tally) -> None:
        written = torch.zeros(CACHE_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        written[slots] = True
        foreign = 0
        for view, old in zip(self.views, before):
            changed = (view != old) & ~written[:, None]
            foreign += int(changed.sum()) * view.element_size()
        if foreign:
            tally.foreign_bytes += foreign
            tally.note(f"{foreign} foreign KV bytes ({self.describe(step)})")
        bad_output = graph.shape != eager.shape or not bool(torch.isfinite(graph).all()) \
            or not torch.allclose(graph, eager, atol=TOLERANCE, rtol=TOLERANCE)
        bad_cache = any(not torch.allclose(g[slots], e[slots], atol=TOLERANCE, rtol=TOLERANCE)
                        for g, e in zip(self.views, self.eager_views))
        if bad_output or bad_cache:
            tally.mismatches += 1
            what = "output" if bad_output else "cache at the step's slots"
            diff = (graph - eager).abs().max().item() if graph.shape == eager.shape else float("nan")
            tally.note(f"mismatch in the {what} ({self.describe(step)}): output {diff:.3g} off eager")
        if foreign or bad_cache:  # start the next step from eager's cache again
            for view, eager_view in zip(self.views, self.eager_views):
                view.copy_(eager_view)

    def describe(self, step: Any) -> str:
        attn = step.attn_metadata
        config = self.config
        return (f"{config.mode}, max_q_len {config.max_q_len}, {'host' if config.host_inputs else 'device'} steps"
                f"{', debug' if config.debug else ''}, is_decoding={attn.is_decoding}, q_seqlens "
                f"{attn.q_seqlens.tolist()}, kv_seqlens_cpu {'omitted' if attn.kv_seqlens_cpu is None else 'given'}")


def fuzz_vendor(vendor: str, steps: int, seed: int, epoch: int = 300) -> Tally:
    """``steps`` random steps on ``vendor``, a fresh runner every ``epoch``."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the derived kv_seqlens_cpu's warning, once per runner
    started = time.perf_counter()
    tally = Tally(vendor)
    rng = random.Random(f"{seed}-{vendor}")
    served: Served | None = None
    while tally.steps < steps:
        if served is None or tally.steps % epoch == 0:
            config = draw_config(vendor, rng)
            served = Served(vendor, config, rng.randrange(2**31))
            tally.kinds[f"runner {config.mode}"] += 1
        served.run(*served.schedule(tally), tally)
    tally.seconds = time.perf_counter() - started
    return tally


def _fuzz(args: tuple[str, int, int]) -> Tally:
    return fuzz_vendor(*args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40000, help="steps in all, shared by the vendors")
    parser.add_argument("--vendors", default=",".join(VENDORS), help="comma-separated vendors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(len(VENDORS), os.cpu_count() or 1),
                        help="processes (one vendor each at a time); 0 runs in this process")
    args = parser.parse_args(argv)
    vendors = [v for v in args.vendors.split(",") if v]
    share = [args.steps // len(vendors) + (i < args.steps % len(vendors)) for i in range(len(vendors))]
    jobs = [(vendor, count, args.seed) for vendor, count in zip(vendors, share)]
    if args.workers:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            tallies = pool.map(_fuzz, jobs, chunksize=1)
    else:
        tallies = [_fuzz(job) for job in jobs]
    total = Tally("all")
    for tally in tallies:
        total.add(tally)
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(tally.kinds.items()))
        print(f"{tally.vendor}: {tally.steps} steps in {tally.seconds:.0f} s, {tally.refusals} refusals, "
              f"{tally.mismatches} mismatches, {tally.foreign_bytes} foreign KV bytes; {kinds}", file=sys.stderr)
        for example in tally.examples:
            print(f"  {example}", file=sys.stderr)
    print(f"steps {total.steps}, refusals {total.refusals}, mismatches {total.mismatches}, "
          f"foreign KV bytes {total.foreign_bytes}")
    return 0 if total.refusals == total.mismatches == total.foreign_bytes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

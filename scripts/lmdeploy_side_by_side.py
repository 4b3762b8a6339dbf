"""lmdeploy eager, lmdeploy's own graphs and lmdeploy with graphmode, side by side in one process.

    python scripts/lmdeploy_side_by_side.py [--arch llama qwen3 mixtral] [--perf llama] [--layers 16]
        [--hidden 1024] [--requests 64] [--batches 1,8,32,128,256] [--rounds 10] [--startups 2]
        [--decode-steps 256] [--skip-tokens] [--vl] [--spec eagle eagle3] [--piecewise-tokens 2048]
        [--json out.json]

Needs a GPU and lmdeploy's PyTorch engine (0.18.0; ../shared/realclients/lmdeploy prepares it
offline). For each architecture, a random-weight Hugging Face model with a word-level tokenizer
is saved, then, each engine alone in the process:

1. tokens: the same greedy requests (``--requests`` of 1..2,000 prompt tokens, every other one
   sharing a prefix with its neighbour, 16..256 new tokens, prefix caching on, prefill chunked at
   1,024 tokens) through lmdeploy eager, lmdeploy's own graphs, graphmode (execute_mode "graph")
   and graphmode in "full_and_piecewise", compared request for request; the graph memory lmdeploy's
   graphs and graphmode's give back on ``reset_graph_runner()`` (then captured again); tokens
   before and after lmdeploy's sleep(level=1) and wakeup() (prefix caching off: lmdeploy keeps its
   prefix trie over the rebuilt cache);
2. for the ``--perf`` architectures, lmdeploy's graphs and graphmode (full_and_piecewise), each warm
   in a process of its own: start-up (construction to first token, ``--startups`` times each, taking
   turns, after an untimed run of each engine has filled the compile caches), then, taking turns
   figure by figure for ``--rounds`` rounds, decode throughput per batch size (tokens/s of the whole
   engine: ``--decode-steps`` more decode steps of a warm batch over the time they add) and
   prefill-heavy steps (1x2048, 16x512, 16x2048 prompt tokens, one new token), each the median of the
   rounds; last, the graph memory each engine's runner gives back on reset.

``--vl`` adds a random Qwen2-VL (``lmdeploy_vl_model.py``: M-RoPE positions in every step, an image in
every third request) and ``--spec`` random EAGLE / EAGLE-3 drafts of a Llama (``lmdeploy_spec_models.py``),
each through lmdeploy eager, its own graphs and graphmode, tokens compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ARCHS = ("llama", "qwen3", "qwen2", "mixtral")


def save_model(arch: str, path: str, layers: int, hidden: int) -> None:
    """A random ``arch`` model (bf16) with a word-level tokenizer of 1,003 words."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(1000)} | {"<unk>": 1000, "<s>": 1001, "</s>": 1002}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)
    common = dict(vocab_size=1003, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1001,
                  eos_token_id=1002, tie_word_embeddings=False)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    extra = {"head_dim": hidden // 8} if arch == "qwen3" else {}
    if arch == "mixtral":
        extra = {"num_local_experts": 8, "num_experts_per_tok": 2}
    torch.manual_seed(0)
    model = model_class(config_class(**common, **extra))
    # Wider logits than the default initialisation gives, so that greedy tokens do not hang on
    # near-ties that any change of GEMM shape (a padded bucket) may flip.
    model.lm_head.weight.data.mul_(5)
    model.to(torch.bfloat16).save_pretrained(path)


def requests(count: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Prompts of 1..2,000 words, every other one sharing a prefix with its neighbour, and their new tokens."""
    rng = random.Random(seed)
    prompts: list[str] = []
    new_tokens = []
    for i in range(count):
        length = rng.randint(1, 2000)
        words = [f"t{rng.randrange(1000)}" for _ in range(length)]
        if i % 2 and prompts:  # prefix caching: reuse the previous prompt's first words
            shared = prompts[-1].split()[: rng.randint(1, 1024)]
            words = shared + words[: max(1, length - len(shared))]
        prompts.append(" ".join(words))
        new_tokens.append(rng.randint(16, 256))
    return prompts, new_tokens


#: lmdeploy's piecewise prefill graphs up to this many tokens (--piecewise-tokens), or None: off.
PIECEWISE_TOKENS: list[int | None] = [None]


def engine(path: str, *, eager: bool, graphmode: str | None, max_batch: int, prefill_tokens: int = 1024,
           prefix_caching: bool = True, **pipeline_kwargs):
    """A pipeline; ``graphmode`` is None (lmdeploy's own) or graphmode's execute mode; prefill chunked at
    ``prefill_tokens``; ``pipeline_kwargs`` (``speculative_config``) go to ``pipeline()``."""
    from lmdeploy import PytorchEngineConfig, pipeline

    import graphmode.integrations.lmdeploy as gm_lmdeploy

    if graphmode is None:
        gm_lmdeploy.disable()
    else:
        gm_lmdeploy.enable(execute_mode=graphmode)
    try:
        return pipeline(path, backend_config=PytorchEngineConfig(
            eager_mode=eager, cache_max_entry_count=0.06, max_batch_size=max_batch, session_len=4096,
            max_prefill_token_num=prefill_tokens, enable_prefix_caching=prefix_caching,
            piecewise_cudagraph_max_tokens=PIECEWISE_TOKENS[0]), **pipeline_kwargs)
    finally:
        gm_lmdeploy.disable()


def agent(pipe):
    return pipe.async_engine.engine.executor.model_agent


def generate(pipe, prompts: list[str], new_tokens: list[int]) -> list[list[int]]:
    from lmdeploy import GenerationConfig

    gens = [GenerationConfig(max_new_tokens=n, do_sample=False, ignore_eos=True) for n in new_tokens]
    return [out.token_ids for out in pipe(prompts, gen_config=gens)]


def timed(pipe, prompts: list[str], new: int) -> float:
    import torch
    from lmdeploy import GenerationConfig

    torch.cuda.synchronize()
    start = time.perf_counter()
    pipe(prompts, gen_config=GenerationConfig(max_new_tokens=new, do_sample=False, ignore_eos=True))
    return time.perf_counter() - start


def graph_memory(pipe) -> int:
    """Bytes the engine's graph runner gives back on reset (then captured again by lmdeploy's warm-up)."""
    import torch

    model_agent = agent(pipe)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.mem_get_info()[0]
    model_agent.reset_graph_runner()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    freed = torch.cuda.mem_get_info()[0] - before
    model_agent.warmup()
    return freed


def stats_of(pipe) -> str:
    runner = agent(pipe).patched_model
    stats = getattr(runner, "stats", None)
    if stats is None:
        return f"lmdeploy's own {type(runner).__name__}"
    return (f"{type(runner).__name__} on vendor {runner.vendor.name!r}: {stats.summary()}; captures took "
            f"{runner.capture_seconds:.2f} s, {runner.graph_bytes / 2**20:.1f} MiB")


def compare(name: str, got: list[list[int]], want: list[list[int]]) -> int:
    same = sum(a == b for a, b in zip(got, want))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(got, want) if a != b]
    detail = f" (first differing token of the others at {sorted(firsts)[:8]})" if firsts else ""
    print(f"  tokens {name}: {same} of {len(want)} requests equal{detail}")
    return same


def close(pipe) -> None:
    import torch

    pipe.close()
    gc.collect()
    torch.cuda.empty_cache()


def sleep_wake(path: str, prompts: list[str], new_tokens: list[int], max_batch: int, result: dict) -> None:
    """Greedy tokens before and after lmdeploy's sleep(level=1) and wakeup(), for lmdeploy's own graphs and
    graphmode's (full_and_piecewise), each engine alone, prefix caching off: lmdeploy's sleep rebuilds the KV
    cache but keeps its prefix trie, so cached prefixes would read garbage after wake in both engines."""
    after = {}
    for name, mode in (("lmdeploy", None), ("graphmode_fp", "full_and_piecewise")):
        pipe = engine(path, eager=False, graphmode=mode, max_batch=max_batch, prefix_caching=False)
        before = generate(pipe, prompts, new_tokens)
        runner = agent(pipe).patched_model
        captures = runner.stats.captures if hasattr(runner, "stats") else None
        pipe._run(coro=pipe.async_engine.sleep(1)).result()  # what lmdeploy's /sleep endpoint does
        pipe.async_engine.wakeup()
        after[name] = generate(pipe, prompts, new_tokens)
        again = f"{runner.stats.captures - captures} graphs captured again, " if captures is not None else ""
        line = (f"{again}tokens after wake equal before in {sum(a == b for a, b in zip(after[name], before))} "
                f"of {len(before)}")
        result.setdefault("sleep_wake", {})[name] = line
        print(f"  {name}: sleep(level=1) + wakeup(), prefix caching off: {line}")
        close(pipe)
    result["sleep_wake"]["after_wake_graphmode_vs_lmdeploy"] = compare(
        "after wake, graphmode vs lmdeploy's graphs", after["graphmode_fp"], after["lmdeploy"])


def tokens_phase(arch: str, path: str, args: argparse.Namespace, result: dict) -> None:
    """Each engine alone: the request mix's tokens, graph memory, sleep and wake-up."""
    prompts, new_tokens = requests(args.requests)
    print(f"  {args.requests} requests: prompts {min(len(p.split()) for p in prompts)}.."
          f"{max(len(p.split()) for p in prompts)} tokens, {min(new_tokens)}..{max(new_tokens)} new, prefix caching on")
    tokens = {}
    for name, eager, mode in (("eager", True, None), ("lmdeploy", False, None), ("graphmode", False, "graph"),
                              ("graphmode_fp", False, "full_and_piecewise")):
        pipe = engine(path, eager=eager, graphmode=mode, max_batch=max(args.batches))
        tokens[name] = generate(pipe, prompts, new_tokens)
        if name in ("lmdeploy", "graphmode"):
            result.setdefault("graph_memory_bytes", {})[name] = memory = graph_memory(pipe)
            print(f"  {name}: graph memory given back on reset {memory / 2**20:.1f} MiB")
        if name.startswith("graphmode"):
            print(f"  {name}: {stats_of(pipe)}")
        close(pipe)
    sleep_wake(path, prompts[:8], new_tokens[:8], max(args.batches), result)
    result["tokens"] = {
        "graphmode_vs_lmdeploy_graphs": compare("graphmode vs lmdeploy's graphs", tokens["graphmode"],
                                                tokens["lmdeploy"]),
        "graphmode_vs_eager": compare("graphmode vs lmdeploy eager", tokens["graphmode"], tokens["eager"]),
        "lmdeploy_graphs_vs_eager": compare("lmdeploy's graphs vs lmdeploy eager", tokens["lmdeploy"],
                                            tokens["eager"]),
        "full_and_piecewise_vs_lmdeploy_graphs": compare("graphmode full_and_piecewise vs lmdeploy's graphs",
                                                         tokens["graphmode_fp"], tokens["lmdeploy"]),
        "full_and_piecewise_vs_eager": compare("graphmode full_and_piecewise vs lmdeploy eager",
                                               tokens["graphmode_fp"], tokens["eager"]),
        "requests": len(prompts),
    }


def three_engines(label: str, path: str, prompts: list, new_tokens: list[int], max_batch: int, result: dict,
                  **pipeline_kwargs) -> None:
    """Greedy tokens of ``prompts`` through lmdeploy eager, lmdeploy's own graphs and graphmode (execute mode
    "graph"), each engine alone in the process, compared request for request under ``result[label]``."""
    tokens = {}
    for name, eager, mode in (("eager", True, None), ("lmdeploy", False, None), ("graphmode", False, "graph")):
        pipe = engine(path, eager=eager, graphmode=mode, max_batch=max_batch, **pipeline_kwargs)
        tokens[name] = generate(pipe, prompts, new_tokens)
        if name == "graphmode":
            print(f"  {label} {name}: {stats_of(pipe)}")
        close(pipe)
    result[label] = {
        "graphmode_vs_lmdeploy_graphs": compare(f"{label} graphmode vs lmdeploy's graphs", tokens["graphmode"],
                                                tokens["lmdeploy"]),
        "graphmode_vs_eager": compare(f"{label} graphmode vs lmdeploy eager", tokens["graphmode"], tokens["eager"]),
        "lmdeploy_graphs_vs_eager": compare(f"{label} lmdeploy's graphs vs lmdeploy eager", tokens["lmdeploy"],
                                            tokens["eager"]),
        "requests": len(prompts),
    }


def vl_phase(args: argparse.Namespace, report: dict) -> None:
    """A random Qwen2-VL (M-RoPE positions in every step, images in every third request) through the
    three engines. lmdeploy turns prefix caching off for it."""
    from lmdeploy_vl_model import save_vl_model, vl_requests

    path = os.path.join(tempfile.mkdtemp(), "tiny-qwen2-vl")
    save_vl_model(path)
    prompts = vl_requests(args.requests)
    new_tokens = [random.Random(i).randint(16, 128) for i in range(len(prompts))]
    print(f"\n== qwen2_vl (M-RoPE): {args.requests} requests, every third with an image, {min(new_tokens)}.."
          f"{max(new_tokens)} new tokens")
    three_engines("qwen2_vl", path, prompts, new_tokens, max(args.batches), report.setdefault("qwen2_vl", {}))


def spec_phase(method: str, args: argparse.Namespace, report: dict) -> None:
    """A random Llama target with a random ``method`` draft (``eagle``: an echoing draft, so that drafts
    get accepted) through the three engines, 3 speculative tokens: lmdeploy's verify steps (4 tokens per
    sequence) and its proposer's steps. lmdeploy's CUDA backend needs FlashAttention-3 for them."""
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        raise SystemExit(f"--spec {method}: lmdeploy 0.18's speculative decoding on CUDA needs FlashAttention-3 "
                         "(flash_attn_interface), which is not installed: install a wheel of it built for "
                         "this torch first") from None
    from lmdeploy_spec_models import save_draft, spec_config

    target = os.path.join(tempfile.mkdtemp(), "tiny-llama")
    save_model("llama", target, args.layers, args.hidden)
    draft = os.path.join(os.path.dirname(target), f"draft-{method}")
    save_draft(method, target, draft, echo=method == "eagle")
    prompts, new_tokens = requests(args.requests)
    print(f"\n== llama with a random {method} draft, 3 speculative tokens: {args.requests} requests")
    three_engines(f"spec_{method}", target, prompts, new_tokens, max(args.batches), report.setdefault(
        f"spec_{method}", {}), speculative_config=spec_config(draft, 3))


PREFILL_CASES = {"1x2048": (1, 2048), "16x512": (16, 512), "16x2048": (16, 2048)}


TURN_ENGINES = {"graphmode": "full_and_piecewise", "lmdeploy": None}
ANSWER = "@answer "  # marks a timing child's answers among what its engine prints


def decode_rate(pipe, batch: int, steps: int) -> float:
    """Tokens/s of ``steps`` more decode steps of a warm batch: the time they add to a short request."""
    prompts_b = [" ".join(f"t{(7 * i + j) % 1000}" for j in range(32)) for i in range(batch)]
    short = timed(pipe, prompts_b, 16)
    long = timed(pipe, prompts_b, 16 + steps)
    return batch * steps / max(long - short, 1e-9)


def prefill_seconds(pipe, case: str, round_: int) -> float:
    """One prefill-heavy step (fresh words: no prefix-cache hits, one new token)."""
    batch, length = PREFILL_CASES[case]
    prompts_c = [" ".join(f"t{(round_ * 977 + 17 * i + j) % 1000}" for j in range(length)) for i in range(batch)]
    return timed(pipe, prompts_c, 1)


def serve(path: str, name: str, args: argparse.Namespace) -> None:
    """A timing child: builds one engine (start-up: construction to first token), then answers the
    parent's requests, one JSON line each, until stdin closes."""
    start = time.perf_counter()
    # Every timed batch's prompts prefill in one step (256 x 32 tokens): with chunks, the scheduler
    # interleaves decode steps of a part of the batch with the rest's prefill as timing decides.
    pipe = engine(path, eager=False, graphmode=TURN_ENGINES[name], max_batch=max(args.batches),
                  prefill_tokens=max(args.batches) * 32)
    timed(pipe, ["t1 t2"], 1)
    startup = time.perf_counter() - start
    for batch in args.batches:  # first calls of each size (allocator, lazy captures) stay out of the figures
        decode_rate(pipe, batch, 16)
    for case in PREFILL_CASES:
        prefill_seconds(pipe, case, -1)
    print(ANSWER + json.dumps({"startup_s": startup}), flush=True)
    for line in sys.stdin:
        what, arg, round_ = line.split()
        if what == "decode":
            value: object = decode_rate(pipe, int(arg), args.decode_steps)
        elif what == "prefill":
            value = prefill_seconds(pipe, arg, int(round_))
        elif what == "memory":
            value = graph_memory(pipe)
        else:
            value = stats_of(pipe)
        print(ANSWER + json.dumps(value), flush=True)
    close(pipe)


class Child:
    """One engine in a process of its own (an engine closed in the same process leaves threads that skewed
    the next engine's figures by up to 2x), asked for one figure at a time."""

    def __init__(self, path: str, name: str, args: argparse.Namespace) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", name, "--serve-model", path, "--batches",
             ",".join(map(str, args.batches)), "--decode-steps", str(args.decode_steps),
             *(["--piecewise-tokens", str(args.piecewise_tokens)] if args.piecewise_tokens else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.startup_s = self.read()["startup_s"]

    def read(self):
        while True:  # the engine's own prints pass through
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"a timing child exited with {self.proc.wait()} (its output above)")
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
            print(line, end="")

    def ask(self, what: str, arg: object = "-", round_: int = 0):
        self.proc.stdin.write(f"{what} {arg} {round_}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise SystemExit("a timing child did not exit within 300 s of its stdin closing (killed): a hang") from None


def perf_phase(path: str, args: argparse.Namespace, result: dict) -> None:
    """lmdeploy's graphs and graphmode (full_and_piecewise: its decode graphs, lmdeploy's prefill), both
    warm in processes of their own, taking turns figure by figure (the order swapped every round), so
    that drift of the machine over the run falls on both alike: start-up, decode throughput per batch
    size, prefill-heavy steps; each figure the median of ``--rounds``."""
    # Each engine once, not timed, fills the machine's compile caches (Triton's kernels, Inductor's),
    # so that neither timed start-up pays them: on 2026-12-02 graphmode's first captures after an
    # untimed lmdeploy engine still took 12.7 s (0.5-0.8 s once its own run had filled them).
    for name in TURN_ENGINES:
        Child(path, name, args).close()
    # Start-ups one at a time (each timed alone), the engines taking turns; the last of each serves the rounds.
    startups: dict[str, list[float]] = {name: [] for name in TURN_ENGINES}
    children = {}
    for turn in range(args.startups):
        for name in (list(TURN_ENGINES) if turn % 2 == 0 else list(reversed(TURN_ENGINES))):
            child = Child(path, name, args)
            startups[name].append(child.startup_s)
            print(f"  {name}: start-up {child.startup_s:.1f} s (construction to first token, fresh process)",
                  flush=True)
            if turn == args.startups - 1:
                children[name] = child
            else:
                child.close()
    rates: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in children}
    prefill: dict[str, dict[str, list[float]]] = {name: {c: [] for c in PREFILL_CASES} for name in children}
    for round_ in range(args.rounds):
        order = list(children) if round_ % 2 == 0 else list(reversed(children))
        for batch in args.batches:
            for name in order:
                rates[name][batch].append(children[name].ask("decode", batch, round_))
        for case in PREFILL_CASES:
            for name in order:
                prefill[name][case].append(children[name].ask("prefill", case, round_))
    memory = {}
    for name, child in children.items():
        print(f"  {name}: {child.ask('stats')}")
        memory[name] = child.ask("memory")
        child.close()
    print("  start-up (s, construction to first token, each start alone in a fresh process, the engines taking turns), "
          "and the graph memory each engine's runner gives back on reset:")
    for name in children:
        print(f"    {name:9s}: start-ups {' '.join(f'{s:.1f}' for s in startups[name])}  median "
              f"{statistics.median(startups[name]):.1f} s   graph memory {memory[name] / 2**20:.1f} MiB")
    print(f"  decode throughput (tokens/s of the engine, {args.decode_steps} steps, median of {args.rounds} rounds "
          "taking turns), graphmode / lmdeploy's graphs:")
    ratios = {}
    for batch in args.batches:
        own, ours = statistics.median(rates["lmdeploy"][batch]), statistics.median(rates["graphmode"][batch])
        ratios[batch] = ours / own
        spread = " / ".join(f"{min(rates[n][batch]):.0f}-{max(rates[n][batch]):.0f}" for n in ("lmdeploy", "graphmode"))
        print(f"    batch {batch:4d}: lmdeploy {own:10.0f}  graphmode {ours:10.0f}  {ratios[batch]:.3f}x   "
              f"(range over rounds {spread})")
    print(f"    median over batch sizes {statistics.median(ratios.values()):.3f}x, lowest {min(ratios.values()):.3f}x")
    print("  prefill-heavy steps (ms, median of rounds), graphmode full_and_piecewise against lmdeploy's own mode:")
    for case in PREFILL_CASES:
        own_s, ours_s = statistics.median(prefill["lmdeploy"][case]), statistics.median(prefill["graphmode"][case])
        print(f"    {case:8s}: lmdeploy {own_s * 1e3:8.1f}  graphmode {ours_s * 1e3:8.1f}  speed {own_s / ours_s:.3f}x")
    result.update(startup_s=startups, graph_memory_bytes=memory, decode_rates=rates, prefill_s=prefill,
                  throughput_ratio=ratios)


def run_arch(arch: str, args: argparse.Namespace, report: dict, perf: bool) -> None:
    path = os.path.join(tempfile.mkdtemp(), f"tiny-{arch}")
    save_model(arch, path, args.layers, args.hidden)
    result: dict = {"arch": arch}
    print(f"\n== {arch}: {args.layers} layers, hidden {args.hidden}")
    if not args.skip_tokens:
        tokens_phase(arch, path, args, result)
    if perf:
        perf_phase(path, args, result)
    report[arch] = result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="*", default=["llama", "qwen3", "mixtral"], choices=ARCHS)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--perf", nargs="*", default=["llama"], help="architectures to time (start-up, "
                        "throughput, prefill-heavy steps) besides comparing tokens")
    parser.add_argument("--rounds", type=int, default=10, help="turns of each engine at each figure")
    parser.add_argument("--decode-steps", type=int, default=256, help="decode steps a throughput figure times")
    parser.add_argument("--startups", type=int, default=2, help="timed start-ups of each engine, taking turns")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--piecewise-tokens", type=int, default=None,
                        help="turn on lmdeploy's piecewise prefill graphs up to this many tokens, in every engine")
    parser.add_argument("--vl", action="store_true", help="also a random Qwen2-VL (M-RoPE, images)")
    parser.add_argument("--spec", nargs="*", default=[], choices=["eagle", "eagle3"],
                        help="also speculative decoding with a random draft of these methods (needs FlashAttention-3)")
    parser.add_argument("--skip-tokens", action="store_true", help="time only: leave out the token comparison")
    parser.add_argument("--serve", choices=list(TURN_ENGINES), help=argparse.SUPPRESS)  # a timing child
    parser.add_argument("--serve-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from graphmode.devices import require_gpu

    require_gpu(__file__)
    args.batches = [int(b) for b in args.batches.split(",")]
    PIECEWISE_TOKENS[0] = args.piecewise_tokens
    if args.serve:
        serve(args.serve_model, args.serve, args)
        return
    report: dict = {}
    for arch in args.arch:
        run_arch(arch, args, report, perf=arch in args.perf)
    if args.vl:
        vl_phase(args, report)
    for method in args.spec:
        spec_phase(method, args, report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1, default=str)


if __name__ == "__main__":
    main()

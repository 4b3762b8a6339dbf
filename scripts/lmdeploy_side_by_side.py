"""lmdeploy eager, lmdeploy's own graphs and lmdeploy with graphmode, side by side in one process.

    python scripts/lmdeploy_side_by_side.py [--arch llama qwen3 mixtral] [--perf llama] [--layers 16]
        [--hidden 1024] [--requests 64] [--batches 1,8,32,128,256] [--rounds 2] [--json out.json]

Needs a GPU and lmdeploy's PyTorch engine (0.18.0; ../shared/realclients/lmdeploy prepares it
offline). For each architecture, a random-weight Hugging Face model with a word-level tokenizer
is saved, then, each engine alone in the process:

1. tokens: the same greedy requests (``--requests`` of 1..2,000 prompt tokens, every other one
   sharing a prefix with its neighbour, 16..256 new tokens, prefix caching on, prefill chunked at
   1,024 tokens) through lmdeploy eager, lmdeploy's own graphs, graphmode (execute_mode "graph")
   and graphmode in "full_and_piecewise", compared request for request; the graph memory lmdeploy's
   graphs and graphmode's give back on ``reset_graph_runner()`` (then captured again); tokens
   before and after lmdeploy's sleep(level=1) and wakeup();
2. for the ``--perf`` architectures, lmdeploy's graphs and graphmode taking turns (``--rounds``),
   each turn in a process of its own: start-up (construction to first token), decode throughput
   per batch size (tokens/s of the whole engine: ``--decode-steps`` more decode steps of a warm
   batch over the time they add, median of ``--repeats``) and prefill-heavy steps (1x2048, 16x512,
   16x2048 prompt tokens, one new token).
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


def engine(path: str, *, eager: bool, graphmode: str | None, max_batch: int):
    """A pipeline; ``graphmode`` is None (lmdeploy's own) or graphmode's execute mode."""
    from lmdeploy import PytorchEngineConfig, pipeline

    import graphmode.integrations.lmdeploy as gm_lmdeploy

    if graphmode is None:
        gm_lmdeploy.disable()
    else:
        gm_lmdeploy.enable(execute_mode=graphmode)
    try:
        return pipeline(path, backend_config=PytorchEngineConfig(
            eager_mode=eager, cache_max_entry_count=0.06, max_batch_size=max_batch, session_len=4096,
            max_prefill_token_num=1024, enable_prefix_caching=True))
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


def sleep_wake(pipe, prompts: list[str], new_tokens: list[int]) -> str:
    """Greedy tokens before and after lmdeploy's sleep(level=1) and wakeup()."""
    before = generate(pipe, prompts, new_tokens)
    runner = agent(pipe).patched_model
    captures = runner.stats.captures if hasattr(runner, "stats") else None
    pipe._run(coro=pipe.async_engine.sleep(1)).result()  # what lmdeploy's /sleep endpoint does
    pipe.async_engine.wakeup()
    after = generate(pipe, prompts, new_tokens)
    again = f"{runner.stats.captures - captures} graphs captured again, " if captures is not None else ""
    return f"{again}tokens after wake equal before in {sum(a == b for a, b in zip(after, before))} of {len(before)}"


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
        if name in ("lmdeploy", "graphmode_fp"):
            line = sleep_wake(pipe, prompts[:8], new_tokens[:8])
            result.setdefault("sleep_wake", {})[name] = line
            print(f"  {name}: sleep(level=1) + wakeup(): {line}")
        if name.startswith("graphmode"):
            print(f"  {name}: {stats_of(pipe)}")
        close(pipe)
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


PREFILL_CASES = {"1x2048": (1, 2048), "16x512": (16, 512), "16x2048": (16, 2048)}


TURN_ENGINES = {"lmdeploy": None, "graphmode": "full_and_piecewise"}


def one_turn(path: str, name: str, args: argparse.Namespace) -> dict:
    """One engine's timings, in a process of its own: start-up (construction to first token), decode
    throughput per batch size (the median of ``--repeats`` measurements of ``--decode-steps`` more
    decode steps of a warm batch over the time they add), prefill-heavy steps (fresh words each call:
    no prefix-cache hits; the median of ``--repeats`` after a warm call)."""
    start = time.perf_counter()
    pipe = engine(path, eager=False, graphmode=TURN_ENGINES[name], max_batch=max(args.batches))
    timed(pipe, ["t1 t2"], 1)
    turn: dict = {"startup_s": time.perf_counter() - start, "throughput": {}, "prefill_s": {}}
    for batch in args.batches:
        prompts_b = [" ".join(f"t{(7 * i + j) % 1000}" for j in range(32)) for i in range(batch)]
        timed(pipe, prompts_b, 16)
        rates = []
        for _ in range(args.repeats):
            short = timed(pipe, prompts_b, 16)
            long = timed(pipe, prompts_b, 16 + args.decode_steps)
            rates.append(batch * args.decode_steps / max(long - short, 1e-9))
        turn["throughput"][batch] = statistics.median(rates)
    for case, (batch, length) in PREFILL_CASES.items():
        took = []
        for call in range(args.repeats + 1):
            prompts_c = [" ".join(f"t{(args.turn_round * 977 + call * 131 + 17 * i + j) % 1000}" for j in range(length))
                         for i in range(batch)]
            took.append(timed(pipe, prompts_c, 1))
        turn["prefill_s"][case] = statistics.median(took[1:])
    turn["stats"] = stats_of(pipe)
    close(pipe)
    return turn


def perf_phase(path: str, args: argparse.Namespace, result: dict) -> None:
    """lmdeploy's graphs and graphmode (full_and_piecewise: its decode graphs, lmdeploy's prefill) taking
    turns, each turn a process of its own (an engine closed in the same process leaves threads that
    skewed the next engine's figures by up to 2x): start-up, decode throughput, prefill-heavy steps."""
    turns: dict[str, list[dict]] = {name: [] for name in TURN_ENGINES}
    for round_ in range(args.rounds):
        for name in (list(TURN_ENGINES) if round_ % 2 == 0 else list(reversed(TURN_ENGINES))):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, os.path.abspath(__file__), "--turn", name, "--turn-model", path,
                                "--turn-round", str(round_), "--turn-json", out.name, "--batches",
                                ",".join(map(str, args.batches)), "--decode-steps", str(args.decode_steps),
                                "--repeats", str(args.repeats)], check=True)
                with open(out.name) as written:
                    turns[name].append(json.load(written))
            print(f"  round {round_} {name}: start-up {turns[name][-1]['startup_s']:.1f} s; "
                  f"{turns[name][-1]['stats']}")
    startups = {name: " / ".join(f"{t['startup_s']:.1f}" for t in ts) for name, ts in turns.items()}
    print("  start-up, construction to first token in a fresh process (s, each round): "
          + ", ".join(f"{name} {times}" for name, times in startups.items()))
    print("  decode throughput (tokens/s of the engine, median of rounds), graphmode / lmdeploy's graphs:")
    ratios = {}
    for batch in args.batches:
        own = [t["throughput"][str(batch)] for t in turns["lmdeploy"]]
        ours = [t["throughput"][str(batch)] for t in turns["graphmode"]]
        ratios[batch] = statistics.median(ours) / statistics.median(own)
        print(f"    batch {batch:4d}: lmdeploy {statistics.median(own):10.0f}  graphmode {statistics.median(ours):10.0f}"
              f"  {ratios[batch]:.3f}x   (rounds: {[round(x) for x in own]} / {[round(x) for x in ours]})")
    print(f"    median over batch sizes {statistics.median(ratios.values()):.3f}x, lowest {min(ratios.values()):.3f}x")
    print("  prefill-heavy steps (ms, median of rounds), graphmode full_and_piecewise against lmdeploy's own mode:")
    for case in PREFILL_CASES:
        own_s = statistics.median(t["prefill_s"][case] for t in turns["lmdeploy"])
        ours_s = statistics.median(t["prefill_s"][case] for t in turns["graphmode"])
        print(f"    {case:8s}: lmdeploy {own_s * 1e3:8.1f}  graphmode {ours_s * 1e3:8.1f}  speed {own_s / ours_s:.3f}x")
    result.update(turns=turns, throughput_ratio=ratios)


def run_arch(arch: str, args: argparse.Namespace, report: dict, perf: bool) -> None:
    path = os.path.join(tempfile.mkdtemp(), f"tiny-{arch}")
    save_model(arch, path, args.layers, args.hidden)
    result: dict = {"arch": arch}
    print(f"\n== {arch}: {args.layers} layers, hidden {args.hidden}")
    tokens_phase(arch, path, args, result)
    if perf:
        perf_phase(path, args, result)
    report[arch] = result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["llama", "qwen3", "mixtral"], choices=ARCHS)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--perf", nargs="*", default=["llama"], help="architectures to time (start-up, "
                        "throughput, prefill-heavy steps) besides comparing tokens")
    parser.add_argument("--rounds", type=int, default=4, help="turns of each engine in the timing")
    parser.add_argument("--decode-steps", type=int, default=256, help="decode steps a throughput figure times")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of a figure within a turn")
    parser.add_argument("--turn", choices=list(TURN_ENGINES), help=argparse.SUPPRESS)  # one timing turn, in a child
    parser.add_argument("--turn-model", help=argparse.SUPPRESS)
    parser.add_argument("--turn-round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--turn-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from graphmode.devices import require_gpu

    require_gpu(__file__)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.turn:
        with open(args.turn_json, "w") as out:
            json.dump(one_turn(args.turn_model, args.turn, args), out)
        return
    report: dict = {}
    for arch in args.arch:
        run_arch(arch, args, report, perf=arch in args.perf)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Draft-model graphs: a draft model's runner, built with
``share_pool_with=`` the target's runner, captures its steps into the
target's memory pool; ``examples/draft_model.py`` drafts with it and
``examples/serve_hf.py --draft-model`` / ``--draft-layers`` serves with it,
greedy tokens those of plain greedy decoding.

On the CPU emulator: the conformance suite's draft checks for every
installed vendor; the pool's sharing and its reset; greedy tokens with draft
graphs, with an eager drafter and without speculation, equal; the command
line; the measurement script; docs/engines.md's code is the example's."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode import ConfigError
from graphmode.emulator import EmulatedPool
from graphmode.model import ModelConfig, build_reference_model
from graphmode.plugins import installed_vendor_names
from graphmode_conformance import DraftModelTests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "scripts"))


class TestDraftConformance(DraftModelTests):
    """The suite's draft-model checks, for every installed vendor on the emulator."""

    @pytest.fixture(params=installed_vendor_names())
    def vendor(self, request) -> graphmode.Vendor:
        return graphmode.load_vendor(request.param)

    @pytest.fixture
    def device(self) -> torch.device:
        return torch.device("cpu")

    @pytest.fixture
    def vendor_options(self) -> None:
        """Each vendor's default options: its option variants run through
        ``graphmode conformance`` (tests/test_conformance_suite.py)."""
        return None


# -- the pool -------------------------------------------------------------------


def _pair(**draft_options):
    """A target runner and a one-layer draft model's runner sharing its pool,
    each with its cache; both warmed up (buckets 1 and 2)."""
    config = ModelConfig.tiny()
    target = build_reference_model(config, device="cpu")
    draft = build_reference_model(dataclasses.replace(config, num_hidden_layers=1), device="cpu", seed=3)
    sizes = dict(max_batches=2, max_blocks_per_seq=2, block_size=16, capture_batch_sizes=[1, 2])
    target_runner = graphmode.build_graph_runner(target, **sizes)
    draft_runner = graphmode.build_graph_runner(draft, **sizes, max_q_len=2, share_pool_with=target_runner, **draft_options)
    caches = target.make_kv_cache(5, 16), draft.make_kv_cache(5, 16)
    target_runner.warmup(caches[0], progress=False)
    draft_runner.warmup(caches[1], progress=False)
    return target_runner, draft_runner, caches


def _pools(runner) -> list:
    return [runner.graph(bucket, q_len).graph.pool() for bucket, q_len in runner.captured_graphs]


def test_the_draft_runners_graphs_are_captured_into_the_targets_pool():
    target, draft, _ = _pair()
    pools = _pools(target) + _pools(draft)
    assert len(pools) == 2 + 4 and all(pool is pools[0] for pool in pools)
    assert isinstance(pools[0], EmulatedPool) and pools[0].num_graphs == 6  # every capture recorded in it


def test_reset_keeps_a_shared_pool_while_the_other_runner_holds_graphs():
    target, draft, caches = _pair()
    pool = _pools(target)[0]
    draft.reset()  # the target's graphs live on in the pool: later draft captures join it
    draft.warmup(caches[1], progress=False)
    assert all(p is pool for p in _pools(draft))
    draft.reset()
    target.reset()  # no graph left in it: the next capture makes a new pool, shared again
    target.warmup(caches[0], q_lens=[1], progress=False)
    draft.warmup(caches[1], progress=False)
    fresh = _pools(target)[0]
    assert fresh is not pool and all(p is fresh for p in _pools(draft))


def test_share_pool_with_something_else_than_a_runner_of_this_device_is_refused():
    model = build_reference_model(ModelConfig.tiny(), device="cpu")
    sizes = dict(max_batches=2, max_blocks_per_seq=2, block_size=16)
    with pytest.raises(ConfigError, match="share_pool_with=EmulatedPool: pass the GraphRunner"):
        graphmode.build_graph_runner(model, **sizes, share_pool_with=EmulatedPool())
    first = graphmode.build_graph_runner(model, **sizes, device="cpu:0")
    # Devices by index, as cuda:0 and cuda:1; an unindexed device is taken for any index of its type.
    with pytest.raises(ConfigError, match="that runner's graphs are on cpu:0, this one's on cpu:1; a memory pool belongs"):
        graphmode.build_graph_runner(model, **sizes, device="cpu:1", share_pool_with=first)
    graphmode.build_graph_runner(model, **sizes, device="cpu", share_pool_with=first)


# -- serving with a draft model -----------------------------------------------------

transformers = pytest.importorskip("transformers")

import draft_model  # noqa: E402
import serve_hf  # noqa: E402

from graphmode.integrations.huggingface import load_model, random_config  # noqa: E402

BLOCK_SIZE, WIDTH, MAX_BATCH, K = 4, 8, 4, 2


def _requests() -> list[serve_hf.Request]:
    generator = torch.Generator().manual_seed(2)
    return [serve_hf.Request(torch.randint(3, 128, (n,), generator=generator).tolist(), new, arrival=2 * i)
            for i, (n, new) in enumerate(zip((5, 9, 3, 7), (12, 9, 14, 10)))]


def _serve(target, speculate: int, draft: str | None = None):
    """Every request served; (tokens per request, step counts, target runner, drafter)."""
    kv_cache = target.make_kv_cache(MAX_BATCH * WIDTH + 1, BLOCK_SIZE)
    runner = graphmode.build_graph_runner(target, max_batches=MAX_BATCH, max_blocks_per_seq=WIDTH,
                                          block_size=BLOCK_SIZE, max_q_len=speculate + 1)
    batch = serve_hf.PagedBatch(MAX_BATCH * WIDTH + 1, BLOCK_SIZE, WIDTH, torch.device("cpu"))
    drafter = serve_hf.draft
    if draft is not None:
        small = draft_model.first_layers(target, 1)
        drafter = draft_model.build_draft(small, runner, batch, MAX_BATCH * WIDTH + 1, execute_mode=draft)
    requests = _requests()
    steps = serve_hf.serve(runner, kv_cache, batch, requests, max_batch=MAX_BATCH, speculate=speculate, drafter=drafter)
    return [r.output for r in requests], steps, runner, drafter


@pytest.fixture(scope="module")
def served():
    target = load_model(random_config("llama-tiny"))
    return {name: _serve(target, *how) for name, how in
            {"plain": (0,), "draft graphs": (K, "graph"), "draft eager": (K, "eager")}.items()}


def test_draft_graphs_give_the_tokens_of_plain_greedy_decoding(served):
    plain, _, _, _ = served["plain"]
    tokens, steps, runner, drafter = served["draft graphs"]
    assert tokens == plain
    assert steps["verify"] >= 5 and steps["accepted"] >= 1 and "decode" not in steps
    # Every draft step was a graph step (captured once per (bucket, q_len), replayed after); only prefills ran eagerly.
    stats = drafter.runner.stats
    first = sum(drafter.first_steps.values())
    assert first == steps["verify"] and stats.captures + stats.replays == K * first, stats.summary()
    assert dict(stats.eager_steps) == {"prefill": steps["prefill"]}
    # Some first steps carried two tokens for a request that accepted every draft, padding the others.
    assert drafter.first_steps[2] >= 1 and drafter.padding >= 1
    assert {q_len for _, q_len in drafter.runner.captured_graphs} == {1, 2}
    assert dict(runner.stats.eager_steps) == {"prefill": steps["prefill"]}


def test_an_eager_drafter_proposes_what_the_draft_graphs_propose(served):
    graphs, eager = served["draft graphs"], served["draft eager"]
    assert eager[0] == graphs[0] and eager[1] == graphs[1]  # the same tokens, drafts and acceptances
    assert eager[3].runner.stats.captures == 0 and eager[3].first_steps == graphs[3].first_steps


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(random_config("llama-tiny", vocab_size=96))
    other.save_pretrained(tmp_path)
    assert serve_hf.main(["--random-config", "llama-tiny", "--draft-model", str(tmp_path), "--requests", "1"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bars
    assert last.startswith(
        "serve_hf.py: the draft model's vocabulary has 96 tokens, the target's 128: its drafts would be other tokens' ids"
    )


def test_serve_hf_serves_with_a_random_draft_model_of_a_smaller_config(tmp_path, capsys):
    """``--draft-model DIR`` on the CPU: a random one-layer draft (hidden 32)
    of the target's vocabulary, saved by transformers; the tokens are those
    served without speculation, every draft step a graph step."""
    torch.manual_seed(1)
    small = random_config("llama-tiny", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    transformers.AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path)
    common = ["--random-config", "llama-tiny", "--requests", "3", "--max-batch", "2", "--prompt-len", "5",
              "--max-new-tokens", "8", "--block-size", "4"]
    assert serve_hf.main(common) == 0
    plain = capsys.readouterr().out.splitlines()
    assert serve_hf.main([*common, "--draft-model", str(tmp_path), "--speculate", "2"]) == 0
    drafted = capsys.readouterr().out.splitlines()
    assert drafted[-1].startswith("request 0: [") and drafted[-1] == plain[-1]
    assert "'verify': " in drafted[1] and "'decode'" not in drafted[1]
    assert re.match(r"draft runner: \d+ captures .*, \d+ replays, eager steps: \d+ prefill; padding", drafted[2]), drafted[2]


def test_draft_layers_must_leave_the_draft_smaller_than_the_target(capsys):
    assert serve_hf.main(["--random-config", "llama-tiny", "--draft-layers", "2", "--requests", "1"]) == 2
    assert "--draft-layers 2: the draft takes 1 to 1 of the target's 2 layers" in capsys.readouterr().err


def test_the_measurement_prints_three_figures_and_identical_tokens(capsys):
    import draft_speed

    assert draft_speed.main(["--device", "cpu", "--config", "llama-tiny", "--dtype", "float32", "--requests", "3",
                             "--max-batch", "2", "--prompt-len", "6", "--new-tokens", "6", "--speculate", "2",
                             "--draft-layers", "1", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    figures = re.findall(r"^(no speculation|verify graphs only|draft graphs): +[\d.]+ tokens/s", out, re.M)
    assert figures == ["no speculation", "verify graphs only", "draft graphs"], out
    assert "greedy tokens identical in all three" in out and out.rstrip().endswith("PASS"), out


# -- the docs ----------------------------------------------------------------------


def test_docs_engines_shows_the_examples_code_word_for_word():
    source = (ROOT / "examples" / "draft_model.py").read_text()
    regions = {name: textwrap.dedent(body).strip("\n") for name, body in
               re.findall(r"# --8<-- \[start:(\w+)\]\n(.*?)\n[ \t]*# --8<-- \[end:\1\]", source, re.S)}
    text = (ROOT / "docs" / "engines.md").read_text()
    section = text[text.index("## Draft-model graphs"):]
    section = section[:section.index("\n## ")]
    shown = [b.strip("\n") for b in re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)]
    assert shown == [regions["build"], regions["propose"]], "docs/engines.md's draft code and examples/draft_model.py differ"
    assert sorted(regions) == ["build", "propose"], "every region of the example is shown"

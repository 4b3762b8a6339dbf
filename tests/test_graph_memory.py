"""Graph memory planned before the KV cache (``runner.plan_memory``,
``graphmode.plan_graph_memory``) and measured at warm-up
(``runner.graph_memory``), on the CPU emulator, whose figures are its
allocation record (``graphmode.memory.meter``): the plan on a probe cache of
a few blocks (a sample of each family's graphs captured, the rest
estimated) must be what the warm-up into the real cache takes, within 2%,
every family of the execute mode and every query length included, and a
plan that leaves graphs out must show against the warm-up. docs/engines.md's example
runs as written. (On a GPU: ``scripts/graph_memory.py``.)"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.memory import MemoryMeter
from graphmode.model import ModelConfig, build_reference_model

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
ARGS = dict(max_batches=4, max_blocks_per_seq=4, block_size=BLOCK, max_q_len=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_reference_model(ModelConfig.tiny(), device="cpu")


def close(planned: int, taken: int) -> bool:
    """Within 2% (the issue's bound on a GPU: 5% or 32 MiB)."""
    return abs(planned - taken) <= 0.02 * taken


def _runner(model, mode):
    return graphmode.build_graph_runner(model, execute_mode=mode, **ARGS)


# graphs per family at ARGS: full, buckets 1..4 x q_len 1..2; piecewise, token buckets 1, 2, 4, 8
FAMILIES = {"graph": {"full": 8}, "piecewise": {"piecewise": 4}, "full_and_piecewise": {"full": 8, "piecewise": 4}}


@pytest.mark.parametrize("mode", list(FAMILIES))
def test_the_plan_on_a_probe_cache_is_what_the_warmup_into_the_real_cache_takes(model, mode):
    runner = _runner(model, mode)
    plan = runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK))
    assert runner.captured_graphs == [] and (runner.family("piecewise") is None or runner.family("piecewise").captured_buckets == [])
    runner.warmup(model.make_kv_cache(num_cache_blocks=96, block_size=BLOCK))
    actual = runner.graph_memory
    assert actual is not None and runner.memory_plan is plan
    families = FAMILIES[mode]
    # Every family of the mode is planned and measured, each with memory of its own.
    assert set(plan.families) == set(actual.families) == set(families)
    assert all(plan.families[name] > 0 and actual.families[name] > 0 for name in families)
    captured = len(runner.captured_graphs) + (len(runner.family("piecewise").captured_buckets) if runner.family("piecewise") else 0)
    assert plan.graphs == actual.graphs == sum(families.values()) == captured
    # The statistics count the graphs the warm-up captured, not the planning's thrown away (were twice).
    stats = runner.stats
    assert (stats.captures, stats.piecewise_captures) == (families.get("full", 0), families.get("piecewise", 0))
    assert stats.warmup_captures == families.get("full", 0)
    # The cache's size sizes no graph memory; the graphs left out of the sample are a line's estimate.
    assert close(plan.bytes, actual.bytes) and actual.bytes > 0
    # What a family keeps beside its pool counts: the full graphs' shared logits (bucket 4 x q_len 2
    # tokens, float32) live through every capture; the piecewise shared logits (token bucket 8) too.
    vocab = model.config.vocab_size
    for name, tokens in (("full", 4 * 2), ("piecewise", 8)):
        if name in families:
            assert actual.families[name] >= tokens * vocab * 4
    assert plan.kept > 0  # the input buffers the runner keeps across reset(): already out of the budget
    assert "(+0.0 MiB, " in runner.memory_report()


def test_a_plan_that_leaves_graphs_out_shows_against_the_warmup(model):
    """Planned for one-token decode only, warmed up for q_len 1 and 2 (as a
    plan leaving a family out would be): the q_len-2 graphs' memory is what
    the warm-up took beyond the plan, against a runner planned for both."""
    taken = {}
    for q_lens in ([1, 2], [1]):
        runner = _runner(model, "graph")
        plan = runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK), q_lens=q_lens)
        runner.warmup(model.make_kv_cache(num_cache_blocks=96, block_size=BLOCK))
        actual = runner.graph_memory
        assert actual is not None and actual.graphs == 8 and plan.graphs == 4 * len(q_lens)
        assert sum(plan.families.values()) == plan.bytes + plan.kept
        taken[len(q_lens)] = (plan.bytes, actual.bytes, runner.memory_report())
    (planned_all, took_all, _), (planned_one, took_one, report) = taken[2], taken[1]
    assert took_one == took_all and close(planned_all, took_all) and planned_all > planned_one
    difference = re.search(r"\((\+[\d.]+) MiB, (\+[\d.]+)%\)", report)
    assert difference is not None and float(difference.group(2)) > 0, report


def test_a_plan_from_a_runner_built_and_dropped_includes_its_buffers(model):
    """``graphmode.plan_graph_memory`` builds a runner, plans and drops it:
    its figure is what a new runner and its first warm-up take together."""
    probe = model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK)
    arguments = {**ARGS, "max_q_len": 1, "execute_mode": "full_and_piecewise"}
    plan = graphmode.plan_graph_memory(model, probe, **arguments)
    assert plan.kept == 0 and set(plan.families) == {"full", "piecewise"}
    kv_cache = model.make_kv_cache(num_cache_blocks=96, block_size=BLOCK)
    with MemoryMeter(torch.device("cpu")) as meter:
        runner = graphmode.build_graph_runner(model, **arguments)
        runner.warmup(kv_cache)
        used = meter.used()
    assert close(plan.bytes, used)


def test_until_the_warmup_the_report_says_so_rather_than_compare_the_plan_with_itself(model):
    """The planning warm-up is the plan's (``plan.warmup``), not the runner's
    warm-up: before the real ``warmup()``, ``graph_memory`` is None and the
    report says the warm-up has not run (it compared the plan with itself:
    "warm-up took" the planned bytes, +0.0%)."""
    runner = _runner(model, "graph")
    plan = runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK), q_lens=[1])
    assert plan.warmup.graphs == 4 and plan.bytes > 0
    assert runner.graph_memory is None
    assert runner.memory_report() == f"graph memory: planned {plan.bytes / 2**20:.1f} MiB, not warmed up yet"
    runner.warmup(model.make_kv_cache(num_cache_blocks=8, block_size=BLOCK), q_lens=[1])
    assert runner.graph_memory is not None and runner.graph_memory.graphs == 4
    assert "warm-up took" in runner.memory_report()


def test_a_probe_in_another_layout_is_refused_as_a_layout_not_as_a_block_size(model):
    """A probe in another layout ([blocks, kv_heads, block_size, head_dim])
    puts its 2 KV heads where the layout keeps the block size: the error
    names the layout and make_kv_cache, not "build the runner with block_size=2"."""
    runner = _runner(model, "graph")
    probe = [(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
             for k, v in model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK)]
    with pytest.raises(graphmode.InputError) as refused:
        runner.plan_memory(probe)
    message = str(refused.value)
    assert "another head count, head size or layout would be misread" in message, message
    assert "block_size=2" not in message
    assert runner.graph_memory is None and runner.memory_plan is None


def test_planning_is_refused_once_graphs_are_captured_and_is_zero_in_eager_mode(model):
    runner = _runner(model, "graph")
    runner.warmup(model.make_kv_cache(num_cache_blocks=8, block_size=BLOCK), q_lens=[1])
    with pytest.raises(graphmode.ConfigError, match=r"plan_memory\(\) on a runner that has captured graphs"):
        runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK))
    eager_runner = _runner(model, "eager")
    eager = eager_runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK))
    assert eager.bytes == 0 and eager.families == {}
    eager_runner.warmup(model.make_kv_cache(num_cache_blocks=8, block_size=BLOCK))  # nothing to capture
    assert eager_runner.memory_report() == "graph memory: none (execute mode 'eager': no graphs)"


def _engines_block() -> str:
    text = (ROOT / "docs" / "engines.md").read_text()
    section = text[text.index("## Graph memory before the KV cache"):]
    section = section[:section.index("\n## ")]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block


def test_the_engines_doc_example_runs_as_written():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_engines_block(), "docs/engines.md", "exec"), {"__name__": "engines_doc"})
    report = printed.getvalue().strip()
    assert report.startswith("graph memory: planned "), report
    if not torch.cuda.is_available():  # on the emulator, within 2%
        share = re.search(r"\(([+-][\d.]+) MiB, ([+-][\d.]+)%\)", report)
        assert share is not None and abs(float(share.group(2))) <= 2, report
    assert "piecewise" in report and "full" in report


def test_the_plan_captures_a_sample_of_each_family_and_estimates_the_rest(model):
    """Twelve buckets: the plan captures the largest two and four spread
    over the rest (the smallest among them), estimates the other six on the
    line through the four, and comes within 2% of the warm-up, which
    captures all twelve."""
    from graphmode.memory.plan import Sample

    buckets = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert Sample.pick(buckets[::-1]) == [16, 14, 12, 7, 4, 1]
    runner = graphmode.build_graph_runner(model, max_batches=16, max_blocks_per_seq=4, block_size=BLOCK,
                                          capture_batch_sizes=buckets)
    plan = runner.plan_memory(model.make_kv_cache(num_cache_blocks=4, block_size=BLOCK))
    assert (plan.sampled, plan.estimated, plan.graphs) == (6, 6, 12)
    assert plan.warmup.graphs == 6 and "6 graphs captured, 6 estimated" in plan.warmup.method
    runner.warmup(model.make_kv_cache(num_cache_blocks=96, block_size=BLOCK))
    actual = runner.graph_memory
    assert actual is not None and actual.graphs == 12 and close(plan.bytes, actual.bytes)


def test_the_line_through_the_sampled_graphs():
    from graphmode.memory.plan import _line

    assert _line([], 5) == 0.0
    assert _line([(4, 10)], 1) == 10.0
    assert _line([(1, 3), (2, 5), (4, 9)], 3) == pytest.approx(7.0)

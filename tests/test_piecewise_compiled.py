"""compile=True in piecewise modes: the compiled forward split at the break points.

On the CPU: the split forward (``graphmode.families.piecewise.compiled``) under a
piecewise warm-up session gives the eager model's answer, Dynamo breaks its
graphs at every attention call and compiles each layer's code once for all
layers; a runner asking for it on the CPU emulator, or for a vendor without
the ``inductor_graphs`` capability, is refused as in graph mode. On a CUDA GPU
(the tests skip elsewhere): compiled piecewise runners equal eager for
prefill, chunked, mixed and decode steps, and replay Inductor's kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ConfigError
from graphmode.families.piecewise.breaks import LiveStep, find_attention_ops, intercepted
from graphmode.families.piecewise.compiled import SplitForward, compiled_shapes
from graphmode.families.piecewise.graphs import shape_only
from graphmode.families.piecewise.segments import BreakBuffers, EagerForward
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine
from graphmode.token_buckets import default_token_sizes

MODES = ["piecewise", "full_and_piecewise"]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor kernels in graphs need a CUDA GPU")


class GraphRecorder:
    """A torch.compile backend that keeps every graph Dynamo hands it and
    runs it as traced (no Inductor: the split is Dynamo's work)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(graph)
        return graph.forward


class SplitCheck:
    """A model, its split compiled forward and an eager copy of its cache:
    ``step(step, bucket)`` runs a piecewise warm-up forward (break points
    eager, on the live tokens) over the compiled model, padded to
    ``bucket`` tokens, and the eager model on the same step."""

    def __init__(self, layers: int = 2, dynamic: bool = True) -> None:
        torch._dynamo.reset()
        config = dataclasses.replace(ModelConfig.tiny(), num_hidden_layers=layers)
        self.model = build_reference_model(config, "cuda", "cpu")
        self.ops = find_attention_ops(self.model)
        self.recorder = GraphRecorder()
        self.forward = SplitForward(torch.compile(self.model, backend=self.recorder, dynamic=dynamic), self.ops)
        self.engine = ReferenceEngine(64, 16, "cpu", vocab_size=config.vocab_size, table_width=8, seed=7)
        self.caches = self.model.make_kv_cache(64, 16), self.model.make_kv_cache(64, 16)
        self.buffers = BreakBuffers(64)
        self.breaks = 0

    @torch.inference_mode()
    def step(self, step, bucket: int) -> None:
        tokens = step.num_tokens
        ids = torch.zeros((1, bucket), dtype=torch.int64)
        positions = torch.zeros((1, bucket), dtype=torch.int64)
        ids[:, :tokens], positions[:, :tokens] = step.input_ids, step.position_ids
        session = EagerForward(LiveStep(step.attn_metadata, tokens, bucket), self.buffers)
        with intercepted(self.ops, session):
            split = self.forward(input_ids=ids, position_ids=positions, past_key_values=self.caches[0],
                                 attn_metadata=shape_only(step.attn_metadata))
        self.breaks = len(session.views)
        assert not self.forward._installed, "the split forward keeps the session's interceptors (and its graphs)"
        eager = self.model(step.input_ids, step.position_ids, self.caches[1], step.attn_metadata)
        torch.testing.assert_close(split[:, :tokens], eager, atol=1e-5, rtol=1e-5)
        for graph_pair, eager_pair in zip(*self.caches):
            for graph, eager in zip(graph_pair, eager_pair):
                torch.testing.assert_close(graph, eager, atol=1e-5, rtol=0)


def test_the_split_compiled_forward_equals_eager_and_breaks_at_every_attention_call():
    check = SplitCheck()
    engine = check.engine
    seqs = [engine.add() for _ in range(3)]
    check.step(engine.prefill(seqs, [5, 1, 9]), 16)  # prefill
    assert check.breaks == 2  # every layer's attention ran in the session, outside Dynamo's graphs
    check.step(engine.prefill(seqs, [4, 1, 2]), 8)  # chunks after cached tokens
    newcomer = engine.add()
    check.step(engine.prefill([*seqs, newcomer], [1, 1, 1, 6]), 16)  # mixed: decodes and a chunk
    check.step(engine.decode([*seqs, newcomer]), 4)  # decode
    for graph in check.recorder.graphs:  # no graph holds a KV write or an attention kernel
        targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
        assert not any("index_put" in name or "scatter" in name or "softmax" in name for name in targets), targets


def test_a_layer_adds_no_compilation_and_a_shape_seen_before_none():
    """Every layer runs the same code objects: four layers compile as many
    graphs as two. A second step of a bucket compiles nothing; with
    dynamic=False a new bucket compiles every graph anew, no more."""
    counts = {}
    for layers in (2, 4):
        check = SplitCheck(layers, dynamic=False)
        seqs = [check.engine.add() for _ in range(2)]
        check.step(check.engine.prefill(seqs, [3, 9]), 16)
        first = len(check.recorder.graphs)
        check.step(check.engine.prefill(seqs, [2, 4]), 16)
        assert len(check.recorder.graphs) == first, "a second step of bucket 16 compiled again"
        check.step(check.engine.prefill(seqs, [1, 5]), 8)
        counts[layers] = (first, len(check.recorder.graphs) - first)
    assert counts[2] == counts[4], f"graphs compiled (first bucket, second bucket) by layer count: {counts}"
    assert counts[2][0] == counts[2][1] > 0


@pytest.mark.parametrize("mode", MODES)
def test_compile_in_piecewise_modes_is_refused_on_the_cpu_emulator(mode):
    with pytest.raises(ConfigError, match="compile=True on the CPU graph emulator: .* Use compile=True on a GPU"):
        tiny_setup(execute_mode=mode, compile=True)


@pytest.mark.parametrize("mode", MODES)
def test_compile_in_piecewise_modes_is_refused_for_a_vendor_without_inductor_graphs(mode):
    model = build_reference_model(ModelConfig.tiny(), "ascend", "cpu")
    with pytest.raises(ConfigError, match="vendor 'ascend' does not declare that Inductor's kernels run inside"):
        graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cpu",
                                     vendor="ascend", execute_mode=mode, compile=True)


def test_compiled_shapes_count_the_token_buckets_and_the_full_graph_buckets():
    """With dynamic=False each is a compilation of every compiled frame."""
    def config(mode: str) -> graphmode.RunnerConfig:
        return graphmode.RunnerConfig(8, 2, 16, torch.device("cpu"), execute_mode=mode, capture_token_sizes=[4, 8, 16])

    assert compiled_shapes(config("graph"), (1, 2, 4, 8)) == 4
    assert compiled_shapes(config("piecewise"), (1, 2, 4, 8)) == 3
    assert compiled_shapes(config("full_and_piecewise"), (1, 2, 4, 8)) == 7
    default = graphmode.RunnerConfig(8, 2, 16, torch.device("cpu"), execute_mode="piecewise")
    assert compiled_shapes(default, (1, 2, 4, 8)) == len(default_token_sizes(8))


# -- on a CUDA GPU -------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("mode", MODES)
def test_compiled_piecewise_runner_equals_eager_and_replays_inductor_kernels(mode):
    setup = tiny_setup(device="cuda", max_batches=12, cache_blocks=64, execute_mode=mode, compile=True,
                       capture_token_sizes=[4, 8, 16, 32, 64], capture_batch_sizes=[1, 4, 12])
    engine, runner = setup.engine, setup.runner

    def check(step, what: str) -> None:
        with torch.inference_mode():
            graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
        torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4, msg=what)
        assert setup.caches_close(atol=1e-4), f"KV caches differ after {what}"

    runner.warmup(setup.graph_cache, progress=False)
    assert runner.stats.compile_seconds > 0
    for length in (1, 5, 16, 29):
        check(engine.prefill([engine.add()], [length]), f"prefill of {length}")
    first = engine.live()
    check(engine.prefill(first, [7, 3, 12, 2]), "chunked prefill after cached tokens")
    for chunk in (7, 12):
        newcomer = engine.add()
        check(engine.prefill([*first, newcomer], [1] * len(first) + [chunk]), f"mixed step, {chunk}-token chunk")
    live = engine.live()
    for round_ in range(3):
        check(engine.decode(live), f"decode of {len(live)}, round {round_}")
    stats = runner.stats
    assert stats.piecewise_replays >= 7 and not stats.eager_steps
    assert stats.piecewise_captures == 5  # the warm-up's: every step replayed
    if mode == "full_and_piecewise":
        assert stats.replays == 3
    step = engine.prefill(live, [3] * len(live))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile, torch.inference_mode():
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events()]
    assert any(name.startswith("triton_") for name in kernels), kernels  # Inductor's, replayed in the segments


@cuda_only
def test_dynamic_false_counts_token_buckets_against_the_recompile_limit():
    """With dynamic=False every token bucket (and, in full_and_piecewise,
    every batch bucket) compiles anew: more than Dynamo's limit is refused."""
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or config.cache_size_limit
    sizes = list(range(1, limit + 2))
    with pytest.raises(ConfigError, match=f"compiles each of the {len(sizes) + 2} buckets anew"):
        tiny_setup(device="cuda", execute_mode="full_and_piecewise", compile=True, compile_options={"dynamic": False},
                   capture_token_sizes=sizes, capture_batch_sizes=[2, 4])

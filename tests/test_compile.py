"""compile=True: Inductor's kernels inside graphmode's graphs.

Where it is refused (and why) runs everywhere; the real thing needs a CUDA
GPU: ``pytest tests/test_compile.py`` on a machine with one.
"""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ConfigError

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor kernels in graphs need a CUDA GPU")


def _model():
    return graphmode.model.build_reference_model(graphmode.model.ModelConfig.tiny(), "cuda", "cpu")


def test_compile_is_refused_on_the_cpu_emulator():
    with pytest.raises(ConfigError, match="compile=True on the CPU graph emulator: .* Use compile=True on a GPU"):
        graphmode.build_graph_runner(_model(), max_batches=4, max_blocks_per_seq=2, block_size=16, device="cpu", compile=True)


def test_compile_is_refused_for_a_vendor_without_the_inductor_graphs_capability():
    assert "inductor_graphs" not in graphmode.load_vendor("ascend").info.capabilities
    with pytest.raises(ConfigError, match="vendor 'ascend' does not declare that Inductor's kernels run inside its graphs"):
        model = graphmode.model.build_reference_model(graphmode.model.ModelConfig.tiny(), "ascend", "cpu")
        graphmode.build_graph_runner(
            model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cpu", vendor="ascend", compile=True,
        )


def test_the_cuda_vendor_declares_inductor_graphs():
    assert "inductor_graphs" in graphmode.load_vendor("cuda").info.capabilities


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compile": "yes"}, "compile='yes': must be True or False"),
        ({"compile_options": {"dynamic": False}}, "given with compile=False; pass compile=True"),
        ({"compile": True, "compile_options": {"mode": "reduce-overhead"}},
         "mode='reduce-overhead' records CUDA graphs of its own"),
        ({"compile": True, "compile_options": {"options": {"triton.cudagraphs": True}}},
         "records CUDA graphs inside graphmode's graphs"),
        ({"compile": True, "compile_options": ["dynamic"]}, "must be a dict of torch.compile arguments"),
    ],
)
def test_bad_compile_settings_are_refused_naming_the_value(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        graphmode.RunnerConfig(4, 2, 16, torch.device("cpu"), **options)


def test_compile_options_default_to_one_dynamic_compilation():
    config = graphmode.RunnerConfig(4, 2, 16, torch.device("cpu"), compile=True, compile_options={"mode": "default"})
    assert config.torch_compile_options == {"dynamic": True, "mode": "default"}


def test_eager_mode_compiles_nothing():
    """The eager switch is the reference path: no compilation, even asked."""
    setup = tiny_setup(execute_mode="eager", compile=True)
    seqs = setup.prefill(2)
    graph, eager = setup.decode(seqs)
    assert torch.equal(graph, eager) and setup.runner.stats.compile_seconds == 0


@cuda_only
def test_compiled_graphs_equal_eager_and_replay_inductor_kernels():
    """Two buckets over the compiled tiny model: warm-up compiles and
    captures, steps replay, outputs equal the uncompiled model's, and the
    replayed graph runs Inductor's Triton kernels around the CUDA plugin's
    opaque KV write and decode attention."""
    setup = tiny_setup(device="cuda", max_batches=4, capture_batch_sizes=[2, 4], compile=True)
    runner = setup.runner
    runner.warmup(setup.graph_cache, progress=False)
    assert runner.captured_buckets == [4, 2] and runner.stats.compile_seconds > 0
    for batch in (3, 4, 1, 2):
        seqs = setup.prefill(batch)
        for _ in range(3):
            graph, eager = setup.decode(seqs)
            torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4, msg=f"batch {batch}")
        assert setup.caches_close(atol=1e-4), f"KV caches differ after batch {batch}"
        for seq in seqs:
            setup.engine.finish(seq)
    assert runner.stats.captures == 2 and runner.stats.replays == 12
    assert runner.stats.eager_steps == {"prefill": 4}
    seqs = setup.prefill(3)
    step = setup.engine.decode(seqs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile, torch.inference_mode():
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events()]
    assert any(name.startswith("triton_") for name in kernels), kernels
    assert "write_kv_kernel" in kernels and "decode_partition_kernel" in kernels, kernels
    assert "compile" in runner.stats.summary()

"""The step context's host fields (``kv_seqlens_cpu``): optional, and host
memory by contract (graphmode.families.host_fields).

Before: an Ascend step without ``kv_seqlens_cpu`` was served eagerly and at
its capture, then every replay raised ``ReplayError: graphmode_fill_buffers
read a device value on the host during a replay step``, blaming the vendor's
fill for what the engine left out; and on the emulator an engine had to mark
its ``kv_seqlens_cpu`` with ``mark_host``, or the same error came."""

from __future__ import annotations

import warnings

import pytest
import torch
from setups import tiny_setup

from graphmode.emulator.host import is_host

MODES = ["eager", "graph", "piecewise", "full_and_piecewise"]


def _steps(setup, count, **changes):
    """``count`` decode steps of three sequences, each through the runner and
    eagerly on the same inputs, with ``changes`` (a function of the step's
    metadata) applied to the metadata."""
    seqs = setup.prefill(3, [5, 7, 3])
    for _ in range(count):
        step = setup.engine.decode(seqs)
        attn = step.attn_metadata
        attn = attn.replace(**{name: change(attn) for name, change in changes.items()})
        with torch.inference_mode():
            graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, attn).clone()
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, attn)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.caches_close()


@pytest.mark.parametrize("mode", MODES)
def test_ascend_steps_without_host_lengths_replay_deriving_them_once_each(mode):
    setup = tiny_setup("ascend", execute_mode=mode, capture_batch_sizes=[1, 2, 4], capture_token_sizes=[4, 8, 16, 32])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(setup, 4, kv_seqlens_cpu=lambda attn: None)
    stats = setup.runner.stats
    assert stats.derived_host_copies == 4  # one device-to-host copy per step, counted
    said = [str(w.message) for w in caught if "kv_seqlens_cpu" in str(w.message)]
    assert len(said) == 1, said  # said once, naming the field to pass
    assert "Pass attn_metadata.kv_seqlens_cpu" in said[0] and "runner.stats.derived_host_copies" in said[0]
    assert "4 host copies derived (kv_seqlens_cpu not passed)" in stats.summary()
    if mode in ("graph", "full_and_piecewise"):
        assert stats.replays == 3  # the capture, then replays: no ReplayError
    elif mode == "piecewise":
        assert stats.piecewise_replays == 3


def test_host_built_steps_without_host_lengths_cost_no_copy():
    # The step's kv_seqlens are host memory already: they are the host lengths.
    setup = tiny_setup("ascend", host_inputs=True, capture_batch_sizes=[1, 2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say
        _steps(setup, 3, kv_seqlens_cpu=lambda attn: None)
    assert setup.runner.stats.derived_host_copies == 0 and setup.runner.stats.replays == 2


@pytest.mark.parametrize("mode", MODES)
def test_unmarked_host_lengths_count_as_host_memory_on_the_emulator(mode):
    # A plain CPU tensor, as an engine on the emulator passes it without graphmode.emulator.mark_host.
    setup = tiny_setup("ascend", execute_mode=mode, capture_batch_sizes=[1, 2, 4], capture_token_sizes=[4, 8, 16, 32])
    _steps(setup, 3, kv_seqlens_cpu=lambda attn: attn.kv_seqlens_cpu.clone())
    stats = setup.runner.stats
    assert stats.derived_host_copies == 0
    assert stats.replays + stats.piecewise_replays == (0 if mode == "eager" else 2)


def test_host_lengths_sharing_the_device_lengths_memory_leave_those_on_the_device():
    # kv_seqlens_cpu=kv_seqlens on the emulator: marking it would mark the device field too, and the
    # step would then mix host and device tensors. A marked copy stands in for it.
    setup = tiny_setup("ascend", capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(3, [5, 7, 3])
    for _ in range(3):
        step = setup.engine.decode(seqs)
        attn = step.attn_metadata.replace(kv_seqlens_cpu=step.attn_metadata.kv_seqlens)
        with torch.inference_mode():
            graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, attn).clone()
            eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, attn)
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
        assert not is_host(attn.kv_seqlens)
    assert setup.runner.stats.replays == 2


def test_a_vendor_reading_only_the_host_copy_gets_it_derived():
    # A host buffer sourced from kv_seqlens_cpu alone (no fallback path): before, a step omitting it
    # was refused, "step input 'kv_lens' (attn_metadata.kv_seqlens_cpu) is missing".
    import graphmode
    from graphmode.spec import CUDA_SPEC, BufferSpec

    spec = CUDA_SPEC.with_buffers(
        BufferSpec("kv_lens", torch.int32, padding=1, host=True, source="attn_metadata.kv_seqlens_cpu"))

    class Plugin:
        @graphmode.hookimpl
        def graphmode_vendor_info(self):
            return graphmode.VendorInfo(name="hostlens", device_types=("cpu",), detected=False)

        @graphmode.hookimpl
        def graphmode_graph_spec(self):
            return spec

    setup = tiny_setup("cuda", plugin=Plugin(), capture_batch_sizes=(1, 2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(setup, 3, kv_seqlens_cpu=lambda attn: None)
    assert setup.runner.stats.derived_host_copies == 3 and setup.runner.stats.replays == 2

"""Host staging: step inputs from the host, one pinned mirror copied inside
every graph. On the emulator, and the ordering on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from setups import slow_gpu_model, tiny_setup

import graphmode
from graphmode import ConfigError, InputError
from graphmode.emulator import is_host, is_pinned_host, mark_host
from graphmode.model import ModelConfig, build_reference_model
from graphmode.model.engine import ReferenceEngine
from graphmode.model.lora import add_lora
from graphmode.native import native_module
from graphmode.spec import SEQUENCES, BufferSpec
from graphmode.staging import to_device, to_host


def churn(setup, batches):
    """Decode steps over ``batches`` (sequences added or finished between
    steps), checking graph against eager at every step."""
    seqs = setup.prefill(max(batches))
    for batch in batches:
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")
    assert setup.caches_close()


def test_host_inputs_turn_host_staging_on_and_graph_equals_eager_across_buckets():
    setup = tiny_setup(max_batches=16, host_inputs=True, capture_batch_sizes=[1, 2, 4, 8, 16])
    # Within a bucket (5..8), across buckets, and a smaller batch after a
    # larger one: the padding rows must be reset in the mirror.
    churn(setup, [8, 7, 5, 16, 3, 1, 12, 2, 8])
    runner = setup.runner
    assert runner.staging is not None
    assert runner.stats.captures == 5 and runner.stats.replays == 4
    meta = runner.graph_meta()
    arena = runner.staging.arena
    for name in ("input_ids", "block_offsets", "kv_seqlens", "kv_start_indices"):
        assert meta.input_buffers[name].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), name
    assert is_pinned_host(runner.staging.mirror) and not is_host(arena)


def test_host_and_device_staged_runners_give_identical_results():
    host = tiny_setup(host_inputs=True)
    device = tiny_setup()
    seqs = host.prefill(9)
    assert device.prefill(9) == seqs
    for batch in (9, 4, 9, 6, 1):
        host_out, _ = host.decode(seqs[:batch])
        device_out, _ = device.decode(seqs[:batch])
        assert torch.equal(host_out, device_out), f"batch {batch}"
    assert host.runner.staging is not None and device.runner.staging is None


def test_the_graph_copies_only_its_bucket_rows_of_the_block_table():
    setup = tiny_setup(max_batches=16, width=8, host_inputs=True)
    churn(setup, [2])
    staging = setup.runner.staging
    table = setup.runner.graph_meta().input_buffers["block_offsets"]
    assert staging.offsets["block_offsets"] == max(staging.offsets.values())  # the table is last
    assert staging.region(2) == staging.offsets["block_offsets"] + 2 * 8 * table.element_size()
    assert staging.region(16) == staging.offsets["block_offsets"] + table.numel() * table.element_size()


def test_device_inputs_on_a_host_staged_runner_are_refused():
    setup = tiny_setup(host_inputs=True)
    seqs = setup.prefill(3)
    setup.decode(seqs)
    step = to_device(setup.engine.decode(seqs), torch.device("cpu"))  # unmarked: device memory
    with pytest.raises(InputError, match="stages its inputs on the host") as error:
        setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert "host_staging=False" in str(error.value)
    assert "graphmode.emulator.mark_host" in str(error.value)  # on the emulator, how to make a host tensor


def test_host_inputs_on_a_device_staged_runner_are_copied_to_the_device():
    setup = tiny_setup(host_staging=False)
    churn(setup, [4, 3])
    setup.engine.host_inputs = True
    churn(setup, [4, 2])
    assert setup.runner.staging is None


def test_mixed_placement_is_refused_naming_both_fields():
    setup = tiny_setup(host_inputs=True)
    seqs = setup.prefill(2)
    step = setup.engine.decode(seqs)
    attn = step.attn_metadata.replace(kv_seqlens=step.attn_metadata.kv_seqlens.clone())  # device memory
    with pytest.raises(InputError, match="attn_metadata.kv_seqlens is on cpu but input_ids is on the host"):
        setup.runner(step.input_ids, step.position_ids, setup.graph_cache, attn)


def test_prefill_with_host_inputs_runs_eagerly_on_a_host_staged_runner():
    setup = tiny_setup(host_inputs=True, host_staging=True)
    churn(setup, [3, 3])  # prefill (eager) then decode (graph)
    assert setup.runner.stats.eager_steps["prefill"] == 1


def test_warmup_of_a_host_staged_runner_captures_from_the_host():
    setup = tiny_setup(max_batches=8, host_inputs=True, host_staging=True)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert sorted(setup.runner.captured_buckets) == list(setup.runner.capture_sizes)
    captures = setup.runner.stats.captures
    churn(setup, [5, 2, 8])
    assert setup.runner.stats.captures == captures  # every step replayed


def test_warmup_of_a_host_staged_runner_with_a_declared_step_input_stages_its_padding_from_the_host():
    # warmup() fills a declared step input with its padding; under host staging that padding
    # must come from the host too (it was a device tensor: InputError blaming the engine's input).
    model = add_lora(build_reference_model(ModelConfig.tiny(), device="cpu"), count=2)
    runner = graphmode.build_graph_runner(
        model, max_batches=2, max_blocks_per_seq=2, block_size=16, device="cpu", host_staging=True,
        step_inputs=[BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)],
    )
    engine = ReferenceEngine(9, 16, "cpu", vocab_size=model.config.vocab_size, host_inputs=True)
    cache, eager_cache = model.make_kv_cache(9, 16), model.make_kv_cache(9, 16)
    with torch.inference_mode():
        runner.warmup(cache, progress=False)
        assert sorted(runner.captured_buckets) == list(runner.capture_sizes)
        seqs = [engine.add() for _ in range(2)]
        step = engine.prefill(seqs, [3, 5])
        for kv in (cache, eager_cache):
            model(step.input_ids, step.position_ids, kv, step.attn_metadata, lora_ids=torch.tensor([1, 2]))
        step, ids = engine.decode(seqs), mark_host(torch.tensor([2, 1], dtype=torch.int32))
        graph = runner(step.input_ids, step.position_ids, cache, step.attn_metadata, lora_ids=ids)
        eager = model(step.input_ids, step.position_ids, eager_cache, step.attn_metadata, lora_ids=ids)
    assert runner.stats.replays == 1
    torch.testing.assert_close(graph, eager)


def test_warmup_before_any_step_with_host_staging_none_keeps_the_device_fill():
    setup = tiny_setup(max_batches=4)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
    assert setup.runner.staging is None
    setup.engine.host_inputs = True
    churn(setup, [3])  # host inputs are still served, copied to the device


class _OwnFill:
    """A plugin filling its buffers with its own hook."""

    capabilities: frozenset[str] = frozenset()

    @graphmode.hookimpl
    def graphmode_vendor_info(self):
        return graphmode.VendorInfo("ownfill", ("cuda",), "torch", None, False, "test", capabilities=self.capabilities)

    @graphmode.hookimpl
    def graphmode_fill_buffers(self, meta, inputs, batch_size, bucket):
        graphmode.buffers.fill(meta, inputs, batch_size, bucket)
        return True


class _Declared(_OwnFill):
    capabilities = frozenset({"host_staging"})


def test_a_plugin_with_its_own_fill_hook_does_not_get_host_staging():
    setup = tiny_setup("ownfill", plugin=_OwnFill(), host_inputs=True)
    churn(setup, [3, 2])
    assert setup.runner.staging is None
    with pytest.raises(ConfigError, match="its own graphmode_fill_buffers"):
        tiny_setup("ownfill", plugin=_OwnFill(), host_staging=True)


def test_a_plugin_declaring_the_capability_gets_host_staging():
    setup = tiny_setup("declared", plugin=_Declared(), host_inputs=True)
    churn(setup, [3, 2, 4])
    assert setup.runner.staging is not None


def test_declared_host_buffers_stay_on_the_host_under_host_staging():
    # Ascend declares host kv lengths and q_seqlens and a live-constant mask:
    # the device buffers move into the arena, the host ones stay, and the
    # mask's live rows come from the host copy of its constant.
    setup = tiny_setup("ascend", host_inputs=True, capture_batch_sizes=[1, 2, 4, 8, 16])
    churn(setup, [8, 5, 3, 8])
    staging = setup.runner.staging
    assert staging is not None and "kv_seqlens" not in staging.offsets and "x_active_mask" in staging.offsets


def test_a_device_source_in_stage_is_refused_naming_the_buffer():
    setup = tiny_setup(host_inputs=True)
    churn(setup, [2])
    meta = setup.runner.graph_meta()
    with pytest.raises(InputError, match="'kv_seqlens' buffer are a device tensor(.|\n)*emulator.mark_host"):
        graphmode.buffers.stage(meta, [(meta.input_buffers["kv_seqlens"][:2], torch.ones(2, dtype=torch.int32))])


def test_to_host_marks_host_memory_on_the_emulator():
    setup = tiny_setup()
    seqs = setup.prefill(2)
    step = to_host(setup.engine.decode(seqs), torch.device("cpu"))
    assert is_host(step.input_ids) and is_host(step.attn_metadata.block_offsets)
    # A declared step input named in extras moves too; any other extra is frozen by identity and stays.
    frozen, ids = torch.ones(2), torch.zeros(2, dtype=torch.int32)
    step = to_host(dataclasses.replace(step, extras={"lora_ids": ids, "scale": frozen}), torch.device("cpu"), {"lora_ids"})
    assert is_host(step.extras["lora_ids"]) and step.extras["scale"] is frozen and not is_host(frozen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the ordering hazard needs an asynchronous device")
def test_writing_the_mirror_waits_for_the_previous_replays_copy():
    """Two host-staged steps back to back, the first one's graph slow: the
    second step's mirror write must not reach the first graph's copy."""
    model = slow_gpu_model()
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cuda",
                                          host_staging=True, capture_batch_sizes=[4])

    cache = [(torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))]  # the model reads none

    def step(value):
        attn = graphmode.AttnMetadata(
            is_decoding=True, block_offsets=torch.ones((4, 1), dtype=torch.int32),
            q_start_loc=torch.arange(4, dtype=torch.int32), q_seqlens=torch.ones(4, dtype=torch.int32),
            kv_seqlens=torch.ones(4, dtype=torch.int32), kv_start_indices=torch.full((4,), -1),
            max_q_seq_len=1, max_kv_seq_len=1)
        return runner(torch.full((1, 4), value), torch.zeros((1, 4), dtype=torch.int64), cache, attn)

    with torch.inference_mode():
        step(0)  # capture
        outputs = []
        for value in range(1, 20):
            outputs.append(step(value).clone())  # queued behind the replay that produced it
        torch.cuda.synchronize()
    assert [int(o[0, 0, 0]) for o in outputs] == list(range(1, 20))
    if native_module() is not None:  # the native step and its C++ ring took steps too (a step
        # that would wait for the device at a group's start is left to the Python path)
        assert runner.family("full").native.memo.replays >= 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the ordering hazard needs an asynchronous device")
def test_pinned_host_inputs_without_host_staging_may_be_rewritten_once_the_call_returns():
    """An engine with persistent pinned input buffers (vLLM's CpuGpuBuffer)
    writes them for its next step as soon as a call returns. Without host
    staging the step goes to the device in non_blocking copies, which read
    pinned memory only when the device reaches them (behind the previous
    step's slow graph): each step must still see its own ids."""
    model = slow_gpu_model()
    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=2, block_size=16, device="cuda",
                                          host_staging=False, capture_batch_sizes=[4])
    cache = [(torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"))]  # the model reads none
    ids = torch.zeros((1, 4), dtype=torch.int64).pin_memory()  # the engine's buffer, reused every step
    attn = graphmode.AttnMetadata(
        is_decoding=True, block_offsets=torch.ones((4, 1), dtype=torch.int32),
        q_start_loc=torch.arange(4, dtype=torch.int32), q_seqlens=torch.ones(4, dtype=torch.int32),
        kv_seqlens=torch.ones(4, dtype=torch.int32), kv_start_indices=torch.full((4,), -1),
        max_q_seq_len=1, max_kv_seq_len=1)
    positions = torch.zeros((1, 4), dtype=torch.int64)
    with torch.inference_mode():
        runner(ids, positions, cache, attn)  # capture
        outputs = []
        for value in range(1, 20):
            ids.fill_(value)
            outputs.append(runner(ids, positions, cache, attn).clone())  # queued behind the replay
            ids.fill_(-1)  # the engine writes its buffer again once the call returned
        torch.cuda.synchronize()
    assert runner.staging is None and runner.stats.replays == 19
    assert [int(o[0, 0, 0]) for o in outputs] == list(range(1, 20))


def test_host_staging_is_refused_in_piecewise_mode():
    # Host staging feeds the full decode graphs; piecewise graphs copy host steps to the device.
    with pytest.raises(ConfigError, match=r"host_staging=True with execute_mode='piecewise': host staging .* feeds "
                       r"the full decode graphs"):
        tiny_setup(host_inputs=True, host_staging=True, execute_mode="piecewise")
    assert tiny_setup(host_inputs=True, host_staging=True, execute_mode="full_and_piecewise").runner is not None

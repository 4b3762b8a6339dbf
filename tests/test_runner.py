"""The runner on the CPU emulator: graph equals eager, eager fallbacks,
statistics, lifecycle, and clear errors for bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import AttnMetadata, InputError


def test_graph_equals_eager_for_every_batch_size_up_to_64():
    setup = tiny_setup(max_batches=64, width=4, cache_blocks=64 * 4 + 1)
    for batch in range(1, 65):
        seqs = setup.prefill(batch)
        for _ in range(3):
            graph, eager = setup.decode(seqs)
            assert graph.shape == eager.shape == (1, batch, setup.model.config.vocab_size)
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=f"batch {batch}")
        assert setup.caches_close(), f"KV caches differ after batch {batch}"
        for seq in seqs:
            setup.engine.finish(seq)
    stats = setup.runner.stats
    buckets = len(setup.runner.capture_sizes)  # the default list: 24 graphs up to 64
    assert stats.captures == buckets and stats.replays == 64 * 3 - buckets
    assert stats.padded_tokens > 0  # batches were padded into larger graphs
    assert stats.eager_steps["prefill"] == 64


def test_first_step_of_a_bucket_captures_later_steps_replay():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4, 8, 16])
    seqs = setup.prefill(3)
    setup.decode(seqs)
    assert setup.runner.captured_buckets == [4]
    assert (setup.runner.stats.captures, setup.runner.stats.replays) == (1, 0)
    setup.decode(seqs)
    setup.decode(seqs[:2])
    assert setup.runner.captured_buckets == [4, 2]
    stats = setup.runner.stats
    assert (stats.captures, stats.replays) == (2, 1)
    assert (stats.real_tokens, stats.padded_tokens) == (8, 2)
    assert stats.summary() == "2 captures (0 in warm-up), 1 replays, eager steps: 1 prefill; padding 2/10 tokens (20.0%)"


def test_replay_result_is_a_view_of_the_graph_output_valid_until_the_next_step():
    setup = tiny_setup()
    seqs = setup.prefill(4)
    setup.decode(seqs)
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        first = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        step = setup.engine.decode(seqs)
        second = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert first.data_ptr() == second.data_ptr()


def test_a_result_reshaped_in_place_leaves_the_next_steps_result_as_it_was():
    # The replay's output view is made once per batch size; each step gets its own tensor over it.
    setup = tiny_setup()
    seqs = setup.prefill(3)
    setup.decode(seqs)
    results = []
    with torch.inference_mode():
        for _ in range(2):
            step = setup.engine.decode(seqs)
            result = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
            results.append((result, tuple(result.shape), result.stride()))
            result.squeeze_(0)  # an engine's own shape change, in place
    (first, shape, stride), (second, second_shape, second_stride) = results
    assert first is not second and first.data_ptr() == second.data_ptr()
    assert (second_shape, second_stride) == (shape, stride) and shape == (1, 3, setup.model.config.vocab_size)


def test_a_result_changed_in_place_leaves_the_next_steps_result_right():
    # docs/engines.md: an in-place change (inside inference mode) writes the shared output buffer,
    # which the next replay overwrites whole.
    setup = tiny_setup()
    seqs = setup.prefill(3)
    setup.decode(seqs)
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        result = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
        result.fill_(float("nan"))  # an engine's own in-place work on its logits
    graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.runner.stats.replays == 2  # the NaN-filled result and this one
    step = setup.engine.decode(seqs)
    result = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert result.is_inference()  # outside inference mode, PyTorch refuses the in-place change (clone first)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        result.mul_(2)


def test_prefill_runs_eagerly_and_matches_the_model():
    setup = tiny_setup()
    seqs = [setup.engine.add() for _ in range(3)]
    step = setup.engine.prefill(seqs, [5, 1, 9])
    with torch.inference_mode():
        out = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        ref = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    assert torch.equal(out, ref)
    assert setup.runner.stats.eager_steps == {"prefill": 1}
    assert setup.runner.captured_buckets == []


def test_decode_step_with_several_tokens_per_sequence_runs_eagerly():
    calls = []

    def model(input_ids, position_ids, past_key_values, attn_metadata):
        calls.append(input_ids.shape)
        return torch.zeros((1, input_ids.shape[1], 4))

    setup = tiny_setup()
    runner = graphmode.build_graph_runner(model, max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu")
    seqs = [setup.engine.add() for _ in range(2)]
    step = setup.engine.prefill(seqs, [2, 2])  # two new tokens each: speculative verification, say
    runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata.replace(is_decoding=True))
    assert runner.stats.eager_steps == {"multi_token_decode": 1} and calls == [(1, 4)]


def test_batch_above_the_largest_capture_size_runs_eagerly():
    setup = tiny_setup(capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(6)
    graph, eager = setup.decode(seqs)
    assert torch.equal(graph, eager)
    assert setup.runner.stats.eager_steps["no_bucket"] == 1
    assert setup.runner.bucket_of(5) is None and setup.runner.bucket_of(3) == 4


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_eager_mode_runs_everything_eagerly(how, monkeypatch):
    if how == "environment":
        monkeypatch.setenv("GRAPHMODE_EXECUTE_MODE", "eager")
        setup = tiny_setup()
    else:
        setup = tiny_setup(execute_mode="eager")
    seqs = setup.prefill(3)
    graph, eager = setup.decode(seqs)
    assert torch.equal(graph, eager)
    assert setup.runner.stats.eager_steps["eager_mode"] == 2
    assert setup.runner.captured_buckets == [] and setup.runner.meta is None
    setup.runner.warmup(setup.graph_cache)
    assert setup.runner.captured_buckets == []


def test_warmup_captures_every_bucket_largest_first_into_one_pool_and_writes_nothing(caplog):
    setup = tiny_setup()  # the default list for 16: 1..8, 10, 12, 14, 16
    before = [t.clone() for pair in setup.graph_cache for t in pair]
    with caplog.at_level("DEBUG", logger="graphmode"):
        setup.runner.warmup(setup.graph_cache)
    assert setup.runner.captured_buckets == [16, 14, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1]
    pools = {id(setup.runner.graph(b).graph.pool()) for b in setup.runner.captured_buckets}
    assert len(pools) == 1
    after = [t for pair in setup.graph_cache for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert "capturing bucket 16 (1/12), emulated graphs (host memory)" in caplog.messages
    seqs = setup.prefill(5)
    graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.captures == 12 and setup.runner.stats.replays == 1


def test_reset_drops_graphs_and_capture_works_again():
    setup = tiny_setup()
    seqs = setup.prefill(4)
    setup.decode(seqs)
    graph_object = setup.runner.graph(4).graph
    setup.runner.reset()
    assert setup.runner.captured_buckets == []
    with pytest.raises(graphmode.ReplayError):
        graph_object.replay()
    graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.captures == 2


def test_weights_updated_in_place_are_seen_by_the_next_replay():
    setup = tiny_setup()
    seqs = setup.prefill(4)
    setup.decode(seqs)
    with torch.no_grad():
        for param in setup.model.parameters():
            param.mul_(1.5)
    graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.replays == 1


def test_a_new_kv_cache_needs_a_reset():
    setup = tiny_setup()
    seqs = setup.prefill(2)
    setup.decode(seqs)
    step = setup.engine.decode(seqs)
    new_cache = setup.model.make_kv_cache(200, 16)
    with pytest.raises(InputError, match="past_key_values are not the tensors the graph of bucket 2 captured"):
        setup.runner(step.input_ids, step.position_ids, new_cache, step.attn_metadata)
    same_tensors = [tuple(pair) for pair in setup.graph_cache]  # a new list of the same tensors is fine
    with torch.inference_mode():
        setup.runner(step.input_ids, step.position_ids, same_tensors, step.attn_metadata)


def test_new_tensor_objects_over_the_captured_memory_replay():
    # A graph reads addresses: views of the captured cache tensors (new Python
    # objects, the same memory and layout) are read right, so they replay.
    setup = tiny_setup()
    seqs = setup.prefill(2)
    setup.decode(seqs)
    views = [(k.view(k.shape), v.view(v.shape)) for k, v in setup.graph_cache]
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        graph = setup.runner(step.input_ids, step.position_ids, views, step.attn_metadata)
        eager = setup.model(step.input_ids, step.position_ids, views, step.attn_metadata)
    torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.replays == 1
    # The same memory in another layout, put into the engine's own container in place.
    k, v = views[0]
    views[0] = (k.view(-1, *k.shape[2:]).view(k.shape[1], k.shape[0], *k.shape[2:]), v)
    with pytest.raises(InputError, match=r"past_key_values tensor 0 of 4 is another tensor over the memory the "
                       r"graph of bucket 2 captured, in another layout"):
        setup.runner(step.input_ids, step.position_ids, views, step.attn_metadata)


def test_extra_inputs_are_frozen_and_checked():
    class WithExtra(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata, scale):
            return self.inner(input_ids, position_ids, past_key_values, attn_metadata) * scale

    setup = tiny_setup()
    runner = graphmode.build_graph_runner(WithExtra(setup.model), max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu")
    seqs = setup.prefill(2)
    scale = torch.tensor(2.0)
    with torch.inference_mode():
        step = setup.engine.decode(seqs)
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, scale=scale)
        step = setup.engine.decode(seqs)
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, scale=scale)
        with pytest.raises(InputError, match="extra model input 'scale' is not the object the graph of bucket 2 captured"):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, scale=torch.tensor(3.0))


@pytest.mark.parametrize("mode", ["graph", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("move", ["data", "set_"])
def test_an_extra_tensor_given_new_memory_under_the_same_object_is_refused(mode, move):
    # bias.data = new (a regrown table) kept the object, which passed the identity check, while graph
    # steps read the captured memory: 5.0 off eager, without debug mode (helper-18's hunt, 2026-12-04).
    class WithBias(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata, bias):
            return self.inner(input_ids, position_ids, past_key_values, attn_metadata) + bias

    setup = tiny_setup()
    runner = graphmode.build_graph_runner(WithBias(setup.model), max_batches=16, max_blocks_per_seq=8, block_size=16,
                                          device="cpu", execute_mode=mode, capture_token_sizes=[4, 8])
    seqs = setup.prefill(2)
    bias = torch.zeros(())
    with torch.inference_mode():
        for _ in range(2):  # a capture, a replay
            step = setup.engine.decode(seqs)
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, bias=bias)
        new = torch.full((), 5.0)
        if move == "data":
            bias.data = new
        else:
            bias.set_(new)
        step = setup.engine.decode(seqs)
        with pytest.raises(InputError, match=r"extra model input 'bias' is the object the graph of .* captured, but "
                           r"its tensor memory moved \(data_ptr 0x[0-9a-f]+, captured at 0x[0-9a-f]+: .*Change it "
                           r"in place \(.copy_\(\)\), call runner.reset\(\) after reallocating it"):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, bias=bias)


@pytest.mark.parametrize("mode", ["graph", "piecewise"])
def test_an_extra_container_changed_in_place_is_refused(mode):
    # An engine reusing one dict of per-step settings, updated in place: the same object passed the
    # identity check, and graph steps replayed the captured temperature (0.62 off eager, an
    # engine-input hunt, 2026-12-03). A new object with the same contents, or the same one unchanged, runs.
    class WithSettings(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata, sampling):
            return self.inner(input_ids, position_ids, past_key_values, attn_metadata) / sampling["temperature"]

    setup = tiny_setup()
    runner = graphmode.build_graph_runner(WithSettings(setup.model), max_batches=16, max_blocks_per_seq=8,
                                          block_size=16, device="cpu", execute_mode=mode,
                                          capture_token_sizes=[4, 8, 16] if mode == "piecewise" else None)
    seqs = setup.prefill(2)
    sampling = {"temperature": 1.0, "stops": [2, 3]}
    with torch.inference_mode():
        for _ in range(2):  # capture, then replay with the same contents
            step = setup.engine.decode(seqs)
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, sampling=sampling)
        sampling["stops"].append(4)  # nested, in place
        with pytest.raises(InputError, match=r"^extra model input 'sampling' is the object the graph of .* captured, "
                           r"but what it holds changed since \(now \{'temperature': 1.0, 'stops': \[2, 3, 4\]\}\)"):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, sampling=sampling)
        sampling["stops"].pop()
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, sampling=sampling)


# -- bad input ---------------------------------------------------------------


def _step(setup, batch=2):
    """A decode step's inputs (the cache content does not matter here)."""
    seqs = [setup.engine.add() for _ in range(batch)]
    setup.engine.prefill(seqs, [3] * batch)
    return setup.engine.decode(seqs)


def _call(setup, step, **changes):
    attn = step.attn_metadata.replace(**{k: v for k, v in changes.items() if k not in ("input_ids", "position_ids")})
    with torch.inference_mode():
        return setup.runner(
            changes.get("input_ids", step.input_ids), changes.get("position_ids", step.position_ids),
            setup.graph_cache, attn,
        )


def test_batch_size_zero_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(InputError, match="batch size 0: a step needs at least one sequence"):
        _call(setup, step, q_seqlens=empty, kv_seqlens=empty, q_start_loc=empty,
              block_offsets=torch.zeros((0, 8), dtype=torch.int32), kv_start_indices=empty.long(),
              input_ids=torch.zeros((1, 0), dtype=torch.long), position_ids=torch.zeros((1, 0), dtype=torch.long))


def test_batch_above_max_batches_is_refused():
    setup = tiny_setup(max_batches=4, cache_blocks=80)
    step = _step(setup, batch=5)
    with pytest.raises(InputError, match=r"batch size 5 is above max_batches=4; build the runner with max_batches >= 5"):
        _call(setup, step)


def test_block_table_wider_than_max_blocks_per_seq_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    wide = torch.zeros((2, 9), dtype=torch.int32)
    with pytest.raises(InputError, match=r"block_offsets is 9 blocks wide, above the runner's max_blocks_per_seq=8 "
                       r"\(the block table's width, not the KV cache's size\); build the runner with "
                       r"max_blocks_per_seq >= 9"):
        _call(setup, step, block_offsets=wide)


def test_kv_length_above_capacity_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    with pytest.raises(InputError, match=r"max_kv_seq_len=200 is above the 128 tokens a block table can address \(max_blocks_per_seq=8 x block_size=16\)"):
        _call(setup, step, max_kv_seq_len=200)


@pytest.mark.parametrize("field", ["kv_seqlens", "block_offsets", "kv_start_indices", "input_ids"])
def test_wrong_dtype_is_refused(field):
    setup = tiny_setup()
    step = _step(setup)
    value = step.input_ids if field == "input_ids" else getattr(step.attn_metadata, field)
    with pytest.raises(InputError, match=f"{field} has dtype torch.float32; it must be an integer tensor"):
        _call(setup, step, **{field: value.float()})


def test_wrong_device_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    elsewhere = torch.empty((2,), dtype=torch.int32, device="meta")
    with pytest.raises(InputError, match=r"attn_metadata.kv_seqlens is on meta, but the runner's device is cpu; move it with .to\('cpu'\)"):
        _call(setup, step, kv_seqlens=elsewhere)


def test_wrong_shape_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    with pytest.raises(InputError, match=r"kv_start_indices has 1 tokens, but input_ids and position_ids have 2"):
        _call(setup, step, kv_start_indices=step.attn_metadata.kv_start_indices[:1])
    with pytest.raises(InputError, match=r"kv_seqlens has 3 rows, but attn_metadata.block_offsets, attn_metadata.q_start_loc, "
                       r"attn_metadata.q_seqlens have 2.* fix attn_metadata.kv_seqlens$"):
        _call(setup, step, kv_seqlens=torch.ones(3, dtype=torch.int32))


def test_attn_metadata_of_another_type_is_refused():
    setup = tiny_setup()
    step = _step(setup)
    with pytest.raises(InputError, match="attn_metadata is a dict; pass a graphmode.AttnMetadata"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, {"is_decoding": True})


# -- vendor answers the runner checks ----------------------------------------


class ShrinkingBuckets:
    """A broken plugin: a bucket smaller than the batch."""

    @graphmode.hookimpl
    def graphmode_compatible_size(self, batch_size, capture_sizes):
        return max(1, batch_size // 2)


class UnsortedSizes:
    @graphmode.hookimpl
    def graphmode_capture_sizes(self, config):
        return [4, 2, 1]


def test_a_bucket_smaller_than_the_batch_is_refused_at_start_up():
    with pytest.raises(graphmode.ConfigError, match=r"graphmode_compatible_size\(2\) returned 1; it must be a capture size >= 2 from \[1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16\]"):
        tiny_setup("shrinking", plugin=ShrinkingBuckets())


def test_a_capture_list_out_of_order_is_refused_at_start_up():
    with pytest.raises(graphmode.ConfigError, match=r"graphmode_capture_sizes returned \[4, 2, 1\], which is not ascending and unique"):
        tiny_setup("unsorted", plugin=UnsortedSizes())


class Advice:
    """Turns any capture failure into advice, as vendors do for known signatures."""

    @graphmode.hookimpl
    def graphmode_capture_error(self, error, meta, bucket):
        return graphmode.CaptureError(f"bucket {bucket}: reduce the capture sizes")


def test_capture_errors_are_translated_and_chained():
    class ReadsTheDevice(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
            out = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
            if out.sum() > 1e9:  # a host read of device memory: not capturable
                raise AssertionError
            return out

    setup = tiny_setup("advice", plugin=Advice())
    runner = graphmode.GraphRunner(ReadsTheDevice(setup.model), setup.runner.config, setup.runner.vendor)
    step = _step(setup)
    with pytest.raises(graphmode.CaptureError, match="bucket 2: reduce the capture sizes") as error:
        with torch.inference_mode():
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert "Tensor.__bool__() inside graph capture" in str(error.value.__cause__)


def test_capture_errors_without_advice_keep_their_type_and_say_where():
    def model(input_ids, position_ids, past_key_values, attn_metadata):
        return input_ids[:, :, None].float() * attn_metadata.kv_seqlens.sum().item()

    runner = graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=8, block_size=16, device="cpu")
    setup = tiny_setup()
    step = _step(setup)
    with pytest.raises(graphmode.CaptureError) as error:
        with torch.inference_mode():
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert "test_runner.py" in str(error.value)
    notes = "".join(getattr(error.value, "__notes__", []))
    assert "while capturing the decode graph of bucket 2 (cuda); its sizes come from capture_batch_sizes" in notes


def test_runner_repr_names_vendor_device_and_buckets():
    setup = tiny_setup()
    assert repr(setup.runner) == "<GraphRunner cuda on cpu, graph mode, buckets [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16], captured []>"


def test_attn_metadata_replace_leaves_the_original():
    meta = AttnMetadata(True, *(torch.zeros(1, dtype=torch.int32),) * 5, 1, 1)
    assert meta.replace(max_kv_seq_len=-1).max_kv_seq_len == -1 and meta.max_kv_seq_len == 1


def test_decode_steps_marked_as_prefill_run_eagerly_and_are_warned_about_once():
    # A newcomer's engine (2026-12-04) built every step with is_decoding=False: its decode steps all ran
    # eagerly, counted as prefill, with right tokens and nothing said.
    setup = tiny_setup()
    seqs = setup.prefill(2)
    with torch.inference_mode(), pytest.warns(UserWarning, match=r"16 steps of one new token per sequence came "
                                              r"with is_decoding=False, so they ran eagerly") as warned:
        for _ in range(20):
            step = setup.engine.decode(seqs)
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache,
                         step.attn_metadata.replace(is_decoding=False))
    ours = [w for w in warned if "is_decoding=False" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # the engine's call, not graphmode's frames
    assert setup.runner.stats.eager_steps["prefill"] == 21 and setup.runner.stats.replays == 0


def test_one_token_steps_marked_as_prefill_that_piecewise_graphs_serve_are_not_warned_about():
    setup = tiny_setup(execute_mode="full_and_piecewise", capture_token_sizes=[2, 4])
    seqs = setup.prefill(2)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            step = setup.engine.decode(seqs)
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache,
                         step.attn_metadata.replace(is_decoding=False))
    assert setup.runner.stats.piecewise_replays == 19

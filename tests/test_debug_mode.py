"""Debug mode (debug=True or GRAPHMODE_DEBUG=1): each graph step's device
values are read once and refused when a graph would silently give wrong
results; replays check that no captured tensor moved."""

from __future__ import annotations

import pytest
import torch
from setups import tiny_setup

from graphmode import ConfigError, InputError, hookimpl
from graphmode.emulator import EmulatedGraph
from graphmode.graphs import DeviceGraph, TorchGraph
from graphmode.vendor_info import VendorInfo


def _setup(**options):
    setup = tiny_setup(capture_batch_sizes=[2, 4], cache_blocks=40, debug=True, **options)
    seqs = setup.prefill(3, [3, 20, 9])  # blocks: one, two, one
    return setup, seqs


def _run(setup, step, **changes):
    with torch.inference_mode():
        return setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata.replace(**changes))


def test_debug_mode_is_off_by_default_and_the_environment_switches_it(monkeypatch):
    assert tiny_setup().runner.config.debug is False
    monkeypatch.setenv("GRAPHMODE_DEBUG", "1")
    assert tiny_setup().runner.config.debug is True
    monkeypatch.setenv("GRAPHMODE_DEBUG", "0")
    assert tiny_setup(debug=True).runner.config.debug is False
    monkeypatch.setenv("GRAPHMODE_DEBUG", "maybe")
    with pytest.raises(ConfigError, match=r"\$GRAPHMODE_DEBUG='maybe': use 1 \(debug checks on\) or 0 \(off\)"):
        tiny_setup()


def test_right_steps_pass_and_give_the_eager_results():
    setup, seqs = _setup()
    for batch in (3, 3, 2, 3, 2):
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.runner.stats.replays == 3


def _table(step, row, column, value):
    table = step.attn_metadata.block_offsets.clone()
    table[row, column] = value
    return table


def _slots(step, row, value):
    slots = step.attn_metadata.kv_start_indices.clone()
    slots[row] = value
    return slots


CASES = {
    "slot in another sequence's block": (
        lambda step: {"kv_start_indices": _slots(step, 0, int(step.attn_metadata.block_offsets[1, 0]) * 16 + 5)},
        r"token 0 \(sequence 0\) writes slot \d+ \(block \d+\), outside the sequence's own blocks \[\d+\]"),
    "slot at the wrong offset": (
        lambda step: {"kv_start_indices": _slots(step, 2, int(step.attn_metadata.kv_start_indices[2]) + 1)},
        r"token 2 \(sequence 2\) writes slot \d+, but its position kv_seqlens-1=10 lives at slot \d+"),
    "the slot of another sequence's token": (
        lambda step: {"kv_start_indices": _slots(step, 1, int(step.attn_metadata.kv_start_indices[0]))},
        r"token 1 \(sequence 1\) writes slot \d+ \(block \d+\), outside the sequence's own blocks \[\d+, \d+\]"),
    "block id past the cache": (
        lambda step: {"block_offsets": _table(step, 1, 5, 40)},
        r"sequence 1's block table holds block id 40 \(column 5\), outside the cache's 40 blocks \(0..39\)"),
    "negative block id": (
        lambda step: {"block_offsets": _table(step, 0, 7, -1)},
        r"sequence 0's block table holds block id -1 \(column 7\), outside the cache's 40 blocks"),
    "a sequence on the reserved block": (
        lambda step: {"block_offsets": _table(step, 1, 1, 0)},
        r"sequence 1 uses block 0 \(column 1 of its table, within its kv_seqlens=22\) and writes the cache; "
        r"block 0 is reserved"),
    # The host lengths left out, or the maximum unknown: host lengths above a known maximum are refused
    # without debug mode (graphmode.checks.host_lengths.check_kv_max_holds_host).
    "kv length above the table": (
        lambda step: {"kv_seqlens": torch.tensor([5, 22, 200], dtype=torch.int32), "kv_seqlens_cpu": None},
        r"sequence 2 has kv_seqlens=200, above the 128 tokens its block table can address \(8 blocks x block_size=16\)"),
    "kv length below 1": (
        lambda step: {"kv_seqlens": torch.tensor([5, 0, 11], dtype=torch.int32),
                      "kv_seqlens_cpu": torch.tensor([5, 0, 11], dtype=torch.int32)},
        r"sequence 1 has kv_seqlens=0, below 1"),
    "host lengths disagree": (
        lambda step: {"kv_seqlens_cpu": torch.tensor([5, 23, 11], dtype=torch.int32), "max_kv_seq_len": -1},
        r"sequence 1 has kv_seqlens_cpu=23 on the host but kv_seqlens=22 on the device"),
    "query lengths not one": (
        lambda step: {"q_seqlens": torch.tensor([1, 2, 0], dtype=torch.int32)},
        # A maximum below a length is named first (issue 40): it is what let the step pass as uniform.
        r"max_q_seq_len=1, but sequence 1 has q_seqlens=2: the maximum understates the step's query lengths"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_device_values_are_refused_before_the_graph_runs(case):
    changes, message = CASES[case]
    setup, seqs = _setup()
    setup.decode(seqs)  # captures bucket 4
    step = setup.engine.decode(seqs)
    with pytest.raises(InputError, match="debug mode: " + message):
        _run(setup, step, **changes(step))
    assert setup.runner.stats.replays == 0


@pytest.mark.parametrize("mode", ["graph", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("padded_kv", [1, 0])
def test_a_batch_the_engine_padded_itself_passes(mode, padded_kv):
    # An engine padding its step to a capture size itself, as graph mode pads: a row of token 0, slot -1
    # (PAD_SLOT_ID), the reserved block 0 and one KV token. It writes nothing and reads only the reserved
    # block; debug mode refused it before ("sequence 3 uses block 0 ... never give it to a sequence"), so
    # such an engine could not run in debug mode at all. vLLM pads seq_lens with 0: eager and the graph
    # run such a row too, and debug mode refused it ("sequence 3 has kv_seqlens=0, below 1").
    setup, seqs = _setup(execute_mode=mode, capture_token_sizes=[4, 8])
    setup.decode(seqs)  # captures bucket 4 (token bucket 4)
    step = setup.engine.decode(seqs)
    attn = step.attn_metadata

    def pad(tensor, value):
        return torch.cat([tensor, torch.full((1, *tensor.shape[1:]), value, dtype=tensor.dtype)])

    padded = attn.replace(
        block_offsets=pad(attn.block_offsets, 0), q_start_loc=torch.arange(4, dtype=attn.q_start_loc.dtype),
        q_seqlens=pad(attn.q_seqlens, 1), kv_seqlens=pad(attn.kv_seqlens, padded_kv),
        kv_start_indices=pad(attn.kv_start_indices, -1), kv_seqlens_cpu=pad(attn.kv_seqlens_cpu, padded_kv))
    with torch.inference_mode():
        graph = setup.runner(pad(step.input_ids[0], 0)[None], pad(step.position_ids[0], 0)[None],
                             setup.graph_cache, padded)[:, :3].clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, attn)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    assert setup.caches_close()


@pytest.mark.parametrize("mode", ["graph", "piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("bad", [256, -1])
def test_an_input_id_outside_the_vocabulary_is_named(mode, bad):
    # A tokenizer with added tokens and a model whose embeddings were not resized: the replay failed with
    # "index out of range in self" from inside torch (a device assert on CUDA), and its note sent the engine
    # to debug mode, which then failed the same way.
    setup, seqs = _setup(execute_mode=mode, capture_token_sizes=[4, 8])
    setup.decode(seqs)  # captures bucket 4 (token bucket 4)
    step = setup.engine.decode(seqs)
    ids = step.input_ids.clone()
    ids[0, 1] = bad
    with pytest.raises(InputError, match=rf"^debug mode: token 1 has input id {bad}, outside the model's vocabulary "
                       r"0\.\.255 \(config.vocab_size=256\).*embeddings resized"), torch.inference_mode():
        setup.runner(ids, step.position_ids, setup.graph_cache, step.attn_metadata)


def test_two_tokens_writing_one_slot_are_refused():
    # Both tokens in the same sequence's own block cannot happen in a decode
    # (one token per sequence); a sequence listed twice can.
    setup, seqs = _setup()
    setup.decode(seqs)
    step = setup.engine.decode([seqs[0], seqs[0]])
    twice = step.attn_metadata.replace(kv_start_indices=step.attn_metadata.kv_start_indices[[1, 1]],
                                       kv_seqlens=step.attn_metadata.kv_seqlens[[1, 1]],
                                       kv_seqlens_cpu=step.attn_metadata.kv_seqlens_cpu[[1, 1]])
    with pytest.raises(InputError, match=r"debug mode: tokens \[0, 1\] \(sequences \[0, 1\]\) all write slot \d+"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, twice)


def _moved_cache(setup):
    key, _ = setup.graph_cache[0]
    key.set_(key.clone())  # same tensor object, new memory: the identity check cannot see it


def _moved_weight(setup):
    weight = setup.model.layers[1].down_proj.weight
    weight.data = weight.data.clone()  # a weight reload into new tensors


@pytest.mark.parametrize("move, message", [
    # The KV cache's pointers are compared without debug mode too (graphmode.checks.cache_checks).
    (_moved_cache, r"past_key_values tensor 0 of 4 has new memory \(data_ptr 0x[0-9a-f]+, captured at 0x"),
    (_moved_weight, r"debug mode: model parameter 'layers.1.down_proj.weight' is at address 0x[0-9a-f]+, but the "
     r"graph of bucket 4"),
])
def test_a_captured_tensor_whose_memory_moved_is_refused_at_replay(move, message):
    setup, seqs = _setup()
    setup.decode(seqs)
    with torch.inference_mode():
        move(setup)
    with pytest.raises(InputError, match=message + r".*call runner.reset\(\)"):
        setup.decode(seqs)
    setup.runner.reset()
    graph, eager = setup.decode(seqs)  # captured again on the new memory
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


# -- the device graphs' own debug dumps ------------------------------------------


class _DumpsOnlyIfEnabled(EmulatedGraph):
    """The emulator's graph with the debug-dump contract of
    torch.cuda.CUDAGraph (torch.mlu.MLUGraph and torch.accelerator.Graph
    alike): ``debug_dump`` has something to write only when
    ``enable_debug_mode()`` was called before ``capture_begin`` (CUDA warns
    and writes nothing; here it raises). Driven through ``TorchGraph``, the
    adapter the runner drives those classes with."""

    def __init__(self) -> None:
        super().__init__()
        self.debug_mode = False
        self.enabled_at_capture: bool | None = None

    def enable_debug_mode(self) -> None:
        self.debug_mode = True

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        self.enabled_at_capture = self.debug_mode
        super().capture_begin(pool)

    def debug_dump(self, path: str) -> None:
        if not self.enabled_at_capture:
            raise RuntimeError("debug_dump: enable_debug_mode() was not called before capture")
        super().debug_dump(path)


class _HostTorchGraph(TorchGraph):
    """TorchGraph capturing on the current (host) stream: torch.cpu's streams
    take no device, and the emulator needs no side stream."""

    def capture_begin(self, pool=None) -> None:
        self.graph.capture_begin(pool=pool, capture_error_mode=self.capture_error_mode)

    def capture_end(self) -> None:
        self.graph.capture_end()


class _DebugDumpVendor:
    graphs: list[_DumpsOnlyIfEnabled] = []

    @staticmethod
    @hookimpl
    def graphmode_vendor_info():
        return VendorInfo(name="dumps", device_types=("cpu",), runtime="none", runtime_version=None,
                          detected=False, reason="test plugin")

    @staticmethod
    @hookimpl
    def graphmode_make_graph(meta):
        graph = _DumpsOnlyIfEnabled()
        _DebugDumpVendor.graphs.append(graph)
        return _HostTorchGraph(torch.device("cpu", 0), graph)


@pytest.mark.parametrize("debug", [True, False])
def test_debug_mode_captures_device_graphs_in_their_debug_mode_and_dumps_each(debug, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path / "dumps"))
    _DebugDumpVendor.graphs = []
    setup = tiny_setup("dumps", plugin=_DebugDumpVendor(), capture_batch_sizes=[2, 4], debug=debug)
    seqs = setup.prefill(3)
    for _ in range(2):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    setup.decode(seqs[:2])
    (bucket4, bucket2) = _DebugDumpVendor.graphs
    if not debug:  # no debug mode: no runtime debug mode, no dumps
        assert bucket4.enabled_at_capture is False and not (tmp_path / "dumps").exists()
        return
    assert bucket4.enabled_at_capture and bucket2.enabled_at_capture
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["bucket2-q1.dump", "bucket4-q1.dump"]
    assert "replay" in (tmp_path / "dumps" / "bucket4-q1.dump").read_text()
    # And on demand, from the runner's captured graph.
    setup.runner.graph(4).graph.debug_dump(str(tmp_path / "again.dump"))
    assert (tmp_path / "again.dump").read_text() == (tmp_path / "dumps" / "bucket4-q1.dump").read_text()


def test_a_graph_without_a_debug_dump_is_named_and_skipped(tmp_path, monkeypatch):
    """The default DeviceGraph has no dump: $GRAPHMODE_DEBUG_DUMP warns, the step runs."""

    class NoDump(DeviceGraph):
        def __init__(self):
            self.inner = EmulatedGraph()

        def capture_begin(self, pool=None):
            self.inner.capture_begin(pool)

        def capture_end(self):
            self.inner.capture_end()

        def replay(self):
            self.inner.replay()

        def reset(self):
            self.inner.reset()

        def pool(self):
            return self.inner.pool()

    class Vendor:
        @staticmethod
        @hookimpl
        def graphmode_vendor_info():
            return VendorInfo(name="nodump", device_types=("cpu",), runtime="none", runtime_version=None,
                              detected=False, reason="test plugin")

        @staticmethod
        @hookimpl
        def graphmode_make_graph(meta):
            return NoDump()

    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path))
    setup = tiny_setup("nodump", plugin=Vendor(), capture_batch_sizes=[4], debug=True)
    seqs = setup.prefill(3)
    with pytest.warns(UserWarning, match=r"\$GRAPHMODE_DEBUG_DUMP: NoDump has no debug dump; no dump of bucket 4"):
        graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager)


def test_a_cuda_graph_dump_without_cuda_bindings_is_named_and_skipped(tmp_path, monkeypatch):
    """torch 2.14+ writes a CUDAGraph's DOT file through the cuda-bindings
    package and raises without it (torch/cuda/graphs.py); the capture goes on."""

    class NoBindings(_DumpsOnlyIfEnabled):
        def debug_dump(self, path: str) -> None:
            raise RuntimeError("This CUDAGraph API requires the cuda-bindings package; "
                               "install it with `pip install cuda-bindings`.")

    class Vendor(_DebugDumpVendor):
        @staticmethod
        @hookimpl
        def graphmode_make_graph(meta):
            return _HostTorchGraph(torch.device("cpu", 0), NoBindings())

    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path))
    setup = tiny_setup("dumps", plugin=Vendor(), capture_batch_sizes=[4], debug=True)
    seqs = setup.prefill(3)
    with pytest.warns(UserWarning, match=r"\$GRAPHMODE_DEBUG_DUMP: This CUDAGraph API requires the cuda-bindings "
                                         r"package; .*; no dump of bucket 4"):
        graph, eager = setup.decode(seqs)
    torch.testing.assert_close(graph, eager)


def test_torch_graph_enables_debug_mode_only_where_the_class_has_one():
    """torch_npu's NPUGraph has no enable_debug_mode (it dumps without): nothing to call."""
    with_it = _DumpsOnlyIfEnabled()
    _HostTorchGraph(torch.device("cpu", 0), with_it).enable_debug_mode()
    assert with_it.debug_mode
    _HostTorchGraph(torch.device("cpu", 0), object()).enable_debug_mode()


def _cuda_graph_dumps(path) -> bool:
    """Whether a plain torch.cuda.CUDAGraph, captured after enable_debug_mode(),
    writes its debug dump on this build (torch 2.11 on an H100 wrote nothing,
    2026-11-25)."""
    graph, stream, x = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.zeros(4, device="cuda")
    graph.enable_debug_mode()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        x.add_(1)
        graph.capture_end()
    torch.cuda.synchronize()
    graph.debug_dump(str(path))
    return path.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_write_their_debug_dump_in_debug_mode(tmp_path, monkeypatch):
    """torch.cuda.CUDAGraph writes a DOT file only after enable_debug_mode():
    where a plain graph writes one, the runner's graphs do too."""
    if not _cuda_graph_dumps(tmp_path / "plain.dump"):
        pytest.skip("torch.cuda.CUDAGraph.debug_dump wrote nothing for a plain graph on this build")
    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path))
    setup = tiny_setup("cuda", device="cuda", capture_batch_sizes=[4], debug=True)
    seqs = setup.prefill(3)
    for _ in range(2):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4)
    dump = tmp_path / "bucket4-q1.dump"
    assert dump.read_text().startswith("digraph"), dump.read_text()[:200]


VENDORS = ["cuda", "ascend", "camb", "maca", "ppu"]


def _piecewise(vendor, mode):
    return tiny_setup(vendor, capture_batch_sizes=[2, 4], cache_blocks=40, debug=True, execute_mode=mode,
                      capture_token_sizes=[8, 16, 32])


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VENDORS)
def test_debug_mode_checks_piecewise_steps_addresses(vendor, mode):
    # A weight reload without reset: the piecewise graph replayed the old weights, silently.
    setup = _piecewise(vendor, mode)
    setup.prefill(2, [3, 4])  # captures token bucket 8
    with torch.inference_mode():
        _moved_weight(setup)
    with pytest.raises(InputError, match=r"debug mode: model parameter 'layers.1.down_proj.weight' is at address "
                       r"0x[0-9a-f]+, but the graph of token bucket 8 \(piecewise\) captured it at .*runner.reset"):
        setup.prefill(2, [2, 5])
    setup.runner.reset()
    setup.prefill(2, [2, 5])  # captured again on the new weights


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("vendor", VENDORS)
def test_debug_mode_checks_piecewise_steps_values(vendor, mode):
    # A block id past the cache in a piecewise step crashed with an IndexError.
    setup = _piecewise(vendor, mode)
    seqs = setup.prefill(2, [3, 4])
    step = setup.engine.prefill(seqs, [2, 3])
    for changes, message in (
        ({"block_offsets": _table(step, 1, 5, 40)},
         r"sequence 1's block table holds block id 40 \(column 5\), outside the cache's 40 blocks"),
        ({"kv_start_indices": _slots(step, 0, int(step.attn_metadata.block_offsets[1, 0]) * 16 + 9)},
         r"token 0 \(sequence 0\) writes slot \d+ \(block \d+\), outside the sequence's own blocks"),
        ({"q_start_loc": torch.tensor([0, 1], dtype=torch.int32)},
         r"sequence 1 has q_start_loc=1, but its tokens start at token 2"),
    ):
        with pytest.raises(InputError, match="debug mode: " + message):
            _run(setup, step, **changes)
    with torch.inference_mode():  # the right step passes and matches eager
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


def test_debug_mode_captures_and_dumps_every_segment_of_a_piecewise_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_DEBUG_DUMP", str(tmp_path / "dumps"))
    _DebugDumpVendor.graphs = []
    setup = tiny_setup("dumps", plugin=_DebugDumpVendor(), execute_mode="piecewise", capture_token_sizes=[4, 64],
                       debug=True)
    seqs = setup.prefill(3)
    for _ in range(2):
        graph, eager = setup.decode(seqs)
        torch.testing.assert_close(graph, eager)
    segments = setup.model.config.num_hidden_layers + 1  # the pieces between attention calls
    assert all(g.enabled_at_capture for g in _DebugDumpVendor.graphs)
    dumps = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert {f"tokens4-segment{i}.dump" for i in range(1, segments + 1)} <= set(dumps)
    assert "replay" in (tmp_path / "dumps" / "tokens4-segment1.dump").read_text()


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_debug_mode_checks_a_piecewise_step_against_its_host_maxima(mode):
    # A piecewise break point hands the kernel the step's own maxima: CUDA's
    # Triton prefill sizes its grid by max_q_seq_len and skipped the query rows
    # past it (the reference kernels ignore it, so graph and eager agreed here).
    setup = _piecewise("cuda", mode)
    seqs = setup.prefill(3, [3, 4, 2])
    step = setup.engine.prefill(seqs, [1, 9, 2])  # 12 tokens, 3 sequences: max_q_seq_len 4 passes the host check
    for changes, message in (
        ({"max_q_seq_len": 4}, r"sequence 1 has q_seqlens=9, above max_q_seq_len=4"),
        ({"max_kv_seq_len": 11}, r"sequence 1 has kv_seqlens=13, above max_kv_seq_len=11"),
        # (0 is a padding row's, legal since rows of zero new tokens are: docs/engines.md)
        ({"q_seqlens": torch.tensor([3, -1, 10], dtype=torch.int32), "q_start_loc": torch.tensor([0, 3, 2])},
         r"sequence 1 has q_seqlens=-1, below 0"),
    ):
        host = step.attn_metadata.kv_seqlens_cpu if "max_kv_seq_len" not in changes else None  # past the host check
        with pytest.raises(InputError, match="debug mode: " + message):
            _run(setup, step, kv_seqlens_cpu=host, **changes)
    graph, eager = (_run(setup, step).clone(), None)
    with torch.inference_mode():
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["graph", "piecewise", "full_and_piecewise"])
def test_a_draft_padding_token_past_the_sequences_blocks_passes(mode):
    # A drafter's step padded to one q_len: sequence 0 (15 cached tokens) feeds 1 live token and 1 padding
    # token (slot -1) whose position, 16, falls in a block the engine has not given it yet (column 1 is 0).
    # No live token reads position 16 (each sees only positions up to its own), so eager and graph steps run
    # it alike; debug mode refused it ("sequence 0 uses block 0 ... and writes the cache").
    setup = tiny_setup(capture_batch_sizes=[2, 4], cache_blocks=40, debug=True, max_q_len=2, execute_mode=mode,
                       capture_token_sizes=[4, 8])
    seqs = setup.prefill(2, [15, 5])
    setup.decode(seqs, 2)  # captures (bucket 2, q_len 2) / token bucket 4: 17 and 7 tokens cached
    setup.engine.sequences[seqs[0]].kv_len -= 2  # step back: sequence 0 holds 15 tokens again
    setup.engine.sequences[seqs[0]].blocks.pop()
    step = setup.engine.decode(seqs, 2)
    attn = step.attn_metadata
    assert attn.block_offsets[0, 1] != 0 and attn.kv_seqlens.tolist()[0] == 17
    slots = attn.kv_start_indices.clone()
    slots[1] = -1  # sequence 0's second token: padding
    table = attn.block_offsets.clone()
    table[0, 1] = 0
    padded = attn.replace(kv_start_indices=slots, block_offsets=table)
    with torch.inference_mode():
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, padded).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, padded)
    live = [0, 2, 3]  # the padding token's output means nothing
    torch.testing.assert_close(graph[:, live], eager[:, live], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("writer", [0, 2])
def test_a_write_into_another_live_sequences_cached_token_is_refused(writer):
    # A finished sequence's row (or a shared block written without copying it) whose table still holds
    # sequence 1's first block: its slot is its own position there, so the per-sequence checks pass, and the
    # write replaced sequence 1's cached token silently, in graph and eager steps alike.
    setup, seqs = _setup()
    step = setup.engine.decode(seqs)
    attn = step.attn_metadata
    table, slots = attn.block_offsets.clone(), attn.kv_start_indices.clone()
    position = int(attn.kv_seqlens[writer]) - 1
    assert position < min(16, int(attn.kv_seqlens[1]) - 1)  # a cached token in sequence 1's first block
    table[writer, 0] = table[1, 0]
    slots[writer] = int(table[1, 0]) * 16 + position
    bad = attn.replace(block_offsets=table, kv_start_indices=slots)
    with pytest.raises(InputError, match=rf"debug mode: token {writer} \(sequence {writer}\) writes slot \d+, sequence 1's cached "
                       rf"token {position} \(column 0 of its table\)"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, bad)


@pytest.mark.parametrize("debug", [True, False])
def test_an_eager_steps_bad_block_id_is_named_in_debug_mode_and_noted_outside_it(debug):
    # A newcomer's engine (2026-12-04): a prefill's block id past the cache, eager in execute mode "graph",
    # failed with a bare IndexError even with debug=True, which checked graph steps only.
    setup = tiny_setup(capture_batch_sizes=[2, 4], cache_blocks=40, debug=debug)
    seq = setup.engine.add()
    step = setup.engine.prefill([seq], [20])
    table = step.attn_metadata.block_offsets.clone()
    table[0, 1] = 1000
    with torch.inference_mode():
        if debug:
            with pytest.raises(InputError, match=r"debug mode: sequence 0's block table holds block id 1000 \(column "
                               r"1\), outside the cache's 40 blocks"):
                setup.runner(step.input_ids, step.position_ids, setup.graph_cache,
                             step.attn_metadata.replace(block_offsets=table))
            return
        with pytest.raises(IndexError) as failed:
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache,
                         step.attn_metadata.replace(block_offsets=table))
    assert any("raised by the model in an eager step (prefill: no graph ran)" in note and "GRAPHMODE_DEBUG=1" in note
               for note in getattr(failed.value, "__notes__", []))

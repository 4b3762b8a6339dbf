"""Piecewise graphs on the CPU emulator: prefill, mixed and decode steps replay
segment graphs around eager attention and equal the eager model, for every
installed vendor, with padding, batch churn and freed blocks reused; what
cannot work is refused with a reason."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch
from setups import Setup, tiny_setup

import graphmode
from graphmode import CaptureError, ConfigError, InputError
from graphmode.attention import ReferenceAttentionOps
from graphmode.emulator import EmulatedPool
from graphmode.families.piecewise import default_token_sizes, host_break
from graphmode.families.piecewise.breaks import writes_kv_in_graph
from graphmode.graphs.torch_graph import stream_capturing
from graphmode.plugins import installed_vendor_names

VENDORS = installed_vendor_names()
MODES = ["piecewise", "full_and_piecewise"]
TOKENS = [4, 8, 16, 32, 64]


def piecewise_setup(vendor: str = "cuda", mode: str = "piecewise", **options) -> Setup:
    options.setdefault("capture_token_sizes", TOKENS)
    options.setdefault("capture_batch_sizes", [1, 2, 4, 8])
    return tiny_setup(vendor, execute_mode=mode, **options)


class ForwardCounter:
    """Counts the model's Python forwards: a replay runs none."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1


def run_step(setup: Setup, step) -> tuple[torch.Tensor, torch.Tensor]:
    """One step through the runner and through the eager model."""
    with torch.inference_mode():
        graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    return graph, eager


def assert_same(setup: Setup, graph: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    assert graph.shape == eager.shape, what
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5, msg=what)
    assert setup.caches_close(), f"KV caches differ after {what}"


def assert_padding_never_wrote(setup: Setup) -> None:
    """Padding tokens never write into the cache: wherever the eager model
    never wrote (block 0, blocks never allocated, the unused tail of
    blocks), the graph runner's cache still holds zeros too."""
    for pair_graph, pair_eager in zip(setup.graph_cache, setup.eager_cache):
        for graph, eager in zip(pair_graph, pair_eager):
            untouched = eager == 0
            assert untouched.any() and torch.count_nonzero(graph[untouched]) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vendor", VENDORS)
def test_prefill_mixed_and_decode_steps_equal_eager(vendor, mode):
    setup = piecewise_setup(vendor, mode, max_batches=12, cache_blocks=48, capture_batch_sizes=[1, 4, 12])
    engine, forwards = setup.engine, ForwardCounter(setup.model)
    steps = 0

    def check(step, what: str) -> None:
        nonlocal steps
        steps += 1
        assert_same(setup, *run_step(setup, step), what)

    # Prefill: one sequence of several lengths, then four at once.
    for length in (1, 5, 16, 29):
        seq = engine.add()
        check(engine.prefill([seq], [length]), f"prefill of {length}")
    first = engine.live()
    four = [engine.add() for _ in range(4)]
    check(engine.prefill(four, [3, 9, 1, 14]), "prefill of 4 sequences")
    # Mixed steps: decodes (one token) with a prefill chunk, as chunked prefill schedules them.
    for chunk in (7, 12):
        newcomer = engine.add()
        step = engine.prefill([*first, newcomer], [1] * len(first) + [chunk])
        check(step, f"mixed step with a {chunk}-token chunk")
    # Decode steps, then churn: finished sequences free their blocks, new ones reuse them.
    live = engine.live()
    for round_ in range(3):
        for _ in range(2):
            check(engine.decode(live), f"decode of {len(live)} in round {round_}")
        for seq in live[: 2 + round_]:
            engine.finish(seq)
        fresh = [engine.add() for _ in range(2)]
        check(engine.prefill(fresh, [6, 11]), f"prefill after churn {round_}")
        live = engine.live()
    assert_padding_never_wrote(setup)
    stats, piecewise = setup.runner.stats, setup.runner.family("piecewise")
    assert piecewise is not None and stats.piecewise_replays >= 5
    assert stats.padded_tokens > 0 and not stats.eager_steps
    captured = len(piecewise.captured_buckets) + len(setup.runner.captured_buckets)
    # The model's Python ran once per eager reference and twice per capture
    # (warm-up and capture), never for a replay.
    assert forwards.calls == steps + 2 * captured
    if mode == "full_and_piecewise":
        assert stats.replays >= 1  # uniform decode replayed full graphs


def test_replays_run_no_python_forward_and_segments_break_at_attention():
    setup = piecewise_setup()
    counter = ForwardCounter(setup.model)
    seqs = [setup.engine.add() for _ in range(3)]
    run_step(setup, setup.engine.prefill(seqs, [5, 1, 9]))  # 15 tokens: bucket 16, captured
    calls_after_capture = counter.calls
    for _ in range(3):
        run_step(setup, setup.engine.prefill(seqs, [4, 4, 4]))  # 12 tokens: bucket 16, replayed
    graph_calls = counter.calls - calls_after_capture - 3  # the eager references ran 3 forwards
    assert calls_after_capture == 3 and graph_calls == 0  # warm-up, capture, eager reference
    graph = setup.runner.family("piecewise").graph(16)
    layers = setup.model.config.num_hidden_layers
    # One segment before each layer's attention and one after the last; the
    # reference ops' cache write is captured in the segment (no empty segment
    # and no break point of its own), so each gap is the attention alone.
    assert len(graph.pieces.segments) == layers + 1
    assert [[type(call).__name__ for call in gap] for gap in graph.pieces.gaps] == [["Attention"]] * layers + [[]]
    assert setup.runner.stats.piecewise_replays == 3


class UndeclaredWrite(ReferenceAttentionOps):
    """Overrides fill_kv_cache without declaring kv_write_in_graph: a write
    graphmode knows nothing about stays at the break points."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        super().fill_kv_cache(key, value, k_cache, v_cache, attn)


@pytest.mark.parametrize("ops", ["declared", "undeclared"])
def test_a_kv_write_is_captured_in_the_segment_only_where_its_ops_declare_it(ops):
    """Captured (the reference ops declare kv_write_in_graph) or run at the
    break point on the live tokens (an override that does not): graph equals
    eager, caches equal, and the padding tokens of a bucket larger than the
    step (slots -1 in the static buffer) write nothing."""
    setup = piecewise_setup()
    if ops == "undeclared":
        undeclared = UndeclaredWrite()
        for module in setup.model.modules():
            if getattr(module, "ops", None) is not None:
                module.ops = undeclared
        setup.runner = graphmode.build_graph_runner(setup.model, max_batches=16, max_blocks_per_seq=8, block_size=16,
                                                    device="cpu", execute_mode="piecewise", capture_token_sizes=TOKENS)
    assert writes_kv_in_graph(setup.model.ops) is (ops == "declared")
    seqs = [setup.engine.add() for _ in range(3)]
    for lengths in ([5, 1, 9], [2, 3, 4], [1, 1, 1]):  # buckets 16, 16 (replayed) and 4
        assert_same(setup, *run_step(setup, setup.engine.prefill(seqs, lengths)), f"prefill {lengths}")
    assert_padding_never_wrote(setup)
    expected = ["Attention"] if ops == "declared" else ["KVWrite", "Attention"]
    gaps = [[type(call).__name__ for call in gap] for gap in setup.runner.family("piecewise").graph(16).pieces.gaps]
    assert gaps == [expected] * setup.model.config.num_hidden_layers + [[]]


@pytest.mark.parametrize("returns", ["out", "None"])
def test_an_attention_kernel_taking_out_writes_the_buffer_the_next_segment_reads(returns):
    # A kernel that takes `out` (the CUDA plugin's prefill on a GPU): the
    # break point hands it the static buffer's rows instead of copying its
    # result there.
    setup = piecewise_setup()
    ops = setup.model.ops
    base = type(ops)
    written: list[int | None] = []

    class Recording(base):  # type: ignore[misc, valid-type]
        def prefill_attention(self, query, k_cache, v_cache, attn, scale, out=None):
            written.append(None if out is None else out.data_ptr())
            result = base.prefill_attention(self, query, k_cache, v_cache, attn, scale)
            if out is None:
                return result
            out.copy_(result)
            return out if returns == "out" else None  # None: as a C kernel with an output argument might

    ops.__class__ = Recording
    seqs = [setup.engine.add() for _ in range(3)]
    assert_same(setup, *run_step(setup, setup.engine.prefill(seqs, [5, 1, 9])), "captured")
    written.clear()
    assert_same(setup, *run_step(setup, setup.engine.prefill(seqs, [4, 4, 4])), "replayed")
    layers = setup.model.config.num_hidden_layers
    buffers = [gap[-1].out.data_ptr() for gap in setup.runner.family("piecewise").graph(16).pieces.gaps[:layers]]
    assert written == [*buffers] + [None] * layers  # the graph's calls, then the eager reference's


def test_graph_equals_eager_for_every_token_count_up_to_the_largest_bucket():
    setup = piecewise_setup(max_batches=4, capture_batch_sizes=None, capture_token_sizes=[1, 2, 4, 8, 16, 24, 32], cache_blocks=33)
    for tokens in range(1, 33):
        seq = setup.engine.add()
        assert_same(setup, *run_step(setup, setup.engine.prefill([seq], [tokens])), f"{tokens} tokens")
        setup.engine.finish(seq)
    assert setup.runner.family("piecewise").captured_buckets == [1, 2, 4, 8, 16, 24, 32]


def test_a_step_above_the_largest_token_bucket_runs_eagerly_with_a_reason():
    setup = piecewise_setup(capture_token_sizes=[4, 8])
    seq = setup.engine.add()
    assert_same(setup, *run_step(setup, setup.engine.prefill([seq], [9])), "9 tokens")
    assert setup.runner.stats.eager_steps == {"no_token_bucket": 1}
    assert setup.runner.family("piecewise").captured_buckets == []
    assert "no_token_bucket" in graphmode.runner.EAGER_REASONS


def test_graph_mode_still_runs_prefill_eagerly():
    setup = tiny_setup(execute_mode="graph")
    seq = setup.engine.add()
    run_step(setup, setup.engine.prefill([seq], [5]))
    assert setup.runner.family("piecewise") is None and setup.runner.stats.eager_steps == {"prefill": 1}


@pytest.mark.parametrize("mode", MODES)
def test_warmup_captures_both_kinds_largest_first_into_one_pool(mode):
    setup = piecewise_setup("cuda", mode)
    setup.runner.warmup(setup.graph_cache, progress=False)
    runner = setup.runner
    assert runner.family("piecewise").captured_buckets == sorted(TOKENS, reverse=True)
    full = [8, 4, 2, 1] if mode == "full_and_piecewise" else []
    assert runner.captured_buckets == full
    pool = runner.family("piecewise").graph(max(TOKENS)).pieces.segments[0].pool()  # the first graph captured
    assert isinstance(pool, EmulatedPool)
    segments = sum(len(runner.family("piecewise").graph(b).pieces.segments) for b in TOKENS)
    assert pool.num_graphs == segments + len(full)  # every graph in the one pool
    # The warm-up steps were inert: the cache is still all zeros.
    assert all(torch.count_nonzero(t) == 0 for pair in setup.graph_cache for t in pair)
    # Served steps replay only.
    seqs = [setup.engine.add() for _ in range(3)]
    assert_same(setup, *run_step(setup, setup.engine.prefill(seqs, [5, 1, 9])), "prefill after warm-up")
    for _ in range(2):
        assert_same(setup, *run_step(setup, setup.engine.decode(seqs)), "decode after warm-up")
    stats = runner.stats
    assert stats.piecewise_captures == len(TOKENS) and stats.captures == len(full)
    assert stats.piecewise_replays + stats.replays == 3


def test_default_token_buckets_are_vllms_list():
    assert default_token_sizes(4) == (1, 2, 4, 8)
    assert default_token_sizes(10) == (1, 2, 4, 8, 16, 20)
    sizes = default_token_sizes(1024)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    setup = tiny_setup(execute_mode="piecewise", max_batches=16)
    assert setup.runner.family("piecewise").sizes == default_token_sizes(16)


def test_reset_drops_piecewise_graphs_and_the_next_step_captures_again():
    setup = piecewise_setup()
    seqs = [setup.engine.add() for _ in range(2)]
    run_step(setup, setup.engine.prefill(seqs, [3, 3]))
    setup.runner.reset()
    assert setup.runner.family("piecewise").captured_buckets == []
    assert_same(setup, *run_step(setup, setup.engine.prefill(seqs, [3, 3])), "after reset")
    assert setup.runner.stats.piecewise_captures == 2


# -- refusals ------------------------------------------------------------------


def test_unknown_execute_mode_lists_the_modes():
    with pytest.raises(ConfigError, match="graph, piecewise, full_and_piecewise, eager"):
        tiny_setup(execute_mode="pieces")


def test_bad_token_sizes_are_refused():
    with pytest.raises(ConfigError, match=r"capture_token_sizes has \[0\]"):
        tiny_setup(execute_mode="piecewise", capture_token_sizes=[0, 4])
    with pytest.raises(ConfigError, match="capture_token_sizes is empty"):
        tiny_setup(execute_mode="piecewise", capture_token_sizes=[])


def test_a_model_without_attention_ops_is_refused():
    def model(input_ids, position_ids, past_key_values, attn_metadata):
        return torch.zeros((1, input_ids.shape[1], 4))

    with pytest.raises(ConfigError, match="no AttentionOps object at `model.ops`"):
        graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=4, block_size=16, device="cpu",
                                     execute_mode="piecewise")


def test_a_segment_reading_the_attention_metadata_fails_at_capture():
    """A segment that read the step's metadata would replay the capture
    step's values; it fails at capture instead."""

    class ReadsLengths(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.ops, self.config = model, model.ops, model.config

        def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
            logits = self.model(input_ids, position_ids, past_key_values, attn_metadata)
            return logits + attn_metadata.kv_seqlens.sum()  # outside the attention calls

    setup = piecewise_setup()
    runner = graphmode.build_graph_runner(ReadsLengths(setup.model), max_batches=16, max_blocks_per_seq=8, block_size=16,
                                          device="cpu", execute_mode="piecewise")
    step = setup.engine.prefill([setup.engine.add()], [3])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="meta") as raised:
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    assert "Read it only inside the vendor's AttentionOps" in "".join(getattr(raised.value, "__notes__", []))
    assert "keep them at `.ops`" in "".join(getattr(raised.value, "__notes__", []))  # ops elsewhere are not intercepted


def test_another_kv_cache_is_refused_at_replay():
    setup = piecewise_setup()
    seqs = [setup.engine.add()]
    run_step(setup, setup.engine.prefill(seqs, [3]))
    step = setup.engine.prefill(seqs, [2])
    with torch.inference_mode(), pytest.raises(InputError, match="runner.reset()"):
        setup.runner(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)


@pytest.mark.parametrize("vendor", VENDORS)
def test_host_break_inside_a_full_graph_capture_is_refused(vendor):
    """On the emulator of every vendor, the Ascend one's NPU-like graphs included."""
    setup = tiny_setup(vendor, execute_mode="graph")
    original = setup.model.norm.forward
    setup.model.norm.forward = lambda x: host_break(original, x)
    seqs = [setup.engine.add()]
    run_step(setup, setup.engine.prefill(seqs, [2]))
    step = setup.engine.decode(seqs)
    with torch.inference_mode(), pytest.raises(CaptureError, match="execute_mode='piecewise'"):
        setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)


@pytest.mark.parametrize("device_type", ["npu", "mlu"])
def test_host_break_asks_each_device_runtime_about_its_own_streams(device_type, monkeypatch):
    """torch_npu (torch.npu) and torch_mlu (torch.mlu) each have their own
    is_current_stream_capturing; torch.cuda's sees only CUDA streams. The
    runtime here is a module with those two real names and a switch, as
    torch_npu and torch_mlu cannot be installed on this machine."""
    capturing = False
    runtime = types.ModuleType(f"torch.{device_type}")
    runtime.is_available = lambda: True  # type: ignore[attr-defined]
    runtime.is_current_stream_capturing = lambda: capturing  # type: ignore[attr-defined]
    monkeypatch.setattr(torch, device_type, runtime, raising=False)
    assert host_break(lambda x: x + 1, 1) == 2
    assert not stream_capturing(device_type)
    capturing = True
    assert stream_capturing(device_type) and not stream_capturing("cuda")
    with pytest.raises(CaptureError, match=r"host_break\(.*\) inside a full-graph capture"):
        host_break(lambda x: x + 1, 1)
    runtime.is_available = lambda: False  # type: ignore[attr-defined]  # no device: nothing captures
    assert host_break(lambda x: x + 1, 1) == 2


def test_a_vendor_states_its_default_execute_mode(monkeypatch):
    """The runner takes the vendor's default when the engine names no mode;
    a named mode, and $GRAPHMODE_EXECUTE_MODE, win over it."""
    from test_plugins import FakeDistribution

    from graphmode.plugins import VendorInfo

    dists = [FakeDistribution("graphmode-pw", {"piecewise_default": "plugins.piecewise_default"})]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: dists)
    monkeypatch.delenv("GRAPHMODE_EXECUTE_MODE", raising=False)
    model = piecewise_setup().model

    def build(**options):
        return graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=8, block_size=16, device="cpu",
                                            vendor="piecewise_default", **options)

    assert build().config.execute_mode == "full_and_piecewise"
    assert build().family("piecewise") is not None
    assert build(execute_mode="graph").config.execute_mode == "graph"
    monkeypatch.setenv("GRAPHMODE_EXECUTE_MODE", "eager")
    assert build().config.execute_mode == "eager"
    assert graphmode.load_vendor("cuda").info.execute_mode == "graph"  # the built-in default is unchanged
    with pytest.raises(ValueError, match="execute_mode 'fast'"):
        VendorInfo("pw", ("cuda",), "none", None, False, "test", execute_mode="fast")


def test_hugging_face_model_in_piecewise_graphs_gives_hf_greedy_tokens(tmp_path):
    """The HF adapter, unchanged, through full_and_piecewise: prefill and
    speculative verify steps replay piecewise graphs, decode steps full
    graphs, and the tokens equal ``generate``'s."""
    transformers = pytest.importorskip("transformers")
    from test_huggingface import BLOCK_SIZE, MAX_BATCH, WIDTH, make_requests, serve_hf

    from graphmode.integrations.huggingface import load_model, random_config

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(random_config("llama-tiny")).eval()
    reference.save_pretrained(tmp_path)
    expected = []
    for item in make_requests():
        prompt = torch.tensor([item.prompt])
        out = reference.generate(prompt, max_new_tokens=item.max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        expected.append(out[0, prompt.shape[1]:].tolist())
    model = load_model(tmp_path)
    kv_cache = model.make_kv_cache(MAX_BATCH * WIDTH + 1, BLOCK_SIZE)
    runner = graphmode.build_graph_runner(model, max_batches=MAX_BATCH, max_blocks_per_seq=WIDTH, block_size=BLOCK_SIZE,
                                          execute_mode="full_and_piecewise", capture_token_sizes=[4, 8, 16])
    batch = serve_hf.PagedBatch(MAX_BATCH * WIDTH + 1, BLOCK_SIZE, WIDTH, torch.device("cpu"))
    requests = make_requests()
    eos = model.config.eos_token_id
    steps = serve_hf.serve(runner, kv_cache, batch, requests, max_batch=MAX_BATCH, speculate=3,
                           eos={eos} if isinstance(eos, int) else set(eos or []))
    assert [r.output for r in requests] == expected
    stats = runner.stats
    assert steps["verify"] >= 1 and not stats.eager_steps
    assert stats.piecewise_captures + stats.piecewise_replays == steps["prefill"] + steps["verify"]
    assert stats.piecewise_replays >= 3 and stats.captures + stats.replays == steps["decode"]


# -- offloaded layers (seed 004) -------------------------------------------------


@pytest.mark.parametrize("num_buffers", [1, 2])
@pytest.mark.parametrize("vendor", VENDORS)
def test_offloaded_layers_replay_per_layer_graphs_with_host_loads_between(vendor, num_buffers):
    """Decode and prefill steps of a model whose layers run from a ring of
    weight buffers: the loads run between the layer graphs at every replay, so
    the results equal the eager model's, even after the host weights change."""
    from graphmode.model import ModelConfig, build_reference_model
    from graphmode.model.engine import ReferenceEngine
    from graphmode.model.offload import OffloadedLlama

    config = ModelConfig.tiny()
    model = build_reference_model(config, graphmode.load_vendor(vendor))
    offloaded = OffloadedLlama(model, num_buffers=num_buffers)
    runner = graphmode.build_graph_runner(offloaded, max_batches=8, max_blocks_per_seq=8, block_size=16, device="cpu",
                                          vendor=vendor, execute_mode="piecewise", capture_token_sizes=[4, 8, 16])
    engine = ReferenceEngine(65, 16, "cpu", vocab_size=config.vocab_size, table_width=8, seed=3)
    setup = Setup(model, engine, offloaded.make_kv_cache(65, 16), model.make_kv_cache(65, 16), runner)
    seqs = [engine.add() for _ in range(3)]
    assert_same(setup, *run_step(setup, engine.prefill(seqs, [4, 2, 7])), "prefill")
    layers = config.num_hidden_layers
    for step in range(4):
        if step == 2:  # the engine updates layer 1's weights on the host; the eager model gets the same
            with torch.no_grad():
                for host, param in zip(offloaded.host_weights[1], model.layers[1].parameters()):
                    host.mul_(1.5)
                    param.mul_(1.5)
        loads = offloaded.loads
        assert_same(setup, *run_step(setup, engine.decode(seqs)), f"decode {step}")
        if step >= 1:  # replayed: every layer loaded once, between the graphs
            assert offloaded.loads - loads == layers
    graph = runner.family("piecewise").graph(4)
    # Per layer: a load, then the layer's graphs around its attention.
    assert len(graph.pieces.segments) == 2 * layers + 1
    kinds = [[type(call).__name__ for call in gap] for gap in graph.pieces.gaps]
    assert kinds == [["HostWork"], ["Attention"]] * layers + [[]]  # the KV write is in the segment
    assert runner.stats.piecewise_replays == 3


def test_steps_built_on_the_host_run_piecewise_with_eager_results():
    """Host inputs (an engine scheduling on the CPU) reach the piecewise
    graphs and the eager break points on the device."""
    setup = piecewise_setup(mode="full_and_piecewise", host_inputs=True)
    seqs = [setup.engine.add() for _ in range(3)]
    for lengths in ([5, 1, 9], [4, 4, 4], [6, 6, 1]):  # 15, 12, 13 tokens: token bucket 16
        step = setup.engine.prefill(seqs, lengths)
        with torch.inference_mode():
            graph = setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata).clone()
            device_step = graphmode.staging.to_device(step, torch.device("cpu"))
            eager = setup.model(**{**device_step.as_kwargs(), "past_key_values": setup.eager_cache})
        assert_same(setup, graph, eager, f"host step {lengths}")
    assert setup.runner.stats.piecewise_replays == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_host_step_whose_lengths_cannot_hold_is_refused(mode):
    """A piecewise break point hands the kernel the step's own maxima, and
    CUDA's Triton prefill sizes its grid by max_q_seq_len: a query longer than
    it kept its rows from an earlier step (the reference kernels ignore the
    maximum, so graph and eager agreed here); query lengths that miss a token,
    or host lengths other than the device's (Ascend reads them), gave silently
    wrong results. Host lengths cost no synchronisation to read: a host step's
    sum, maxima and host lengths are checked without debug mode."""
    setup = piecewise_setup(mode=mode, host_inputs=True)
    seqs = setup.prefill(3, [3, 4, 2])
    step = setup.engine.prefill(seqs, [1, 9, 2])  # 12 tokens, 3 sequences: max_q_seq_len 4 passes the count check
    host = graphmode.emulator.mark_host
    for changes, message in (
        ({"max_q_seq_len": 4}, r"sequence 1 has q_seqlens=9, above max_q_seq_len=4"),
        ({"max_kv_seq_len": 11, "kv_seqlens_cpu": None}, r"sequence 1 has kv_seqlens=13, above max_kv_seq_len=11"),
        ({"q_seqlens": host(torch.tensor([1, 8, 2], dtype=torch.int32))}, r"q_seqlens \[1, 8, 2\] sum to 11, but the "
         r"step has 12 new tokens"),
        ({"kv_seqlens_cpu": host(torch.tensor([4, 12, 4], dtype=torch.int32))},
         r"sequence 1 has kv_seqlens_cpu=12 but kv_seqlens=13; kernels that take host lengths \(Ascend\)"),
    ):
        with pytest.raises(InputError, match=message), torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata.replace(**changes))
    assert setup.runner.stats.piecewise_replays == 0


class _ReadsTheDeviceBetweenLayers(torch.nn.Module):
    """The reference model, reading a device value on the host after its
    last attention call: not capturable in a segment."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.ops = model, model.config, model.ops

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        out = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
        return out * (1 + 0 * out.sum().item())


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_piecewise_capture_names_the_segment_and_capture_token_sizes(mode):
    setup = piecewise_setup("cuda", mode)
    runner = graphmode.build_graph_runner(
        _ReadsTheDeviceBetweenLayers(setup.model), max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu",
        execute_mode=mode, capture_token_sizes=TOKENS, capture_batch_sizes=[1, 2, 4, 8],
    )
    step = setup.engine.prefill([setup.engine.add()], [5])
    with pytest.raises(CaptureError) as error, torch.inference_mode():
        runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
    notes = "".join(getattr(error.value, "__notes__", []))
    layers = setup.model.config.num_hidden_layers
    assert f"while capturing segment {layers + 1} of the piecewise graph of token bucket 8 (cuda)" in notes
    assert f"its sizes come from capture_token_sizes, and execute_mode={mode!r}" in notes


def test_a_narrower_block_wide_step_input_pads_the_columns_past_its_width():
    # A (SEQUENCES, BLOCKS) step input narrower than the buffer: the live rows'
    # columns past this step's width hold the padding, not the last step's values.
    from graphmode.context import StepInputs
    from graphmode.families.piecewise.inputs import TokenInputs
    from graphmode.model.engine import ReferenceEngine
    from graphmode.spec import BLOCKS, SEQUENCES, BufferSpec

    spec = BufferSpec("adapter_blocks", torch.int32, shape=(SEQUENCES, BLOCKS), padding=0)
    inputs = TokenInputs(16, [spec], 8, torch.device("cpu"))
    engine = ReferenceEngine(64, 16, "cpu", vocab_size=256, table_width=8, seed=7)
    seqs = [engine.add() for _ in range(2)]
    step = engine.prefill(seqs, [3, 2])

    def fill(width: int, value: int):
        table = torch.full((2, width), value, dtype=torch.int32)
        given = StepInputs(step.input_ids, step.position_ids, None, step.attn_metadata, {"adapter_blocks": table})
        return inputs.fill(given, 8).extras["adapter_blocks"]

    fill(4, 7)
    buffer = fill(2, 5)
    assert buffer[:2, :2].eq(5).all() and buffer[:2, 2:].eq(0).all(), buffer

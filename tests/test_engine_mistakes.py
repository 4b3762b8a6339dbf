"""Engine mistakes that graph mode alone used to let through silently, or
answer with a raw error from inside (issues 21 and 22): each is now refused
at the door with the value, the limit and the fix, on every shipped vendor
and in every execute mode where it applies."""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings

import hangs
import pytest
import torch
from setups import tiny_setup

from graphmode import AttnMetadata, CaptureError, InputError, StepInputs
from graphmode.emulator.host import mark_host
from graphmode.model import ModelConfig, build_reference_model
from graphmode.spec import TOKENS, BufferSpec

VENDORS = ["cuda", "ascend", "camb", "maca", "ppu"]
MODES = ["graph", "piecewise", "full_and_piecewise"]


def _setup(vendor="cuda", mode="graph", **options):
    return tiny_setup(vendor, capture_batch_sizes=[1, 2, 4], execute_mode=mode, capture_token_sizes=[4, 8, 16],
                      **options)


def _run(setup, step, cache=None, **changes):
    with torch.inference_mode():
        return setup.runner(step.input_ids, step.position_ids, setup.graph_cache if cache is None else cache,
                            step.attn_metadata.replace(**changes))


# -- one step at a time ---------------------------------------------------------


class _Gate(torch.nn.Module):
    """The model, paused inside its forward until released."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.config = model, model.config
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, *args, **kwargs):
        self.entered.set()
        hangs.wait(self.release, "the test releasing the gate")
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["reset", "warmup"])
def test_reset_or_warmup_from_another_thread_during_a_step_is_refused(mode, method):
    # A reset under a running step left 2 to 30 of 30 steps wrong, or "a replay of a graph that is empty".
    setup = _setup(mode=mode)
    gate = _Gate(setup.model)
    setup.runner.model = gate  # every family runs the runner's model
    step = setup.engine.prefill([setup.engine.add()], [20])  # eager in graph mode, above the token buckets
    first = threading.Thread(target=lambda: _run(setup, step))
    first.start()
    hangs.wait(gate.entered, "the first call reaching the model's forward")
    try:
        call = {"reset": setup.runner.reset, "warmup": lambda: setup.runner.warmup(setup.graph_cache, progress=False)}
        with pytest.raises(InputError, match=rf"runner.{method}\(\) called while another call is running"):
            call[method]()
    finally:
        gate.release.set()
        hangs.join(first, "the first call")
    setup.runner.reset()  # free again


# -- the KV cache's memory ------------------------------------------------------


def _set(tensor):
    tensor.set_(tensor.clone())


def _data(tensor):
    tensor.data = tensor.data.clone()


@pytest.mark.parametrize("vendor, mode, move", [
    *[pytest.param(vendor, mode, _set, id=f"set_-{vendor}-{mode}") for vendor in VENDORS for mode in MODES],
    *[pytest.param("cuda", mode, _data, id=f"data-cuda-{mode}") for mode in MODES],
])
def test_a_kv_tensor_given_new_memory_in_place_is_refused_without_debug_mode(vendor, mode, move):
    # The same tensor object over new memory: a device graph keeps the old address.
    setup = _setup(vendor, mode)
    seqs = setup.prefill(2, [5, 9])
    setup.decode(seqs)  # captures the decode graph (piecewise: token bucket 4)
    with torch.inference_mode():
        move(setup.graph_cache[1][0])
    with pytest.raises(InputError, match=r"past_key_values tensor 2 of \d+ has new memory \(data_ptr 0x[0-9a-f]+, "
                       r"captured at 0x[0-9a-f]+\).*call runner.reset\(\) after reallocating"):
        setup.decode(seqs)
    setup.runner.reset()
    graph, eager = setup.decode(seqs)  # captured again on the new memory
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


# -- block tables and lengths ----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vendor", VENDORS)
def test_a_block_table_of_width_zero_is_refused(vendor, mode):
    setup = _setup(vendor, mode)
    seqs = setup.prefill(2, [5, 9])
    step = setup.engine.decode(seqs)
    with pytest.raises(InputError, match=r"attn_metadata.block_offsets has shape \(2, 0\): no block column.*"
                       r"at least ceil\(max_kv_seq_len / block_size\) = 1"):
        _run(setup, step, block_offsets=step.attn_metadata.block_offsets[:, :0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vendor", VENDORS)
def test_kv_lengths_past_the_block_table_are_refused_from_host_facts(vendor, mode):
    # PPU failed a device assertion blaming the graph contexts, others read past the table.
    setup = _setup(vendor, mode)
    seqs = setup.prefill(2, [5, 9])
    setup.decode(seqs)
    step = setup.engine.decode(seqs)
    long = torch.tensor([6, 200], dtype=torch.int32)
    with pytest.raises(InputError, match=r"attn_metadata.kv_seqlens_cpu holds 200 \(sequence 1\), above the 128 "
                       r"tokens the step's block table addresses \(8 blocks x block_size=16\).*engine's kv lengths"):
        _run(setup, step, kv_seqlens=long, kv_seqlens_cpu=long, max_kv_seq_len=-1)
    with pytest.raises(InputError, match=r"max_kv_seq_len=100 is above the 64 tokens the step's block table "
                       r"addresses \(4 blocks x block_size=16\)"):
        _run(setup, step, block_offsets=step.attn_metadata.block_offsets[:, :4], max_kv_seq_len=100)
    assert setup.runner.stats.replays == 0



@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
@pytest.mark.parametrize("wrong", ["q_seqlens", "q_start_loc"])
def test_a_host_built_verify_step_whose_lengths_are_not_its_graphs_is_refused(mode, wrong):
    # A verify step (2 tokens per sequence) replays its graph's q_len pattern. Query lengths [1, 3, 2] under
    # max_q_seq_len=2 (a maximum below an entry), or an inclusive cumsum as q_start_loc, ran silently, and
    # eager steps of the same inputs gave other logits (0.35 and 0.41 off). Host tensors cost no synchronisation.
    setup = _setup(mode=mode, max_q_len=2, host_inputs=True)
    seqs = setup.prefill(3, [5, 9, 3])
    setup.decode(seqs, 2)  # captures bucket 4, q_len 2
    if wrong == "q_seqlens":
        step = setup.engine.decode(seqs, [1, 3, 2])
        changes = {"max_q_seq_len": 2}
        # The understated maximum is named first (issue 40): it is what let the step pass as uniform.
        message = (r"^max_q_seq_len=2, but sequence 1 has q_seqlens=3: the maximum understates the step's query "
                   r"lengths, so its 6 tokens for 3 sequences \(batch x max_q_seq_len\) passed as a decode step of 2 "
                   r"token\(s\) per sequence.*Pass the step's real max_q_seq_len \(the largest q_seqlens, 3\)")
    else:
        step = setup.engine.decode(seqs, 2)
        changes = {"q_start_loc": mark_host(torch.tensor([2, 4, 6], dtype=torch.int32))}
        message = r"^sequence 0 has q_start_loc=2; .* q_start_loc must be arange\(batch\) x 2$"
    with pytest.raises(InputError, match=message):
        _run(setup, step, **changes)
    assert setup.runner.stats.replays == 0


@pytest.mark.parametrize("field, value, message", [
    ("max_kv_seq_len", None, r"attn_metadata.max_kv_seq_len is None; it must be an int"),
    ("max_q_seq_len", 1.0, r"attn_metadata.max_q_seq_len is a float; it must be an int"),
    # A bool is an int to Python (True is 1): a flag passed by mistake would pass as a length.
    ("max_kv_seq_len", True, r"attn_metadata.max_kv_seq_len is a bool; it must be an int"),
    ("max_q_seq_len", True, r"attn_metadata.max_q_seq_len is a bool; it must be an int"),
    # kv_seqlens.max(): a tensor is an index too; every check then read it on the host (on a GPU, a
    # synchronisation per step), and the native step never took such a step.
    ("max_kv_seq_len", torch.tensor(14), r"attn_metadata.max_kv_seq_len is a Tensor; it must be an int.*"
     r"int\(\) of the lengths the engine keeps on the host"),
])
@pytest.mark.parametrize("mode", MODES)
def test_a_host_maximum_that_is_not_an_int_is_named(mode, field, value, message):
    setup = _setup(mode=mode)
    seqs = setup.prefill(2, [5, 9])
    with pytest.raises(InputError, match=message):
        _run(setup, setup.engine.decode(seqs), **{field: value})


@pytest.mark.parametrize("changes, message", [
    ({"max_q_seq_len": 3}, r"max_q_seq_len=3, but 14 new tokens in 2 sequences need a longest query of at least 7"),
    ({"max_kv_seq_len": 5}, r"max_kv_seq_len=5 is below max_q_seq_len=9: a sequence's KV length counts"),
], ids=["q", "kv"])
@pytest.mark.parametrize("mode", MODES)
def test_host_maxima_a_prefill_cannot_have_are_refused(mode, changes, message):
    # A varlen kernel sizes its work by them: too small a maximum reads part of the step, silently.
    setup = _setup(mode=mode)
    step = setup.engine.prefill([setup.engine.add(), setup.engine.add()], [5, 9])
    with pytest.raises(InputError, match=message):
        _run(setup, step, **changes)


@pytest.mark.parametrize("mode", MODES)
def test_a_missing_kv_cache_is_named(mode):
    setup = _setup(mode=mode)
    step = setup.engine.prefill([setup.engine.add()], [5])
    with pytest.raises(InputError, match=r"past_key_values is None; pass the KV cache"):
        with torch.inference_mode():
            setup.runner(step.input_ids, step.position_ids, None, step.attn_metadata)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_without_tokens_is_refused(mode):
    setup = _setup(mode=mode)
    seqs = setup.prefill(2, [5, 9])
    step = setup.engine.prefill(seqs, [0, 0])
    with pytest.raises(InputError, match=r"a step of 2 sequences and 0 new tokens: a step needs at least one "
                       r"new token"):
        _run(setup, step)


# -- engine-declared step inputs ---------------------------------------------------


class _Scaled(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.ops = model, model.config, model.ops

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, token_scale):
        return self.inner(input_ids, position_ids, past_key_values, attn_metadata) * token_scale[None, :, None]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad, message", [
    (lambda n: torch.ones(n, 1), r"step input 'token_scale' has shape \(2, 1\); declared \(TOKENS,\), this step "
     r"of 2 sequences and 2 tokens needs \(2,\)"),
    (lambda n: [1.0] * n, r"step input 'token_scale' is a list; pass a torch.Tensor of shape \(2,\)"),
    (lambda n: torch.ones(n, device="meta"), r"step input 'token_scale' is on meta, but the runner's device is cpu"),
], ids=["column", "list", "device"])
def test_a_declared_step_input_of_the_wrong_shape_type_or_device_is_refused_at_the_door(mode, bad, message):
    import graphmode

    setup = _setup(mode=mode)
    scaled = _Scaled(setup.model)
    runner = graphmode.build_graph_runner(
        scaled, max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu", capture_batch_sizes=[1, 2, 4],
        execute_mode=mode, capture_token_sizes=[4, 8, 16],
        step_inputs=[BufferSpec("token_scale", torch.float32, shape=(TOKENS,), padding=1.0)],
    )
    seqs = setup.prefill(2, [5, 9])
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        with pytest.raises(InputError, match=message):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, token_scale=bad(2))
        scale = torch.full((2,), 2.0)  # then the right shape runs (a (T, 1) capture refused them all before)
        graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, token_scale=scale)
        eager = scaled(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata, token_scale=scale)
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
    stats = runner.stats
    assert stats.replays + stats.captures + stats.piecewise_replays + stats.piecewise_captures == 1


# -- the KV cache against the model (issue 21) --------------------------------------


def _fewer_layers(setup):
    return setup.graph_cache[:-1]


def _other_head_dim(setup):
    config = setup.model.config
    ops = setup.model.ops
    return ops.make_kv_cache(config.num_hidden_layers, 40, 16, config.num_key_value_heads, config.head_dim // 2,
                             config.dtype, torch.device("cpu"))


def _half(setup):
    return [(k.half(), v.half()) for k, v in setup.graph_cache]


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("make, message", [
    (_fewer_layers, r"past_key_values has 1 layers, but the model's make_kv_cache gives 2: the missing layers would be skipped"),
    (_other_head_dim, r"KV-cache tensor 0 has shape \(.*\), but the model's make_kv_cache gives \(.*\) "
     r"\(blocks aside: dimension \d is the block count, \d the block size\).*Make the cache with model.make_kv_cache"),
    (_half, r"KV-cache tensor 0 has dtype torch.float16, but the model's make_kv_cache gives torch.float32.*"
     r"make_kv_cache"),
], ids=["fewer_layers", "head_dim", "dtype"])
def test_a_kv_cache_that_does_not_fit_the_model_is_refused_at_the_first_step(vendor, make, message):
    setup = tiny_setup(vendor)
    cache = make(setup)
    step = setup.engine.prefill([setup.engine.add()], [5])  # eager: the cache meets the runner here first
    with pytest.raises(InputError, match=message):
        _run(setup, step, cache=cache)


def test_the_reference_model_refuses_a_cache_with_fewer_layers_eagerly():
    model = build_reference_model(ModelConfig.tiny(), "cuda", "cpu")
    setup = tiny_setup()
    step = setup.engine.prefill([setup.engine.add()], [5])
    with pytest.raises(InputError, match=r"past_key_values has 1 layers, but the model has 2"):
        with torch.inference_mode():
            model(step.input_ids, step.position_ids, model.make_kv_cache(40, 16)[:1], step.attn_metadata)


@pytest.mark.parametrize("mode", MODES)
def test_warmup_with_another_cache_than_the_graphs_captured_is_refused(mode):
    setup = _setup(mode=mode)
    with torch.inference_mode():
        setup.runner.warmup(setup.graph_cache, progress=False)
        other = setup.model.make_kv_cache(40, 16)
        with pytest.raises(InputError, match=r"warmup\(\) with another KV cache than the .*graphs captured.*"
                           r"call runner.reset\(\) first"):
            setup.runner.warmup(other, progress=False)
        setup.runner.reset()
        setup.runner.warmup(other, progress=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replacement", ["copy", "half"])
def test_a_cache_tensor_replaced_in_its_list_is_refused_before_a_new_capture(mode, replacement):
    # cache[0] = (new k, new v) in the same list: a step's check passes a container it has seen on its
    # identity, and replays refuse the new tensors, but a step capturing a new bucket captured them: a
    # copy ran (the runner then held graphs on two caches, refusing the steps of the older buckets), and
    # so did a half-precision pair under the fp32 model (layer 0's keys and values rounded to fp16).
    setup = _setup(mode=mode)
    seqs = setup.prefill(3, [3, 17, 5])  # 25 tokens: eager in every mode
    setup.decode(seqs[:2])  # captures bucket 2 (token bucket 4 in piecewise mode)
    key, value = setup.graph_cache[0]
    setup.graph_cache[0] = (key.clone(), value.clone()) if replacement == "copy" else (key.half(), value.half())
    # A step of a bucket not captured yet: full bucket 4 in graph mode, token bucket 8 in the others.
    step = setup.engine.decode(seqs) if mode == "graph" else setup.engine.prefill(seqs, [2, 3, 1])
    if replacement == "copy":
        graph = "bucket 4" if mode == "graph" else r"token bucket 8 \(piecewise\)"
        held = "bucket 2" if mode != "piecewise" else r"token bucket 4 \(piecewise\)"
        message = (rf"^a step capturing the graph of {graph} with another KV cache than the runner's graphs captured "
                   rf"\(the graph of {held} holds other memory: tensor 0 of 4 is at 0x[0-9a-f]+, captured at "
                   r"0x[0-9a-f]+\).*or call runner.reset\(\) first")
    else:
        message = r"^KV-cache tensor 0 has dtype torch.float16, but the model's make_kv_cache gives torch.float32"
    with pytest.raises(InputError, match=message):
        _run(setup, step)


@pytest.mark.parametrize("mode", MODES)
def test_cache_views_made_anew_every_step_over_the_same_memory_capture_and_replay(mode):
    # An engine holding one cache tensor and passing new per-layer views of it every step (the same
    # memory, shapes and strides): replays took them, but the capture of a later bucket refused them as
    # "another KV cache" (helper-18's hunt, 2026-12-04), mid-serving in graph mode.
    setup = _setup(mode=mode)
    big = torch.stack([torch.stack(list(pair)) for pair in setup.graph_cache])
    views = lambda: [(big[layer, 0], big[layer, 1]) for layer in range(big.shape[0])]  # noqa: E731
    setup.graph_cache = views()
    seqs = setup.prefill(3, [5, 17, 9])
    for batch in (3, 3, 1, 2):  # buckets 4, 4 (a replay), 1 and 2 captured on new views each step
        setup.graph_cache = views()
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager)
    assert setup.caches_close()
    assert setup.runner.stats.eager_steps.total() == 1  # the prefill


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", ["kv_start_indices", "block_offsets"])
def test_an_index_error_inside_a_replay_says_that_debug_mode_names_the_bad_value(mode, field):
    # A slot or block id past the cache is a device value, unchecked outside debug mode: the replay
    # (the emulator's, or a piecewise break point's) failed with an IndexError from inside torch naming
    # neither the field nor the fix. It now carries a note saying so, and debug mode names the value.
    debug_message = {
        "kv_start_indices": r"^debug mode: token 0 \(sequence 0\) writes slot 1000000 \(block 62500\), outside the "
                            r"sequence's own blocks",
        "block_offsets": r"^debug mode: sequence 0's block table holds block id 1000000 \(column 0\), outside the "
                         r"cache's 129 blocks",
    }[field]
    for debug in (False, True):
        setup = _setup(mode=mode, debug=debug)
        seqs = setup.prefill(3, [3, 17, 5])
        setup.decode(seqs)  # captures bucket 4 (token bucket 4 in piecewise mode)
        step = setup.engine.decode(seqs)
        bad = getattr(step.attn_metadata, field).clone()
        bad.view(-1)[0] = 10**6
        if debug:
            with pytest.raises(InputError, match=debug_message):
                _run(setup, step, **{field: bad})
            continue
        with pytest.raises(IndexError) as caught:
            _run(setup, step, **{field: bad})
        graph = "bucket 4" if mode != "piecewise" else r"token bucket 4 \(piecewise\)"
        note = "\n".join(getattr(caught.value, "__notes__", []))
        assert re.fullmatch(rf"graphmode: raised replaying the graph of {graph}\. A step's device values \(input ids, block "
                            r"ids, slots, lengths\) are checked only in debug mode: run it with GRAPHMODE_DEBUG=1 .*", note)
        # A vendor whose own runtime raised is told where to look too.
        assert re.search(r"If debug mode finds none, the vendor's graph or its graphmode_update_graph_params hook "
                         r"raised: `graphmode conformance --vendor \w+` checks both$", note)



@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
def test_an_index_error_inside_a_native_replay_carries_the_same_note(mode):
    # A steady decode step of a layout replayed before is the native step's (graphmode.native): an
    # IndexError inside its replay (a slot past the cache) reached the engine without the note the
    # Python path's replay adds, naming neither the graph nor GRAPHMODE_DEBUG=1.
    from graphmode.native import native_module

    if native_module() is None:
        pytest.skip("graphmode.native could not be built here (no C++ compiler)")
    setup = _setup(mode=mode)
    seqs = setup.prefill(3, [3, 17, 5])
    setup.decode(seqs)  # captures bucket 4
    setup.decode(seqs)  # a replay the native step learns
    memo = setup.runner.family("full").native.memo
    setup.decode(seqs)
    assert memo.replays == 1  # the native step takes this layout's steps now
    step = setup.engine.decode(seqs)
    bad = step.attn_metadata.kv_start_indices.clone()
    bad[0] = 10**6
    with pytest.raises(IndexError) as caught:
        _run(setup, step, kv_start_indices=bad)
    assert re.fullmatch(r"graphmode: raised replaying the graph of bucket 4\. A step's device values \(input ids, block "
                        r"ids, slots, lengths\) are checked only in debug mode: run it with GRAPHMODE_DEBUG=1 .*",
                        "\n".join(getattr(caught.value, "__notes__", [])))


def test_reset_lets_go_of_the_kv_cache():
    # An engine reallocating its cache frees the old one first: the runner must not keep it alive.
    import gc
    import weakref

    setup = _setup()
    seqs = setup.prefill(2, [5, 9])
    setup.decode(seqs)
    old = weakref.ref(setup.graph_cache[0][0])
    setup.runner.reset()
    setup.graph_cache = None
    gc.collect()
    assert old() is None


# -- step fields the graph's context does not carry ---------------------------------


@dataclasses.dataclass
class _EngineMetadata(AttnMetadata):
    """An engine's own AttnMetadata, with a per-step field its model reads."""

    temperature: torch.Tensor | None = None


class _Tempered(torch.nn.Module):
    """Divides the logits by a per-step temperature the engine passes in
    ``attn_metadata``, read as ``how`` says."""

    READS = {
        "attribute": lambda attn: attn.temperature,
        "getattr default": lambda attn: getattr(attn, "temperature", torch.ones(())),
        "hasattr": lambda attn: attn.temperature if hasattr(attn, "temperature") else torch.ones(()),
        "vendor_fields[key]": lambda attn: attn.vendor_fields["temperature"],
        "vendor_fields.get": lambda attn: attn.vendor_fields.get("temperature", torch.ones(())),
        "key in vendor_fields": lambda attn: (attn.vendor_fields["temperature"] if "temperature" in attn.vendor_fields
                                              else torch.ones(())),
    }

    def __init__(self, model, how):
        super().__init__()
        self.inner, self.config, self.ops, self.read = model, model.config, model.ops, self.READS[how]

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        temperature = self.read(attn_metadata)
        return self.inner(input_ids, position_ids, past_key_values, attn_metadata) / temperature[..., None]


@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
@pytest.mark.parametrize("how", sorted(_Tempered.READS))
def test_a_step_field_the_graph_context_lacks_is_refused_when_the_model_reads_it(mode, how):
    # A full graph's context is a plain AttnMetadata over the graph's buffers: an engine's subclass fields and
    # undeclared vendor_fields are not in it. A plain read failed at the first decode with a bare
    # "'AttnMetadata' object has no attribute 'temperature'" (or KeyError: 'temperature'); a read with a default
    # (getattr, hasattr, dict.get, `in`) froze the default into the graph: logits undivided, silently.
    _check_the_read_is_refused(mode, how, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor kernels in graphs need a CUDA GPU")
@pytest.mark.parametrize("how", ["getattr default", "vendor_fields.get"])
def test_a_compiled_model_reading_a_field_the_graph_context_lacks_is_refused(how):
    """Dynamo traces the guarded context's reads as the model makes them."""
    _check_the_read_is_refused("graph", how, "cuda", compile=True)


def _wrapped(wrapper, how, mode, device, **options):
    """A setup, its model wrapped as ``wrapper(model, how)``, and a runner of the wrapped model."""
    import graphmode

    setup = _setup(mode=mode, device=device)
    model = wrapper(setup.model, how)
    runner = graphmode.build_graph_runner(
        model, max_batches=16, max_blocks_per_seq=8, block_size=16, device=device, capture_batch_sizes=[1, 2, 4],
        execute_mode=mode, capture_token_sizes=[4, 8, 16], **options)
    return setup, model, runner


def _check_the_read_is_refused(mode, how, device, **options):
    setup, tempered, runner = _wrapped(_Tempered, how, mode, device, **options)
    seqs = [setup.engine.add() for _ in range(2)]
    temperature = torch.full((2,), 2.0, device=device)
    step = setup.engine.decode(seqs)  # a first decode (on an empty cache): the graph's warm-up runs it
    attn = step.attn_metadata
    subclass = "vendor_fields" not in how
    if subclass:
        attn = _EngineMetadata(**{f.name: getattr(attn, f.name) for f in dataclasses.fields(attn)},
                               temperature=temperature)
    else:
        attn = attn.replace(vendor_fields={"temperature": temperature})
    read = "attn_metadata.temperature" if subclass else "attn_metadata.vendor_fields['temperature']"
    held = (r"the fields \['temperature'\] of its _EngineMetadata" if subclass
            else r"vendor_fields \['temperature'\] \(not declared by the vendor\)")
    with pytest.raises(CaptureError, match=rf"the model read {re.escape(read)}: a full graph's attn_metadata is a "
                       rf"graphmode\.AttnMetadata made from the graph's buffers, .*held {held}, which that one lacks "
                       r"\(a default from getattr or dict\.get would be frozen into the graph\)\. Pass a per-step "
                       r"tensor the model reads as a declared step input"), torch.inference_mode():
        runner(step.input_ids, step.position_ids, setup.graph_cache, attn)
    with torch.inference_mode():  # eagerly the model reads it
        eager = tempered(step.input_ids, step.position_ids, setup.eager_cache, attn)
    assert torch.isfinite(eager).all()


@dataclasses.dataclass
class _PrefillCounts(AttnMetadata):
    """An engine's own AttnMetadata with a per-step host number (vLLM's
    metadata carries num_prefills, num_decode_tokens and the like)."""

    num_prefills: int = 0


class _ScaledByHostValue(torch.nn.Module):
    """Scales the logits by a host number of the step, read as ``how`` says."""

    READS = {
        "subclass field": lambda attn: attn.num_prefills,
        "vendor_fields entry": lambda attn: attn.vendor_fields["num_prefills"],
    }

    def __init__(self, model, how):
        super().__init__()
        self.inner, self.config, self.ops, self.read = model, model.config, model.ops, self.READS[how]

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        logits = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * (1 + self.read(attn_metadata))


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("how", sorted(_ScaledByHostValue.READS))
def test_a_host_value_of_the_step_read_between_attention_calls_is_refused_in_piecewise_graphs(mode, how):
    # A piecewise capture shows the model ghost metadata (tensors on 'meta'), but kept the engine's host
    # values as they were: a model using one between attention calls froze the capture step's value into the
    # graphs, so later steps with another value came back scaled by the old one, silently.
    _check_the_host_value_is_refused(mode, how, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor kernels in graphs need a CUDA GPU")
def test_a_compiled_piecewise_model_using_a_host_value_of_the_step_is_refused():
    """Dynamo traces the ghost value's use as the model makes it."""
    _check_the_host_value_is_refused("piecewise", "subclass field", "cuda", compile=True)


def _check_the_host_value_is_refused(mode, how, device, **options):
    setup, _, runner = _wrapped(_ScaledByHostValue, how, mode, device, **options)
    seqs = [setup.engine.add() for _ in range(2)]
    step = setup.engine.prefill(seqs, [3, 4])
    attn = step.attn_metadata
    if how == "subclass field":
        attn = _PrefillCounts(**{f.name: getattr(attn, f.name) for f in dataclasses.fields(attn)}, num_prefills=2)
    else:
        attn = attn.replace(vendor_fields={"num_prefills": 2})
    name = "attn_metadata.num_prefills" if how == "subclass field" else "attn_metadata.vendor_fields['num_prefills']"
    with pytest.raises(CaptureError, match=rf"the model used {re.escape(name)}, a host value of the engine's step, "
                       r"at .*test_engine_mistakes\.py:\d+ in \S*forward\S*: in piecewise modes the model sees "
                       r"attn_metadata .* or pass the value as a declared step input"), torch.inference_mode():
        runner(step.input_ids, step.position_ids, setup.graph_cache, attn)


def test_a_context_dropping_nothing_is_the_vendors_own():
    from graphmode.families.common import guard_dropped_fields

    setup = _setup(mode="graph")
    step = setup.engine.decode([setup.engine.add()])
    inputs = StepInputs(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, {})
    assert guard_dropped_fields(inputs, inputs) is inputs


# -- declared step inputs -----------------------------------------------------------


def _lora_setup(mode, **options):
    """A setup whose model has 3 adapters, and a runner with lora_ids declared per sequence."""
    import graphmode
    from graphmode.model.lora import add_lora
    from graphmode.spec import SEQUENCES

    setup = _setup(mode=mode)
    model = add_lora(setup.model, count=3, rank=2, seed=1)
    runner = graphmode.build_graph_runner(
        model, max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu", execute_mode=mode,
        capture_batch_sizes=[1, 2, 4], capture_token_sizes=[4, 8, 16],
        step_inputs=[BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)], **options,
    )
    return setup, model, runner


@pytest.mark.parametrize("mode", ["graph", "piecewise"])  # full_and_piecewise: the decode is graph's
@pytest.mark.parametrize("debug", [False, True])
def test_a_step_input_value_the_model_cannot_index_with_is_noted_as_unchecked(mode, debug):
    """LoRA adapter id 4 of adapters 0..3 in a replay: an IndexError from
    inside the graph, whose note sent the engine to debug mode (which does
    not read step inputs, and raised the same bare IndexError) and then to
    the vendor. The note now names the declared step inputs as unchecked."""
    setup, model, runner = _lora_setup(mode, debug=debug)
    seqs = setup.prefill(3, [5, 9, 3])
    with torch.inference_mode():
        for adapters in ([1, 2, 3], [1, 4, 3]):
            step = setup.engine.decode(seqs)
            ids = torch.tensor(adapters, dtype=torch.int32)
            if adapters[1] != 4:
                runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True)
                continue
            with pytest.raises(IndexError) as raised:
                runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert re.search(r"declared step inputs \('lora_ids'\) are not checked, in debug mode either.*adapter id", notes)
    assert ("debug mode found the step's device values" in notes) == debug


# -- a per-sequence step input in piecewise graphs ---------------------------------


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
@pytest.mark.parametrize("kind", ["mixed", "verify"])
def test_a_per_sequence_step_input_in_a_step_of_more_tokens_than_sequences_runs_eagerly(mode, kind):
    """A piecewise segment sees a per-sequence step input as the token
    bucket's rows: in a step of more tokens than sequences no model can map
    them to tokens (LoRA ids [1, 2, 3] for a mixed step of 6 + 1 + 1 tokens
    gave its first 3 tokens adapters 1, 2, 3: logits 0.097 and the cache
    0.40 off eager, silently). Such a step runs eagerly, counted and warned
    about once, naming the input and the fix; one-token steps still replay."""
    setup, model, runner = _lora_setup(mode, max_q_len=2)
    seqs = setup.prefill(3, [5, 9, 3])
    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    steps = [setup.engine.decode(seqs), setup.engine.prefill(seqs, [6, 1, 1]) if kind == "mixed"
             else setup.engine.decode(seqs, [2, 2, 2]) if mode == "piecewise" else setup.engine.decode(seqs, [2, 1, 1])]
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            call = (step.input_ids, step.position_ids)
            graph = runner(*call, setup.graph_cache, step.attn_metadata, lora_ids=ids, lora=True).clone()
            eager = model(*call, setup.eager_cache, step.attn_metadata, lora_ids=ids, lora=True)
            torch.testing.assert_close(graph, eager)
    assert setup.caches_close()
    assert [re.search("'lora_ids'.*per sequence.*TOKENS.*repeat_interleave", str(w.message)) for w in caught]
    assert runner.stats.eager_steps["per_sequence_input"] == 1

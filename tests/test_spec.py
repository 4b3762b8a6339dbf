"""Declarations: a vendor's buffers and constraints as data, an engine's own
step inputs, typed vendor options; the core allocates, fills, pads and views
from them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ConfigError, InputError
from graphmode.attention import ReferenceAttentionOps, write_slots
from graphmode.buckets import FixedSizes, graded_sizes
from graphmode.emulator.host import mark_host
from graphmode.spec import BLOCKS, CUDA_SPEC, ROW_INDEX, SEQUENCES, TOKENS, BufferSpec, GraphSpec


class SlotBlockOps(ReferenceAttentionOps):
    """Kernels that take each token's cache block as a kernel input of their
    own (``vendor_fields["slot_blocks"]``), as some vendors' fill kernels do.
    Eagerly the engine's step has no such field: the op derives it."""

    def fill_kv_cache(self, key, value, k_cache, v_cache, attn):
        slots = attn.kv_start_indices.reshape(-1)
        blocks = attn.vendor_fields.get("slot_blocks")
        if blocks is None:
            blocks = torch.where(slots >= 0, slots // k_cache.shape[1], 0)
        block_size = k_cache.shape[1]
        # The slot rebuilt from the block input: a stale block input writes elsewhere.
        rebuilt = torch.where(slots >= 0, blocks.long() * block_size + slots % block_size, -1)
        write_slots(k_cache, rebuilt, key)
        write_slots(v_cache, rebuilt, value)


@dataclass(frozen=True)
class SlotBlockOptions:
    fast_path: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fast_path, bool):
            raise ConfigError(f"fast_path={self.fast_path!r}: must be True or False")


def _slot_blocks(step):
    slots = step.attn_metadata.kv_start_indices
    return torch.where(slots >= 0, slots // 16, 0)


SLOT_BLOCK_SPEC = CUDA_SPEC.with_buffers(
    BufferSpec("slot_blocks", torch.int32, shape=(TOKENS,), padding=0, source=_slot_blocks),
).replace(block_sizes=(16,), capture_policy=lambda m: [s for s in (1, 3, 6, 12) if s < m] + [m], options=SlotBlockOptions)


class SlotBlockVendor:
    @graphmode.hookimpl
    def graphmode_vendor_info(self):
        return graphmode.VendorInfo("slotblock", ("cuda",), "torch", None, False, "a test vendor")

    @graphmode.hookimpl
    def graphmode_graph_spec(self):
        return SLOT_BLOCK_SPEC

    @graphmode.hookimpl
    def graphmode_attention_ops(self, options):
        ops = SlotBlockOps()
        ops.fast_path = options.fast_path  # an option the kernels read
        return ops


def test_a_declared_kernel_input_is_allocated_filled_padded_and_viewed():
    setup = tiny_setup("slotblock", plugin=SlotBlockVendor(), max_batches=16)
    runner = setup.runner
    assert runner.capture_sizes == (1, 3, 6, 12, 16)  # the declared policy
    seqs = setup.prefill(12)
    for batch in (12, 7, 12, 4, 2, 5, 12):
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager, msg=f"batch {batch}")
        meta = runner.graph_meta()
        bucket = runner.bucket_of(batch)
        # Padding rows hold the declared padding after every step, live rows the step's values.
        assert meta.input_buffers["slot_blocks"][batch:bucket].eq(0).all()
    assert setup.caches_close()
    assert runner.stats.replays >= 4
    static = runner.graph(12).meta.input_buffers["slot_blocks"]
    assert static.shape == (16,) and static.dtype == torch.int32


def test_a_stale_declared_input_would_be_caught_by_the_kernel():
    # The buffer matters: with its live rows never refilled the graph writes
    # the cache at the capture step's blocks.
    stale = SLOT_BLOCK_SPEC.with_buffers(BufferSpec("slot_blocks", torch.int32, shape=(TOKENS,), padding=0, source=None))

    class Stale(SlotBlockVendor):
        @graphmode.hookimpl
        def graphmode_graph_spec(self):
            return stale

    setup = tiny_setup("stale", plugin=Stale(), max_batches=16)
    seqs = setup.prefill(6)
    setup.decode(seqs)
    setup.decode(seqs)
    assert not setup.caches_close()


def test_vendor_options_are_typed_and_checked():
    setup = tiny_setup("slotblock", plugin=SlotBlockVendor(), vendor_options={"fast_path": False})
    assert setup.runner.config.vendor_options == SlotBlockOptions(fast_path=False)
    assert setup.runner.graph_meta().vendor_options == SlotBlockOptions(fast_path=False)
    with pytest.raises(ConfigError, match=r"unknown vendor_options \['fastpath'\] for vendor 'slotblock'; its options \(SlotBlockOptions\) are \['fast_path'\]"):
        tiny_setup("slotblock", plugin=SlotBlockVendor(), vendor_options={"fastpath": True})
    with pytest.raises(ConfigError, match="fast_path='yes': must be True or False"):
        tiny_setup("slotblock", plugin=SlotBlockVendor(), vendor_options={"fast_path": "yes"})
    with pytest.raises(ConfigError, match="vendor_options=\\[1\\]: pass a dict or a SlotBlockOptions"):
        tiny_setup("slotblock", plugin=SlotBlockVendor(), vendor_options=[1])
    with pytest.raises(ConfigError, match=r"unknown vendor_options \['x'\] for vendor 'cuda'; its options \(NoOptions\) are none"):
        tiny_setup(vendor_options={"x": 1})


def test_declared_block_sizes_are_enforced():
    with pytest.raises(ConfigError, match="block_size=32: vendor 'slotblock' takes KV-cache blocks of 16 tokens"):
        tiny_setup("slotblock", plugin=SlotBlockVendor(), block_size=32)


# -- an engine's own step inputs -----------------------------------------------


class ScaledModel(torch.nn.Module):
    """The reference model with a per-token logit scale, a model input the
    engine passes every step (as LoRA ids or sampling parameters are)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, token_scale):
        logits = self.model(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * token_scale[None, :, None]


#: Execute modes with graphs; in the piecewise ones decode steps replay token buckets.
GRAPH_MODES = ["graph", "piecewise", "full_and_piecewise"]


def _wrapped_setup(wrap, mode="graph", **options):
    """A tiny setup, its model wrapped by ``wrap`` (taking engine inputs of
    its own), and a runner of ``mode`` for the wrapped model."""
    if mode != "graph":
        options.update(execute_mode=mode, capture_token_sizes=[2, 4, 8])
    setup = tiny_setup(capture_batch_sizes=[2, 4, 8], **{k: v for k, v in options.items() if k != "step_inputs"})
    model = wrap(setup.model)
    runner = graphmode.build_graph_runner(
        model, max_batches=16, max_blocks_per_seq=8, block_size=16, device="cpu", capture_batch_sizes=[2, 4, 8], **options
    )
    return setup, model, runner


def _scaled_setup(mode="graph", **options):
    return _wrapped_setup(ScaledModel, mode, **options)


def _graph_steps(runner):
    """Replays of the family decode steps run in: full graphs, or piecewise ones in mode "piecewise"."""
    return runner.stats.replays if runner.config.execute_mode != "piecewise" else runner.stats.piecewise_replays


def _decode(setup, model, runner, seqs, **inputs):
    """A decode step of ``seqs`` through the runner and eagerly, with the engine's own ``inputs``."""
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, **inputs).clone()
        eager = model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata, **inputs)
    return graph, eager


def _scaled_step(setup, scaled, runner, seqs, scale):
    return _decode(setup, scaled, runner, seqs, token_scale=torch.full((len(seqs),), scale))


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_declared_engine_inputs_change_every_step(mode):
    declared = [BufferSpec("token_scale", torch.float32, shape=(TOKENS,), padding=1.0)]
    setup, scaled, runner = _scaled_setup(mode, step_inputs=declared)
    seqs = setup.prefill(6)
    for batch, scale in ((6, 1.0), (6, 2.0), (3, 0.5), (6, -1.0)):
        graph, eager = _scaled_step(setup, scaled, runner, seqs[:batch], scale)
        torch.testing.assert_close(graph, eager)
    assert _graph_steps(runner) == 2
    if mode != "piecewise":
        assert runner.graph_meta().input_buffers["token_scale"][6:8].eq(1.0).all()  # padding rows of the last step


class LoraModel(torch.nn.Module):
    """The reference model with a per-sequence adapter id, as LoRA ids are:
    each decode token's logits are scaled by its sequence's adapter."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
        self.register_buffer("adapter_scales", torch.tensor([1.0, 2.0, -0.5, 3.0]))

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, lora_ids):
        logits = self.model(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * self.adapter_scales[lora_ids.long()][None, :, None]


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_per_sequence_step_input_changes_every_step_in_every_mode(mode):
    # Issue 20: in mode "piecewise" the second step was refused ("extra model input 'lora_ids' is not the
    # object ... Keep it fixed"): piecewise graphs froze declared step inputs instead of copying them in.
    declared = [BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)]
    setup, model, runner = _wrapped_setup(LoraModel, mode, step_inputs=declared)
    seqs = setup.prefill(4)
    for batch, first in ((4, 0), (4, 1), (2, 2), (4, 3)):
        lora_ids = (torch.arange(batch, dtype=torch.int32) + first) % 4
        graph, eager = _decode(setup, model, runner, seqs[:batch], lora_ids=lora_ids)
        torch.testing.assert_close(graph, eager)
    assert _graph_steps(runner) == 2


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_undeclared_engine_inputs_are_refused_when_they_change(mode):
    setup, scaled, runner = _scaled_setup(mode)
    seqs = setup.prefill(4)
    _scaled_step(setup, scaled, runner, seqs, 1.0)
    with pytest.raises(InputError, match="declare it as a step input"):
        _scaled_step(setup, scaled, runner, seqs, 2.0)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_warmup_fills_declared_engine_inputs_with_their_padding(mode):
    declared = [BufferSpec("token_scale", torch.float32, shape=(TOKENS,), padding=1.0)]
    setup, scaled, runner = _scaled_setup(mode, step_inputs=declared)
    with torch.inference_mode():
        runner.warmup(setup.graph_cache, progress=False)
    seqs = setup.prefill(3)
    graph, eager = _scaled_step(setup, scaled, runner, seqs, 3.0)
    torch.testing.assert_close(graph, eager)
    assert _graph_steps(runner) == 1


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_missing_or_misshapen_declared_input_is_refused_naming_it(mode):
    declared = [BufferSpec("token_scale", torch.float32, shape=(TOKENS,), padding=1.0)]
    setup, scaled, runner = _scaled_setup(mode, step_inputs=declared)
    seqs = setup.prefill(3)
    step = setup.engine.decode(seqs)
    with torch.inference_mode():
        with pytest.raises(InputError, match="step input 'token_scale' .* is missing"):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata)
        with pytest.raises(InputError, match=r"step input 'token_scale' has shape \(5,\); declared \(TOKENS,\), this step of 3 "
                           r"sequences and 3 tokens needs \(3,\)"):
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, token_scale=torch.ones(5))


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_declared_input_that_would_lose_its_values_in_its_buffer_is_refused(mode):
    # A float scale for an integer buffer: the graph's copy truncated 2.5 to 2
    # while the eager model used 2.5, a silently wrong result. Casts of the
    # same kind (int64 ids into an int32 buffer) still pass.
    declared = [BufferSpec("token_scale", torch.int32, shape=(TOKENS,), padding=1)]
    setup, scaled, runner = _scaled_setup(mode, step_inputs=declared)
    seqs = setup.prefill(3)
    with pytest.raises(InputError, match=r"step input 'token_scale' is torch.float32, declared torch.int32: "
                       r"its buffer would not hold its values .*Pass token_scale.to\(torch.int32\)"):
        _scaled_step(setup, scaled, runner, seqs, 2.5)
    graph, eager = _decode(setup, scaled, runner, seqs, token_scale=torch.full((3,), 2, dtype=torch.int64))
    torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_declared_float_input_of_another_dtype_is_refused(mode):
    # float32 given for a bfloat16 buffer: graph steps read it rounded, eager steps as given (logits 0.002
    # apart, an engine-input hunt, 2026-12-03); an int64 for a float buffer the same. The declared dtype passes.
    declared = [BufferSpec("token_scale", torch.bfloat16, shape=(TOKENS,), padding=1.0)]
    setup, scaled, runner = _scaled_setup(mode, step_inputs=declared)
    seqs = setup.prefill(3)
    for given in (torch.float32, torch.int64):
        with pytest.raises(InputError, match=rf"step input 'token_scale' is {given}, declared torch.bfloat16: graph "
                           r"steps would read it rounded to torch.bfloat16 .*Pass token_scale.to\(torch.bfloat16\)"):
            _decode(setup, scaled, runner, seqs, token_scale=torch.full((3,), 3, dtype=given))
    graph, eager = _decode(setup, scaled, runner, seqs, token_scale=torch.full((3,), 3.1, dtype=torch.bfloat16))
    torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("where", ["host", "debug"])
def test_a_wider_integer_input_its_buffer_would_wrap_is_refused(mode, where):
    # int64 adapter ids for an int32 buffer pass, but 2**32 + 1 would be 1 in the buffer: graph steps would
    # scale by adapter 1 where eager ones index past the table (helper-17's hunt, 2026-12-03). Read from a
    # host tensor (no synchronisation), or in debug mode from a device one.
    declared = [BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)]
    setup, model, runner = _wrapped_setup(LoraModel, mode, step_inputs=declared, debug=where == "debug")
    seqs = setup.prefill(2)
    ids = torch.tensor([0, 2**32 + 1])
    with pytest.raises(InputError, match=r"step input 'lora_ids' holds 4294967297 \(torch.int64\), outside "
                       r"torch.int32's range -2147483648..2147483647: its torch.int32 buffer would hold 1 in graph "
                       r"steps, where eager steps take 4294967297"):
        _decode(setup, model, runner, seqs, lora_ids=mark_host(ids) if where == "host" else ids)
    graph, eager = _decode(setup, model, runner, seqs, lora_ids=mark_host(torch.tensor([0, 3])))
    torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("where", ["host", "debug"])
def test_a_narrower_integer_input_widens_into_its_buffer(where):
    # int32 (and int16) ids for an int64 buffer: lossless, and the range check compared them with int64's
    # limits wrapped into int32, refusing every step (a review of the check, 2026-12-04).
    declared = [BufferSpec("lora_ids", torch.int64, shape=(SEQUENCES,), padding=0)]
    setup, model, runner = _wrapped_setup(LoraModel, "graph", step_inputs=declared, debug=where == "debug")
    seqs = setup.prefill(2)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        ids = torch.tensor([0, 3], dtype=dtype)
        graph, eager = _decode(setup, model, runner, seqs, lora_ids=mark_host(ids) if where == "host" else ids)
        torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_an_undeclared_per_token_input_under_padding_fails_naming_it_and_the_fix(mode):
    # Three rows, one per token of the step, into graphs of four: the model's product of padded logits and
    # the unpadded scale failed with a bare size mismatch that named neither (an engine-input hunt, 2026-12-03).
    setup, scaled, runner = _scaled_setup(mode)
    seqs = setup.prefill(3)
    with pytest.raises(RuntimeError, match="must match the size") as failed:
        _scaled_step(setup, scaled, runner, seqs, 2.0)
    notes = " ".join(getattr(failed.value, "__notes__", []))
    assert "extra model input 'token_scale' has 3 rows, one per sequence (or token: one each) of the step, but the graph runs 4" in notes
    assert "build_graph_runner(step_inputs=[BufferSpec('token_scale', torch.float32, shape=(SEQUENCES,)" in notes


def test_engine_inputs_cannot_shadow_the_vendors_declarations():
    with pytest.raises(ConfigError, match=r"step_inputs \['kv_seqlens'\]: vendor 'cuda' already declares buffers"):
        tiny_setup(step_inputs=[BufferSpec("kv_seqlens", torch.int32)])
    with pytest.raises(ConfigError, match=r"step_inputs \['x_active_mask'\] name fields of the step context"):
        tiny_setup(step_inputs=[BufferSpec("x_active_mask", torch.bool, shape=(TOKENS,))])
    with pytest.raises(ConfigError, match="declare each as graphmode.spec.BufferSpec"):
        tiny_setup(step_inputs=["token_scale"])



@pytest.mark.parametrize("fields", [
    dict(context=("extras.token_scale",)),  # a buffer name other than the keyword it carries
    dict(source=None),
    dict(host=True),
], ids=["context", "source", "host"])
def test_an_engine_step_input_is_its_keyword_copied_whole(fields):
    # Every family keys an engine's step input by its name and copies the keyword in whole.
    with pytest.raises(ConfigError, match=r"step_inputs \['scale_buf'\] set context, source, live or host"):
        tiny_setup(step_inputs=[BufferSpec("scale_buf", torch.float32, shape=(TOKENS,), padding=1.0, **fields)])


# -- declarations are checked --------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: BufferSpec("x", torch.int32, shape=(4,)),
         r"needs exactly one of TOKENS \('tokens'\) or SEQUENCES \('sequences'\) from graphmode.spec"),
        (lambda: BufferSpec("x", torch.int32, shape=(1,)), r"A per-step value \(a live-token count\) is a "
         r"\(TOKENS,\) mask declared live=True, summed on the device; an array of one row per sequence plus one"),
        (lambda: BufferSpec("x", torch.int32, shape=(TOKENS, SEQUENCES)), "needs exactly one of"),
        (lambda: BufferSpec("x", torch.int32, padding="zero"), "padding='zero'; use a number, 'row_index' or 'row_number'"),
        (lambda: BufferSpec("x", "int32"), "dtype='int32' is not a torch.dtype"),
        (lambda: BufferSpec("x", torch.bool, live=True, source="input_ids"), "give a source or a live value, not both"),
        (lambda: CUDA_SPEC.with_buffers(drop=["kv_seqlens"]), r"no buffer backs the context fields \['attn_metadata.kv_seqlens'\]"),
        (lambda: CUDA_SPEC.with_buffers(BufferSpec("kv_lengths", torch.int32, context=("attn_metadata.kv_seqlens",))),
         r"context fields \['attn_metadata.kv_seqlens'\] are backed by more than one buffer"),
        (lambda: GraphSpec((*CUDA_SPEC.buffers, CUDA_SPEC.buffers[0])), r"declares buffers \['input_ids'\] more than once"),
        (lambda: CUDA_SPEC.replace(max_kv_policy="max"), "max_kv_policy='max'"),
        (lambda: CUDA_SPEC.replace(max_capture_size=0), r"max_capture_size=0: use an int >= 1, or None for no limit"),
        (lambda: CUDA_SPEC.replace(capture_policy=FixedSizes((1, 2, 4)), max_capture_size=8),
         r"max_capture_size=8: the fixed capture list \[1, 2, 4\] \(capture_policy\) ends at 4"),
        # Accepted before (a red-team plugin, 2026-12-06): MoE dispatch takes a bool mask, and every check
        # compared values, which an int8 0/1 mask passes.
        (lambda: CUDA_SPEC.with_buffers(BufferSpec("x_active_mask", torch.int8, shape=(TOKENS,), padding=0, live=1)),
         r"buffer 'x_active_mask' backs attn_metadata.x_active_mask with dtype torch.int8, but the step context "
         r"defines it as torch.bool"),
        (lambda: CUDA_SPEC.replace(capture_sizes=FixedSizes((1, 2))),
         r"GraphSpec capture_sizes=FixedSizes\(\(1, 2\)\): the field is capture_policy now"),
        # Accepted before (an outsider's plugin, 2026-12-04), then refused at the first two-token step with
        # advice about cumulative starts: a (SEQUENCES, 1) slot column holds one slot per sequence.
        (lambda: CUDA_SPEC.with_buffers(BufferSpec("kv_start_indices", torch.int64, shape=(SEQUENCES, 1), padding=-1))
         .replace(max_q_len=2),
         r"buffer 'kv_start_indices' has one row per sequence \(shape \(SEQUENCES, 1\)\) but takes "
         r"attn_metadata.kv_start_indices, one value per new token: with max_q_len=2 .*Declare it per token, "
         r"shape=\(TOKENS, 1\)"),
    ],
)
def test_bad_declarations_are_refused(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_declared_largest_graph_caps_the_capture_list():
    capped = CUDA_SPEC.replace(max_capture_size=24)
    assert capped.capture_list(256) == graded_sizes(24) and capped.largest_graph(256) == 24
    assert capped.capture_list(16) == graded_sizes(16) and capped.largest_graph(16) == 16
    assert capped.capture_list(256, given=(1, 8, 24, 48)) == [1, 8, 24]  # a user's list, trimmed
    fixed = CUDA_SPEC.replace(capture_policy=FixedSizes((1, 2, 4, 8, 16, 32)))
    assert fixed.max_capture_size == 32  # a fixed list's last size
    assert fixed.largest_graph(256) == 32 and fixed.largest_graph(12) == 8
    assert CUDA_SPEC.max_capture_size is None and CUDA_SPEC.largest_graph(256) == 256


def test_row_padding_patterns():
    spec = BufferSpec("q_start_loc", torch.int32, padding=ROW_INDEX, source=None)
    assert spec.allocate(4, 4, 2, torch.device("cpu")).tolist() == [0, 1, 2, 3]
    column = BufferSpec("slots", torch.int64, shape=(SEQUENCES, 1), padding=-1)
    assert column.allocate(3, 3, 2, torch.device("cpu")).tolist() == [[-1], [-1], [-1]]


def test_every_installed_vendor_declares_a_valid_spec_and_its_buffers_match_it():
    for name in graphmode.plugins.installed_vendor_names():
        vendor = graphmode.load_vendor(name)
        spec = vendor.spec
        block_size = (spec.block_sizes or (16,))[0]
        setup = tiny_setup(name, block_size=block_size)
        meta = setup.runner.graph_meta()
        assert list(meta.input_buffers) == list(spec.names), name
        for buffer_spec in spec.buffers:
            tensor = meta.input_buffers[buffer_spec.name]
            expected = buffer_spec.size(meta.max_batchs, meta.max_tokens, meta.num_blocks)
            assert tuple(tensor.shape) == expected and tensor.dtype == buffer_spec.dtype, (name, buffer_spec.name)


class MRopeLikeModel(torch.nn.Module):
    """A model taking a (3, T) per-token input, as M-RoPE positions are."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, mrope_positions):
        logits = self.model(input_ids, position_ids, past_key_values, attn_metadata)
        return logits + mrope_positions.float().sum(0)[None, :, None]


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_declared_input_whose_rows_are_not_its_first_dimension(mode):
    declared = [BufferSpec("mrope_positions", torch.int64, shape=(3, TOKENS), padding=0)]
    setup, model, runner = _wrapped_setup(MRopeLikeModel, mode, step_inputs=declared)
    seqs = setup.prefill(6)
    for batch in (6, 6, 3, 6):
        mrope = torch.arange(3 * batch).view(3, batch) * (batch + 1)
        graph, eager = _decode(setup, model, runner, seqs[:batch], mrope_positions=mrope)
        torch.testing.assert_close(graph, eager)
    assert _graph_steps(runner) == 2
    if mode != "piecewise":
        buffer = runner.graph_meta().input_buffers["mrope_positions"]
        assert buffer.shape == (3, 16) and buffer[:, 6:8].eq(0).all()


def test_a_function_source_computes_on_the_host_under_host_staging():
    setup = tiny_setup("slotblock", plugin=SlotBlockVendor(), host_inputs=True, host_staging=True)
    seqs = setup.prefill(6)
    for batch in (6, 4, 6):
        graph, eager = setup.decode(seqs[:batch])
        torch.testing.assert_close(graph, eager)
    assert setup.runner.staging is not None and setup.caches_close()


def test_the_vendors_options_reach_its_kernels():
    from graphmode.model import ModelConfig, build_reference_model

    vendor = graphmode.load_vendor("slotblock", plugin=SlotBlockVendor())
    assert vendor.attention_ops().fast_path is True  # the options' default
    assert vendor.attention_ops({"fast_path": False}).fast_path is False
    model = build_reference_model(ModelConfig.tiny(), vendor, vendor_options={"fast_path": False})
    assert model.ops.fast_path is False
    with pytest.raises(ConfigError, match=r"unknown vendor_options \['fast'\]"):
        vendor.attention_ops({"fast": True})


def test_the_step_tensors_are_declared_once_on_attn_metadata():
    """Every tensor field of AttnMetadata carries its symbolic shape, and the
    lists the core keeps (required context buffers, input checks, staging,
    piecewise capture metadata) are derived from those declarations."""
    import typing

    from graphmode.context import REQUIRED_TENSORS, STEP_TENSORS, AttnMetadata
    from graphmode.spec import REQUIRED_CONTEXT

    hints = typing.get_type_hints(AttnMetadata)
    tensors = [name for name, hint in hints.items()
               if hint is torch.Tensor or set(typing.get_args(hint)) == {torch.Tensor, type(None)}]
    assert [name for name, _ in STEP_TENSORS] == tensors
    assert dict(STEP_TENSORS)["block_offsets"] == (SEQUENCES, "blocks")
    assert REQUIRED_TENSORS == ("block_offsets", "q_start_loc", "q_seqlens", "kv_seqlens", "kv_start_indices")
    derived = ("input_ids", "position_ids", *(f"attn_metadata.{n}" for n in REQUIRED_TENSORS))
    assert derived == REQUIRED_CONTEXT


@pytest.mark.parametrize("padding", [1, 7, ROW_INDEX])
def test_a_block_table_padded_with_a_block_a_sequence_may_own_is_refused(padding):
    """Padding rows read their table row (and a kernel writing through the
    table writes there): a block id above 0 may be a live sequence's
    (an outsider's plugin declared padding=1, 2026-12-02, and the suite passed it)."""
    with pytest.raises(ConfigError) as error:
        BufferSpec("my_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=padding)
    message = str(error.value)
    assert f"BufferSpec('my_table'): padding={padding!r} in a block table" in message, message
    assert "a block a live sequence may own" in message and "Pad a table with 0, the reserved block, or a negative " \
        "sentinel your kernels skip" in message, message


@pytest.mark.parametrize("padding", [0, -1, -3])
def test_a_block_table_padded_with_the_reserved_block_or_a_sentinel_is_taken(padding):
    assert BufferSpec("my_table", torch.int32, shape=(SEQUENCES, BLOCKS), padding=padding).padding == padding


def test_a_per_block_value_that_is_not_a_block_id_may_pad_with_anything():
    """Floating and boolean per-block buffers hold no block ids."""
    assert BufferSpec("block_scale", torch.float32, shape=(SEQUENCES, BLOCKS), padding=1.0).padding == 1.0
    assert BufferSpec("block_used", torch.bool, shape=(SEQUENCES, BLOCKS), padding=True).padding is True

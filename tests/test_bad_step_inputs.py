"""Bad inputs the way engines produce them: each is a clear error naming
the field, the value, the limit and the fix, never an AttributeError from
inside validation, an error about emulator internals, or a silent result."""

from __future__ import annotations

import contextlib

import pytest
import torch
from setups import tiny_setup

import graphmode
from graphmode import ConfigError, InputError
from graphmode.emulator.host import mark_host
from graphmode.model import ModelConfig, build_reference_model
from graphmode.spec import SEQUENCES, BufferSpec


def _decode(setup, batch=2):
    seqs = setup.prefill(batch, [3] * batch)
    return setup.engine.decode(seqs)


def _call(setup, step, cache=None, **changes):
    ids = changes.pop("input_ids", step.input_ids)
    positions = changes.pop("position_ids", step.position_ids)
    with torch.inference_mode():
        return setup.runner(ids, positions, setup.graph_cache if cache is None else cache,
                            step.attn_metadata.replace(**changes))


@pytest.mark.parametrize("field", ["input_ids", "position_ids"])
def test_a_per_token_input_of_the_wrong_length_is_named(field):
    setup = tiny_setup()
    step = _decode(setup)
    with pytest.raises(InputError, match=rf"^{field} has 3 tokens, but .* have 2: .* fix {field}$"):
        _call(setup, step, **{field: torch.zeros((1, 3), dtype=torch.int64)})


@pytest.mark.parametrize("field", ["kv_seqlens", "q_seqlens", "block_offsets", "input_ids"])
@pytest.mark.parametrize("value", [None, [3, 4]], ids=["None", "list"])
def test_a_list_or_none_where_a_tensor_belongs_is_named(field, value):
    setup = tiny_setup()
    step = _decode(setup)
    kind = "None" if value is None else "a list"
    name = field if field == "input_ids" else f"attn_metadata.{field}"
    with pytest.raises(InputError, match=rf"^{name} is {kind}; it must be a torch.Tensor"):
        _call(setup, step, **{field: value})


def test_host_lengths_that_are_not_a_tensor_are_named():
    setup = tiny_setup()
    step = _decode(setup)
    with pytest.raises(InputError, match=r"kv_seqlens_cpu is a list; it must be a \(2,\) host tensor"):
        _call(setup, step, kv_seqlens_cpu=[4, 4])


def test_a_decode_step_with_a_padding_row_runs_but_never_as_one_token_rows():
    # q_seqlens [2, 0] sum to the batch: replayed as two one-token rows before; then refused as no
    # decode. A row of no token is a padding row (tests/test_padding_rows.py): the step runs, eagerly
    # in execute mode "graph" (host facts cannot prove a uniform q_len), equal to eager.
    from graphmode.model.engine import with_padding_rows

    setup = tiny_setup(max_q_len=2)
    seqs = setup.prefill(1, [3])
    step = with_padding_rows(setup.engine.decode(seqs, 2), [1])
    with torch.inference_mode():
        graph = _call(setup, step).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata)
    torch.testing.assert_close(graph, eager)
    assert setup.runner.stats.eager_steps["mixed_q_len"] == 1 and setup.runner.stats.replays == 0


def test_a_decode_flag_with_more_tokens_than_the_host_maximum_allows_is_refused():
    # Five tokens for two sequences of at most one: a prefill flagged as a
    # decode, which reached the model's decode kernel (an einsum error) before.
    setup = tiny_setup()
    seqs = setup.prefill(2, [3, 3])
    step = setup.engine.prefill(seqs, [3, 2])
    with pytest.raises(InputError, match=r"5 new tokens for 2 sequences with max_q_seq_len=1 is not a decode step"):
        _call(setup, step, is_decoding=True, max_q_seq_len=1)


@pytest.mark.parametrize("vendor", ["cuda", "ascend", "camb"])
def test_a_kv_cache_of_another_block_size_is_refused_at_capture(vendor):
    setup = tiny_setup(vendor)
    step = _decode(setup)
    cache = setup.model.make_kv_cache(300, 8)
    dim = {"cuda": 1, "ascend": 1, "camb": 2}[vendor]
    with pytest.raises(InputError, match=rf"KV-cache tensor 0 has shape .*: blocks of 8 tokens \(dimension {dim} "
                       r"of the layout .*\), but the runner was built with block_size=16"):
        _call(setup, step, cache=cache)


@pytest.mark.parametrize("model_vendor, runner_vendor", [("ascend", "cuda"), ("ppu", "cuda"), ("cuda", "camb")])
def test_a_model_on_another_vendors_ops_is_refused_at_start_up(model_vendor, runner_vendor):
    model = build_reference_model(ModelConfig.tiny(), model_vendor, "cpu")
    with pytest.raises(ConfigError, match=rf"the model's attention ops are \w+ \(the '{model_vendor}' contract.*"
                       rf"the runner's vendor '{runner_vendor}' drives .*or the runner with vendor='{model_vendor}'"):
        graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=8, block_size=16, device="cpu",
                                     vendor=runner_vendor)


def test_a_model_on_the_cuda_ops_runs_under_maca_which_uses_them():
    model = build_reference_model(ModelConfig.tiny(), "cuda", "cpu")
    graphmode.build_graph_runner(model, max_batches=4, max_blocks_per_seq=8, block_size=16, device="cpu", vendor="maca")


class _OptionalScale(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, scale=None):
        out = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
        return out if scale is None else out * scale


def test_steps_passing_extras_that_warmup_was_not_given_are_told_to_pass_them_to_warmup():
    setup = tiny_setup()
    runner = graphmode.build_graph_runner(_OptionalScale(setup.model), max_batches=4, max_blocks_per_seq=8, block_size=16,
                                          device="cpu", capture_batch_sizes=[2, 4])
    runner.warmup(setup.graph_cache, progress=False)
    step = _decode(setup)
    scale = torch.tensor(2.0)
    with pytest.raises(InputError, match=r"passes extra model inputs \['scale'\], but the graph of bucket 2 was "
                       r"captured with \[\] \(by warmup\(\)\).*runner.warmup\(past_key_values, scale=...\)"):
        with torch.inference_mode():
            runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, scale=scale)
    runner.reset()
    runner.warmup(setup.graph_cache, progress=False, scale=scale)  # warm-up takes the extras: then it works
    with torch.inference_mode():
        graph = runner(step.input_ids, step.position_ids, setup.graph_cache, step.attn_metadata, scale=scale).clone()
        eager = setup.model(step.input_ids, step.position_ids, setup.eager_cache, step.attn_metadata) * 2
    assert runner.stats.replays == 1
    torch.testing.assert_close(graph[:, :2], eager[:, :2], atol=1e-5, rtol=1e-5)


def test_a_step_of_a_layout_that_passed_before_is_still_checked_whole():
    """The runner remembers the layouts of steps that passed
    (graphmode.checks.step_checks): a later step of that layout is checked for
    its host values, and one that differs in any tensor's dtype, shape or
    placement is checked whole, with the errors of a first step."""
    setup = tiny_setup()
    step = _decode(setup)
    _call(setup, step)  # the layout passed: remembered
    checks = setup.runner._check_inputs
    assert len(checks._passed) >= 1
    with pytest.raises(InputError, match=r"^attn_metadata.kv_seqlens has dtype torch.float32; it must be an integer"):
        _call(setup, step, kv_seqlens=step.attn_metadata.kv_seqlens.float())
    with pytest.raises(InputError, match=r"^max_kv_seq_len=100000 is above the \d+ tokens a block table can address"):
        _call(setup, step, max_kv_seq_len=100000)
    with pytest.raises(InputError, match=r"^attn_metadata.max_q_seq_len is a float; it must be an int"):
        _call(setup, step, max_q_seq_len=1.0)
    with pytest.raises(InputError, match=r"^attn_metadata.max_kv_seq_len is a bool; it must be an int"):
        _call(setup, step, max_kv_seq_len=True)
    # (max_q_seq_len=2 passes since rows of zero new tokens are legal: [2, 0] has 2 tokens for 2 sequences.)
    with pytest.raises(InputError, match=r"^is_decoding=True, but 2 new tokens for 2 sequences with max_q_seq_len=0"):
        _call(setup, step, max_q_seq_len=0)
    host = step.attn_metadata.kv_seqlens_cpu
    with pytest.raises(InputError, match=r"kv_seqlens_cpu holds 100000 \(sequence 0\), above the"):
        _call(setup, step, max_kv_seq_len=-1, kv_seqlens_cpu=torch.full_like(host, 100000) if host is not None
              else torch.full((2,), 100000, dtype=torch.int32))
    marked = graphmode.emulator.mark_host(step.attn_metadata.q_seqlens.clone())
    with pytest.raises(InputError, match=r"^attn_metadata.q_seqlens is on the host but input_ids is on cpu"):
        _call(setup, step, q_seqlens=marked)


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_a_prefill_step_with_fewer_tokens_than_sequences_runs(mode):
    # Three sequences, two new tokens: one sequence adds none, a padding row. Refused before this
    # commit (before that, a piecewise step ran in token bucket 2, below the batch, and the
    # per-sequence step input's fill failed with "narrow(): length must be non-negative"). Now it
    # runs: eagerly where a per-sequence step input cannot be mapped to tokens, equal to eager.
    setup = tiny_setup(execute_mode=mode, capture_token_sizes=[2, 4, 8], capture_batch_sizes=[1, 2, 4],
                       step_inputs=[BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,), padding=0)])
    seqs = [setup.engine.add() for _ in range(3)]
    step = setup.engine.prefill(seqs, [1, 1, 1])
    attn = step.attn_metadata.replace(
        q_seqlens=torch.tensor([1, 1, 0], dtype=torch.int32), q_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        kv_seqlens=torch.tensor([1, 1, 0], dtype=torch.int32), kv_start_indices=step.attn_metadata.kv_start_indices[:2])
    attn = attn.replace(kv_seqlens_cpu=mark_host(attn.kv_seqlens.clone()))
    ids, positions = step.input_ids[:, :2], step.position_ids[:, :2]
    # Piecewise modes run it eagerly, and say once why (a per-sequence input seen as rows of tokens).
    said = pytest.warns(UserWarning, match="declared per sequence") if mode != "eager" else contextlib.nullcontext()
    with torch.inference_mode(), said:
        graph = setup.runner(ids, positions, setup.graph_cache, attn, lora_ids=torch.zeros(3, dtype=torch.int32)).clone()
        eager = setup.model(ids, positions, setup.eager_cache, attn)
    torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_kv_maximum_below_the_host_lengths_is_refused_in_a_piecewise_step(mode):
    # max_kv_seq_len below a sequence's kv length, the host lengths given: a
    # piecewise break point hands it to the kernels, and Camb's decode kernel
    # clamps the lengths it reads to it (a silently wrong result), PPU's fail
    # a device assertion. The host lengths prove it wrong.
    setup = tiny_setup("camb", execute_mode=mode, capture_token_sizes=[4, 8, 16], capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(2, [5, 3])
    step = setup.engine.prefill(seqs, [2, 1])
    assert step.attn_metadata.kv_seqlens_cpu.tolist() == [7, 4]
    _call(setup, step)  # the step's own maxima pass, and its layout is remembered: the next is checked in part
    with pytest.raises(InputError, match=r"^max_kv_seq_len=5, but attn_metadata.kv_seqlens_cpu holds 7 \(sequence "
                       r"0\).*Pass the step's real max_kv_seq_len \(the largest kv_seqlens\), or -1"):
        _call(setup, step, max_kv_seq_len=5)



@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mode", ["graph", "full_and_piecewise"])
def test_a_kv_maximum_below_the_host_lengths_is_refused_in_a_full_graph_decode_step(mode, native, monkeypatch):
    # A full graph's context carries its own maximum, so its replay read the whole lengths while eager
    # steps, given the step's maximum, clamped them (Camb): 0.291 off eager, silently, with and without
    # debug mode (an engine-input hunt, 2026-12-03). Refused on the Python path and by the native step,
    # which hands the step to it.
    if not native:
        monkeypatch.setenv("GRAPHMODE_NATIVE", "0")
    setup = tiny_setup("camb", execute_mode=mode, capture_batch_sizes=[1, 2, 4])
    seqs = setup.prefill(3, [5, 9, 3])
    for _ in range(3):  # the bucket captured, then replayed (the native step learns it)
        step = setup.engine.decode(seqs)
        _call(setup, step)
    step = setup.engine.decode(seqs)
    assert step.attn_metadata.kv_seqlens_cpu.tolist() == [9, 13, 7]
    with pytest.raises(InputError, match=r"^max_kv_seq_len=2, but attn_metadata.kv_seqlens_cpu holds 9 \(sequence "
                       r"0\).*where a graph's own maximum reads all of it. Pass the step's real max_kv_seq_len"):
        _call(setup, step, max_kv_seq_len=2)
    _call(setup, step)  # the step as it is still runs


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("built", ["on the host", "on the device, debug mode"])
def test_a_kv_maximum_below_the_lengths_without_host_lengths_is_refused(built, native, monkeypatch):
    # No kv_seqlens_cpu: the check above had nothing to read, and a full graph replayed the whole lengths
    # where eager (Camb) clamped them, 0.077 off eager, in debug mode too (an engine-input hunt, 2026-12-03).
    # A host-built step has kv_seqlens on the host (no synchronisation); debug mode reads a device's.
    if not native:
        monkeypatch.setenv("GRAPHMODE_NATIVE", "0")
    host = built == "on the host"
    setup = tiny_setup("camb", execute_mode="graph", capture_batch_sizes=[1, 2, 4], host_inputs=host,
                       debug=not host)
    seqs = setup.prefill(3, [5, 9, 3])
    for _ in range(3):  # captured, then replayed (the native step learns it)
        _call(setup, setup.engine.decode(seqs), kv_seqlens_cpu=None)
    step = setup.engine.decode(seqs)
    message = (r"^sequence 0 has kv_seqlens=9, above max_kv_seq_len=2: .*Pass the step's real "
               r"max_kv_seq_len \(the largest kv_seqlens\), or -1$" if host else
               r"^debug mode: sequence 0 has kv_seqlens=9, above the step's max_kv_seq_len=2")
    with pytest.raises(InputError, match=message):
        _call(setup, step, kv_seqlens_cpu=None, max_kv_seq_len=2)
    _call(setup, step, kv_seqlens_cpu=None)  # the step as it is still runs


@pytest.mark.parametrize("host", [False, True])
def test_host_lengths_above_a_right_kv_maximum_name_the_host_lengths(host):
    # kv_seqlens_cpu one above kv_seqlens, max_kv_seq_len right: the refusal told the engine to pass "the
    # step's real max_kv_seq_len", which it did. A host-built step's lengths show which one is wrong (no
    # synchronisation); a device-built step's error names both possibilities.
    setup = tiny_setup("camb", execute_mode="piecewise", capture_token_sizes=[4, 8, 16], host_inputs=host)
    seqs = setup.prefill(2, [5, 3])
    step = setup.engine.prefill(seqs, [2, 1])
    _call(setup, step)
    host_lengths = mark_host(step.attn_metadata.kv_seqlens_cpu + torch.tensor([1, 0], dtype=torch.int32))
    message = (r"^sequence 0 has kv_seqlens_cpu=8 but kv_seqlens=7; kernels that take host lengths" if host else
               r"^max_kv_seq_len=7, but attn_metadata.kv_seqlens_cpu holds 8 \(sequence 0\).*or -1; or, if "
               r"max_kv_seq_len is right, kv_seqlens_cpu is not the host copy of kv_seqlens")
    with pytest.raises(InputError, match=message):
        _call(setup, step, kv_seqlens_cpu=host_lengths)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_q_start_loc_off_the_prefix_sum_is_refused_in_a_host_built_piecewise_step(mode):
    # Host lengths cost no synchronisation to check. q_start_loc [0, 2, 0] for q_seqlens [2, 3, 1] ran
    # before, and its output differed from eager's on the same inputs: sequence 2 read sequence 0's
    # queries, and its own output rows held the previous replay's values.
    setup = tiny_setup(execute_mode=mode, capture_token_sizes=[4, 8, 16], capture_batch_sizes=[1, 2, 4],
                       host_inputs=True)
    seqs = setup.prefill(3, [3, 17, 5])
    step = setup.engine.prefill(seqs, [2, 3, 1])
    assert step.attn_metadata.q_start_loc.tolist() == [0, 2, 5]
    starts = mark_host(torch.tensor([0, 2, 0], dtype=torch.int32))
    with pytest.raises(InputError, match=r"^sequence 2 has q_start_loc=0, but its tokens start at token 5 \(the "
                       r"earlier sequences' q_seqlens summed\): q_start_loc must be the exclusive cumulative sum of "
                       r"q_seqlens$"):
        _call(setup, step, q_start_loc=starts)


def _cumulative(step):
    """vLLM's query_start_loc of the step: batch + 1 entries, from 0 to the step's tokens."""
    lengths = step.attn_metadata.q_seqlens
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0).to(lengths.dtype)])


@pytest.mark.parametrize("field, value, message", [
    # Before: "q_start_loc has shape (3,); a step of 2 sequences ... needs (2,)", no word of the cumulative array.
    ("q_start_loc", _cumulative, r"attn_metadata.q_start_loc has 3 rows, but attn_metadata.block_offsets, "
     r"attn_metadata.q_seqlens, attn_metadata.kv_seqlens have 2: a cumulative array, one entry longer than the "
     r"batch\? .*query_start_loc\[:-1\]\). .*fix attn_metadata.q_start_loc$"),
    # Before: the batch taken from q_seqlens (3): "is_decoding=True, but 2 new tokens for 3 sequences ... is not a
    # decode step", blaming the right tensors.
    ("q_seqlens", _cumulative, r"^attn_metadata.q_seqlens has 3 rows, .* have 2: a cumulative array.*"
     r"query_start_loc.diff\(\)\)"),
    # Before: "block_offsets has shape (16, 8); a step of 2 sequences and 2 tokens needs (2, 8)".
    ("block_offsets", lambda step: torch.zeros(16, 8, dtype=torch.int32), r"^attn_metadata.block_offsets has 16 "
     r"rows, .* have 2: a persistent buffer passed whole\? Pass its first 2 rows, block_offsets\[:2\]"),
    # Before: IndexError: tuple index out of range (the batch read as q_seqlens.shape[0]).
    ("q_seqlens", lambda step: torch.tensor(1, dtype=torch.int32),
     r"^attn_metadata.q_seqlens has shape \(\); a step of 2 sequences and 2 tokens needs \(2,\)$"),
], ids=["q_start_loc-cumulative", "q_seqlens-cumulative", "persistent-block-table", "q_seqlens-shape-()"])
def test_a_per_sequence_input_of_another_length_is_named(field, value, message):
    setup = tiny_setup()
    step = _decode(setup)
    with pytest.raises(InputError, match=message):
        _call(setup, step, **{field: value(step)})


@pytest.mark.parametrize("field, dtype", [
    ("input_ids", torch.int16), ("kv_start_indices", torch.uint8), ("block_offsets", torch.int8),
    ("kv_seqlens_cpu", torch.float32),
])
def test_step_tensors_of_an_integer_type_kernels_do_not_index_with_are_refused(field, dtype):
    # Before: accepted, the graph copying them into its int32/int64 buffers, while the eager model failed
    # on the same step inside torch ("Expected tensor for argument #1 'indices' to have one of the following
    # scalar types: Long, Int", an int16 embedding index); a uint8 PAD_SLOT_ID -1 is 255, a live slot, and
    # torch reads a uint8 index as a mask. Host lengths in float reached Ascend's kernels as floats.
    setup = tiny_setup()
    step = _decode(setup)
    tensor = step.input_ids if field == "input_ids" else getattr(step.attn_metadata, field)
    name = field if field == "input_ids" else f"attn_metadata.{field}"
    with pytest.raises(InputError, match=rf"^{name} has dtype {dtype}; it must be (an integer tensor \(int64 or "
                       r"int32\)|int64 or int32)"):
        _call(setup, step, **{field: tensor.to(dtype)})

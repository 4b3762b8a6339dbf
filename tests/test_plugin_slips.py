"""Slips of a vendor writing a plugin from docs/ alone (an outsider's plugin
for a made-up accelerator, written from README.md and docs/ without reading
the code): each is either refused with an error naming the value, the limit
and the fix, or diagnosed by the conformance suite naming the hook."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from plugins import walkthrough
from test_writing_a_plugin import graphmode_get_outputs as copied_outputs

import graphmode
import graphmode.model
from graphmode import hookimpl
from graphmode.spec import BufferSpec
from graphmode_conformance import ConformanceFailure, Harness, HookContractTests, Sizes
from graphmode_conformance.fixtures import ConformanceFixtures, VariantsNotRun
from graphmode_conformance.modes import build_in_mode, mixed_steps
from graphmode_conformance.outputs import MultiOutputHarness, SeveralOutputs

SIZES = Sizes(max_batches=12, block_size=32, table_width=6)


def acme(**hooks: Any) -> graphmode.Vendor:
    """The walkthrough plugin (docs/writing-a-plugin.md), the given hooks added or replaced."""
    plugin = argparse.Namespace(**{n: getattr(walkthrough, n) for n in dir(walkthrough) if n.startswith("graphmode_")})
    for name, function in hooks.items():
        setattr(plugin, name, function)
    return graphmode.load_vendor("acme", plugin=plugin)


def several_outputs(vendor: graphmode.Vendor, structure: str) -> MultiOutputHarness:
    def build(cls: type[Harness] = Harness, sizes: Sizes = SIZES, **options: Any) -> Harness:
        return cls.build(vendor, torch.device("cpu"), sizes, **options)

    harness = build_in_mode(build, SIZES, "graph", MultiOutputHarness,
                            wrap=lambda model: SeveralOutputs(model, structure))
    harness.check = f"every output of a {structure} equals eager"
    return harness


# The hook as docs/hooks.md stated it before 2026-11-26: "returns
# meta.output_buffers["output"] cut to the num_tokens live tokens".
@hookimpl
def _outputs_as_one_tensor(meta, batch_size, num_tokens):
    return meta.output_buffers["output"][:, :num_tokens]


def test_an_outputs_hook_that_takes_the_output_for_a_tensor_is_told_it_may_be_a_tuple():
    harness = several_outputs(acme(graphmode_get_outputs=_outputs_as_one_tensor), "tuple")
    with pytest.raises(ConformanceFailure) as failure:
        mixed_steps(harness)
    message = str(failure.value)
    assert message.startswith(
        "[every output of a tuple equals eager] vendor acme on cpu, a step of 8 sequences"), message
    assert "the runner raised TypeError in graphmode_get_outputs (plugin acme)" in message, message
    assert "The model returns a tuple here: meta.output_buffers['output'] is what the captured forward returned" \
        in message, message
    assert "wrap the default (@hookimpl(wrapper=True): outputs = yield)" in message, message


@pytest.mark.parametrize("structure", ["tuple", "dict"])
def test_the_documented_outputs_wrapper_returns_copies_of_every_cut_tensor(structure):
    """docs/writing-a-plugin.md's get_outputs wrapper (a region of
    tests/test_writing_a_plugin.py): every output equals eager, and each is
    a copy: the next replay leaves it as it was (a view of the graph's
    output would change)."""
    harness = several_outputs(acme(graphmode_get_outputs=copied_outputs), structure)
    mixed_steps(harness)
    engine = harness.engine
    seqs = [engine.add() for _ in range(3)]
    harness.prefill(seqs, [4, 7, 2])

    def decode() -> list[torch.Tensor]:
        step = engine.decode(seqs)
        with torch.inference_mode():
            outputs = harness.runner(step.input_ids, step.position_ids, harness.graph_cache, step.attn_metadata)
        return list(outputs.values()) if structure == "dict" else list(outputs)

    first = decode()
    kept = [t.clone() for t in first]
    decode()  # a replay of the same bucket, other tokens
    assert harness.runner.stats.replays > 0
    assert all(t.shape[1] == 3 and torch.equal(t, k) for t, k in zip(first, kept))


# A compatible size that "rounds differently", as docs/hooks.md allowed before
# 2026-11-26 ("a member of capture_sizes that is >= batch_size"): even buckets
# only. The runner accepted it; capture size 1 was captured and never replayed.
@hookimpl
def _even_buckets(batch_size, capture_sizes):
    return next((size for size in capture_sizes if size >= batch_size and size % 2 == 0), None)


# Batch 2 pads into 6 while batch 3 takes bucket 3.
@hookimpl
def _small_batches_pad_high(batch_size, capture_sizes):
    return 6 if batch_size == 2 else next(size for size in capture_sizes if size >= batch_size)


@pytest.mark.parametrize("hook, refusal", [
    (_even_buckets, r"graphmode_compatible_size\(1\) returned 6, but 1 is a capture size of \[1, 3, 6, 12\]: each "
                    r"capture size must be its own bucket, or its graph is captured and never replayed"),
    (_small_batches_pad_high, r"graphmode_compatible_size\(3\) returned 3, after graphmode_compatible_size\(2\) "
                              r"returned 6: buckets must not shrink as batches grow"),
], ids=["not_idempotent", "not_monotone"])
def test_a_compatible_size_that_rounds_differently_is_refused_when_the_runner_is_built(hook, refusal):
    with pytest.raises(graphmode.ConfigError, match=refusal) as refused:
        Harness.build(acme(graphmode_compatible_size=hook), torch.device("cpu"), SIZES)
    assert "declares that as its capture sizes (GraphSpec.capture_policy, FixedSizes)" in str(refused.value)


# Right up to the suite's runner (12 sequences), off above: batches 97..192 pad into 384.
@hookimpl
def _large_batches_pad_high(batch_size, capture_sizes):
    if 96 < batch_size <= 192 and 384 in capture_sizes:
        return 384
    return next((size for size in capture_sizes if size >= batch_size), None)


def test_the_suite_checks_the_compatible_size_on_the_vendors_policy_up_to_512_sequences():
    vendor = acme(graphmode_compatible_size=_large_batches_pad_high)
    harness = Harness.build(vendor, torch.device("cpu"), SIZES)  # the runner's own list is fine
    with pytest.raises(ConformanceFailure, match=(
        r"\[hook contract\] vendor acme: graphmode_compatible_size is not idempotent: \(192\) returned 384, but "
        r"192 is a capture size: each capture size must be its own bucket, or its graph is captured and never "
        r"replayed, on \[1, 3, 6, .*\]. So the one right answer is the smallest capture size that holds the batch"
    )):
        HookContractTests().test_compatible_size_holds_the_batch_and_is_a_capture_size(vendor, harness)


def test_a_runner_takes_a_loaded_plugin_that_is_not_installed():
    """build_reference_model and the Hugging Face loader took a graphmode.Vendor;
    build_graph_runner raised AttributeError: 'Vendor' object has no attribute 'strip'."""
    vendor = acme()
    model = graphmode.model.build_reference_model(graphmode.model.ModelConfig.tiny(), vendor=vendor)
    runner = graphmode.build_graph_runner(model, vendor=vendor, max_batches=8, max_blocks_per_seq=4, block_size=32)
    assert runner.vendor is vendor and runner.capture_sizes == (1, 3, 6, 8)
    with pytest.raises(graphmode.VendorError, match=r"vendor=<module 'plugins.walkthrough'.*give an installed vendor's "
                       r"name \(its entry-point name\), or a graphmode.Vendor \(graphmode.load_vendor\(name, "
                       r"plugin=module\)"):
        graphmode.build_graph_runner(model, vendor=walkthrough, max_batches=8, max_blocks_per_seq=4, block_size=32)


class _MultipliedMask(walkthrough.AcmeAttentionOps):
    """Acme's kernels, masking by multiplying the probabilities: right while
    block 0 holds zeros, NaN for every live row once it holds NaN (every
    table's unused columns point at it)."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        keys = self._gather(k_cache, attn.block_offsets, head_dim)  # (B, S, K, D)
        values = self._gather(v_cache, attn.block_offsets, head_dim)
        group = query.shape[1] // keys.shape[2]
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", query.float(), keys.float()) * scale
        visible = torch.arange(keys.shape[1], device=query.device)[None, :] < attn.kv_seqlens[:, None].long()
        probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        probs = probs * visible[:, None, :]  # the slip: 0 * NaN is NaN
        return torch.einsum("bhs,bshd->bhd", probs, values.float()).to(query.dtype)

    def prefill_attention(self, query, k_cache, v_cache, attn, scale):
        return super().prefill_attention(query, k_cache, v_cache, attn, scale)


@hookimpl
def _multiplied_mask_ops():
    return _MultipliedMask()


def test_a_kernel_that_lets_nan_in_the_reserved_block_reach_live_rows_fails():
    """Zeroed block 0 everywhere else in the suite: this kernel passed it all."""
    from graphmode_conformance import KVCacheIntegrityTests

    correct = Harness.build(acme(), torch.device("cpu"), SIZES)
    KVCacheIntegrityTests().test_live_results_never_depend_on_the_reserved_block(correct)
    slipped = Harness.build(acme(graphmode_attention_ops=_multiplied_mask_ops), torch.device("cpu"), SIZES)
    with pytest.raises(ConformanceFailure, match=(
        r"\[reserved block\] vendor acme on cpu, batch 11, bucket 12, step 1 \(capture\): max \|graph - eager\| = nan"
        r".*, with NaN in the reserved block 0 .*Likely cause: the vendor's attention kernels "
        r"\(graphmode_attention_ops\) "
        r"read block 0 and mask it by multiplying \(0 \* NaN is NaN\)")):
        KVCacheIntegrityTests().test_live_results_never_depend_on_the_reserved_block(slipped)


@hookimpl
def _acme_with_variants():
    return walkthrough.ACME_SPEC.replace(option_variants=({"max_graphs": None}, {"max_graphs": 2}))


class TestOwnTreeWithOptionVariants(ConformanceFixtures):
    """A vendor's own test class (docs/writing-a-plugin.md, section 6) overriding
    `vendor` for a vendor that declares option variants: they did not run, and
    nothing said so (GraphSpec.option_variants says every run takes each)."""

    @pytest.fixture
    def vendor(self):
        return acme(graphmode_graph_spec=_acme_with_variants)

    def test_the_default_vendor_options_warn_that_the_variants_do_not_run(self, recwarn, vendor_options):
        assert vendor_options is None
        (warning,) = [w for w in recwarn.list if issubclass(w.category, VariantsNotRun)]
        assert str(warning.message).startswith(
            "vendor acme declares option variants [{'max_graphs': None}, {'max_graphs': 2}] "
            "(GraphSpec.option_variants), but this test class overrides the `vendor` fixture and not "
            "`vendor_options`, so its tests run under the vendor's defaults only. To run each variant, add"
        ), warning.message


class TestOwnTreeWithoutOptionVariants(ConformanceFixtures):
    @pytest.fixture
    def vendor(self):
        return acme()

    def test_a_vendor_without_variants_runs_its_defaults_silently(self, recwarn, vendor_options):
        assert vendor_options is None
        assert not [w for w in recwarn.list if issubclass(w.category, VariantsNotRun)]


@hookimpl
def _cumulative_lengths_spec():
    # lmdeploy's cu_seqlens: the kv lengths' running sum after a leading 0, one row more than the sequences.
    return walkthrough.ACME_SPEC.with_buffers(BufferSpec(
        "cu_kv_seqlens", torch.int32, padding=0,
        source=lambda step: torch.nn.functional.pad(step.attn_metadata.kv_seqlens.cumsum(0), (1, 0)),
    ))


def test_a_source_giving_one_row_more_than_the_sequences_is_told_what_a_buffer_holds():
    harness = Harness.build(acme(graphmode_graph_spec=_cumulative_lengths_spec), torch.device("cpu"), SIZES)
    seqs = harness.start(3)
    with pytest.raises(ConformanceFailure, match=(
        r"step input 'cu_kv_seqlens' has shape \(4,\); its buffer takes \(3,\) for 3 sequences and 3 tokens "
        r"\(declared shape \('sequences',\)\): its source must give one row per sequence \(no extra row, a "
        r"leading 0, can be declared\)")):
        harness.step(seqs)


class _CopiedBlockView(_MultipliedMask):
    """The multiplied mask above, behind a ``block_view`` that returns a copy
    (as a reshape of a permuted cache does, e.g. for a layout splitting
    head_dim): NaN written through it never reached the cache, so the
    reserved-block test passed this kernel without testing it."""

    def block_view(self, cache, head_dim):
        return cache.transpose(1, 2).contiguous()


@hookimpl
def _copied_block_view_ops():
    return _CopiedBlockView()


def test_a_block_view_that_copies_the_cache_is_named_before_the_reserved_block_is_filled():
    slipped = Harness.build(acme(graphmode_attention_ops=_copied_block_view_ops), torch.device("cpu"), SIZES)
    from graphmode_conformance import KVCacheIntegrityTests

    with pytest.raises(ConformanceFailure, match=(
        r"\[reserved block\] vendor acme on cpu: NaN written into block 0 of block_view\(cache, head_dim\) did not "
        r"reach the KV cache: block_view returned a copy.*Fix graphmode_attention_ops' block_view")):
        KVCacheIntegrityTests().test_live_results_never_depend_on_the_reserved_block(slipped)


class _EmptyRowsNaN(walkthrough.AcmeAttentionOps):
    """Acme's decode kernel masking with -inf and no rule for a row that sees
    nothing: a softmax over no token is NaN. With kv length 0 as padding
    (declared, so every buffer check passes) the padding rows' outputs are
    NaN; cut away, they passed the suite, though docs/writing-a-plugin.md
    requires finite padding results."""

    def paged_decode_attention(self, query, k_cache, v_cache, attn, scale):
        head_dim = query.shape[-1]
        keys = self._gather(k_cache, attn.block_offsets, head_dim)
        values = self._gather(v_cache, attn.block_offsets, head_dim)
        group = query.shape[1] // keys.shape[2]
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", query.float(), keys.float()) * scale
        visible = torch.arange(keys.shape[1], device=query.device)[None, :] < attn.kv_seqlens[:, None].long()
        visible &= walkthrough.owned_positions(attn.block_offsets, keys.shape[1])
        probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        return torch.einsum("bhs,bshd->bhd", probs, values.float()).to(query.dtype)


@hookimpl
def _empty_rows_nan_ops():
    return _EmptyRowsNaN()


@hookimpl
def _zero_padding_length_spec():
    return walkthrough.ACME_SPEC.with_buffers(BufferSpec("kv_seqlens", torch.int32, padding=0))


def test_padding_rows_whose_outputs_are_not_finite_fail():
    correct = Harness.build(acme(graphmode_graph_spec=_zero_padding_length_spec), torch.device("cpu"), SIZES)
    seqs = correct.start(2)
    correct.step(seqs)  # Acme's kernel (attend): a row that sees nothing gives zeros
    correct.step(seqs)
    slipped = Harness.build(
        acme(graphmode_graph_spec=_zero_padding_length_spec, graphmode_attention_ops=_empty_rows_nan_ops),
        torch.device("cpu"), SIZES,
    )
    seqs = slipped.start(2)
    slipped.step(seqs)  # the capture: on a device its output buffers are not computed, so not checked
    with pytest.raises(ConformanceFailure, match=(
        r"\[graph equals eager\] vendor acme on cpu, batch 2, bucket 3, step 2 \(replay\): the graph's padding "
        r"tokens 2\.\.2 give non-finite outputs \(at tokens \[2\]\).*Likely cause: a declared padding value "
        r"\(here kv_seqlens padding 0\)")):
        slipped.step(seqs)


@hookimpl
def _caps_the_batch(config):
    config.max_batches = min(config.max_batches, 8)  # "our graphs take 8 sequences": a limit rewritten, not refused


def test_a_config_check_that_rewrites_the_engines_settings_is_refused_naming_the_hook():
    # A red-team plugin (2026-12-04) lowered max_batches to its limit instead of refusing it: the suite's
    # first failure then blamed graphmode_capture_sizes for a capture list ending below max_batches.
    with pytest.raises(graphmode.VendorError, match=r"vendor 'acme': graphmode_check_config changed the runner's "
                       r"max_batches \(now max_batches=8, asked max_batches=12\); a hook may replace vendor_options "
                       r"only. Raise ConfigError naming the value, the limit and the fix instead"):
        Harness.build(acme(graphmode_check_config=_caps_the_batch), torch.device("cpu"), SIZES)


@hookimpl
def _table_in_pinned_memory(meta):
    made = graphmode.buffers.allocate(meta)
    table = made["block_offsets"]
    made["block_offsets"] = graphmode.buffers.host_zeros(meta, table.shape, table.dtype, pinned=True)
    return made


def test_a_buffer_made_elsewhere_than_declared_is_refused_at_the_first_capture():
    # A red-team plugin (2026-12-04) made the block table in pinned host memory: the suite's first failure
    # blamed the default fill for reading a device value on the host, and advised host=True.
    harness = Harness.build(acme(graphmode_make_buffers=_table_in_pinned_memory), torch.device("cpu"), SIZES)
    with pytest.raises(graphmode.VendorError, match=r"vendor 'acme': graphmode_make_buffers made buffer "
                       r"'block_offsets' in host memory, but it is declared in the runner's device \(on the emulator"):
        harness.runner.graph_meta()

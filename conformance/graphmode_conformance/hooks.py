"""Hook contract: buffers, filling, padding, the step context and buckets,
checked hook by hook against GraphMeta."""

from __future__ import annotations

import pytest
import torch

from graphmode.context import StepInputs
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, Harness

__all__ = ["HookContractTests"]

# Buffers every vendor keeps, under these names (their shapes may differ).
REQUIRED_BUFFERS = ("input_ids", "position_ids", "block_offsets", "kv_seqlens", "kv_start_indices")
_INTEGER = (torch.int64, torch.int32)


def _rows(name: str, tensor: torch.Tensor) -> int:
    """Rows of a buffer: per-token buffers are (1, max_tokens)."""
    return tensor.shape[1] if name in ("input_ids", "position_ids") else tensor.shape[0]


@torch.inference_mode()
def _fill(harness: Harness, step: StepInputs, batch: int):
    meta = harness.runner.graph_meta()
    bucket = harness.runner.bucket_of(batch)
    harness.vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
    return meta, bucket


def _padded_batch(harness: Harness, start: int = 1) -> int | None:
    """The smallest batch size >= start that its bucket pads (None if every
    size from start up has a graph of its own): padding bugs show only there."""
    runner = harness.runner
    return next((b for b in range(start, harness.sizes.max_batches + 1) if runner.bucket_of(b) not in (None, b)), None)


def _decode_step(harness: Harness, batch: int) -> StepInputs:
    seqs = [harness.engine.add() for _ in range(batch)]
    harness.engine.prefill(seqs, [harness.engine.rng.randrange(1, 40) for _ in seqs])
    return harness.engine.decode(seqs)


class HookContractTests(ConformanceFixtures):
    def test_vendor_describes_itself(self, vendor):
        info = vendor.info
        assert info.name == vendor.name, f"graphmode_vendor_info names {info.name!r}, registered as {vendor.name!r}"
        assert info.device_types and info.reason and info.runtime

    def test_capture_list_is_sorted_unique_and_ends_at_the_maximum(self, harness):
        sizes, maximum = harness.runner.capture_sizes, harness.sizes.max_batches
        assert list(sizes) == sorted(set(sizes)), f"capture list {sizes} is not ascending and unique"
        assert sizes[0] >= 1 and sizes[-1] == maximum, f"capture list {sizes} must end at max_batches={maximum}"

    def test_compatible_size_holds_the_batch_and_is_a_capture_size(self, vendor, harness):
        sizes = harness.runner.capture_sizes
        previous = 0
        for batch in range(1, harness.sizes.max_batches + 1):
            bucket = vendor.hook.graphmode_compatible_size(batch_size=batch, capture_sizes=sizes)
            if bucket is None or bucket < batch or bucket not in sizes:
                raise ConformanceFailure(
                    f"[hook contract] vendor {vendor.name}: graphmode_compatible_size({batch}) = {bucket}; "
                    f"it must be a capture size >= {batch} from {list(sizes)}"
                )
            assert bucket >= previous, f"compatible size is not monotone: {batch} -> {bucket} after {previous}"
            again = vendor.hook.graphmode_compatible_size(batch_size=bucket, capture_sizes=sizes)
            assert again == bucket, f"compatible size is not idempotent: {bucket} -> {again}"
            previous = bucket

    def test_buffers_are_sized_by_graph_meta(self, harness):
        meta = harness.runner.graph_meta()
        buffers = meta.input_buffers
        missing = [name for name in REQUIRED_BUFFERS if name not in buffers]
        assert not missing, f"graphmode_make_buffers left out {missing}"
        for name, tensor in buffers.items():
            assert tensor.device in (meta.device, torch.device("cpu")), (
                f"buffer {name} is on {tensor.device}, not GraphMeta.device={meta.device} or the host"
            )
        for name in REQUIRED_BUFFERS:
            tensor = buffers[name]
            assert tensor.dtype in _INTEGER, f"buffer {name} has dtype {tensor.dtype}, not int32/int64"
            rows = _rows(name, tensor)
            assert rows in (meta.max_batchs, meta.max_tokens), (
                f"buffer {name} has shape {tuple(tensor.shape)}: {rows} rows, not max_batchs="
                f"{meta.max_batchs} or max_tokens={meta.max_tokens}"
            )
        width = buffers["block_offsets"].shape[1]
        assert width == meta.num_blocks, f"block_offsets has {width} columns, GraphMeta.num_blocks={meta.num_blocks}"

    def test_filling_twice_with_the_same_inputs_is_idempotent(self, harness):
        step = _decode_step(harness, 5)
        meta, _ = _fill(harness, step, 5)
        first = {name: t.clone() for name, t in meta.input_buffers.items()}
        _fill(harness, step, 5)
        changed = [name for name, t in meta.input_buffers.items() if not torch.equal(t, first[name])]
        assert not changed, f"filling the same step twice changed {changed}"

    def test_padding_is_neutral_after_a_larger_batch(self, harness, vendor):
        # A full bucket, then the smallest batch of that bucket: the first
        # bucket from 7 up that pads at all (a list may give 7, 8, ... their own).
        runner, padded = harness.runner, _padded_batch(harness, 7)
        if padded is None:
            pytest.skip("no batch size from 7 up is padded: no padding rows to check")
        bucket = runner.bucket_of(padded)
        small = min(b for b in range(1, bucket + 1) if runner.bucket_of(b) == bucket)
        _fill(harness, _decode_step(harness, bucket), bucket)
        meta, _ = _fill(harness, _decode_step(harness, small), small)
        buffers, block_size = meta.input_buffers, harness.sizes.block_size
        problems = []
        slots = buffers["kv_start_indices"].reshape(buffers["kv_start_indices"].shape[0], -1)[small:bucket]
        if (slots != -1).any():
            problems.append(f"kv_start_indices padding {slots.flatten().tolist()} (must be -1: no KV write)")
        blocks = buffers["block_offsets"][small:bucket]
        if (blocks != 0).any():
            problems.append(f"block_offsets padding rows hold blocks {sorted(set(blocks.flatten().tolist()) - {0})} (must be the reserved block 0)")
        lengths = buffers["kv_seqlens"][small:bucket]
        if ((lengths < 0) | (lengths > block_size)).any():
            problems.append(f"kv_seqlens padding {lengths.tolist()} (must read at most the reserved block: 0..{block_size})")
        ids = buffers["input_ids"][0, small:bucket]
        if ((ids < 0) | (ids >= harness.model.config.vocab_size)).any():
            problems.append(f"input_ids padding {ids.tolist()} outside the vocabulary")
        if problems:
            raise ConformanceFailure(
                f"[padding] vendor {vendor.name}: after a batch of {bucket} then {small} in bucket {bucket}, "
                f"padding rows {small}..{bucket - 1} are not neutral: " + "; ".join(problems)
                + ". Likely cause: graphmode_fill_buffers does not reset padding rows every step"
            )

    def test_step_context_points_at_the_buffers(self, harness, vendor):
        batch = _padded_batch(harness) or 3  # a padded batch tells bucket rows from batch rows
        step = _decode_step(harness, batch)
        meta, bucket = _fill(harness, step, batch)
        static = vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        storages = {t.untyped_storage().data_ptr() for t in meta.input_buffers.values()}
        attn = static.attn_metadata
        fields = {"input_ids": static.input_ids, "position_ids": static.position_ids}
        fields.update({
            f"attn_metadata.{name}": getattr(attn, name)
            for name in ("block_offsets", "q_start_loc", "q_seqlens", "kv_seqlens", "kv_start_indices",
                         "kv_seqlens_cpu", "x_active_mask")
            if getattr(attn, name) is not None
        })
        for name, tensor in fields.items():
            if tensor.untyped_storage().data_ptr() not in storages:
                raise ConformanceFailure(
                    f"[step context] vendor {vendor.name}: {name} of the graph context is not a view of an "
                    "input buffer, so a graph would read the capture step's tensor forever. Likely cause: "
                    "graphmode_update_context does not point it at its buffer"
                )
            rows = tensor.shape[1] if name in ("input_ids", "position_ids") else tensor.shape[0]
            if rows != bucket:
                raise ConformanceFailure(
                    f"[step context] vendor {vendor.name}: {name} has {rows} rows for a batch of {batch} in bucket "
                    f"{bucket}; graphs must be captured at their bucket's size"
                )
        assert attn.is_decoding
        capacity = attn.block_offsets.shape[1] * meta.block_size
        if 0 < attn.max_kv_seq_len < capacity:
            raise ConformanceFailure(
                f"[step context] vendor {vendor.name}: the graph context has max_kv_seq_len="
                f"{attn.max_kv_seq_len}. A graph freezes host values, so every replay would use the "
                "capture step's max length; graph contexts must pass -1 where the kernel derives it on "
                f"the device, or a bound valid at every replay: the block table's capacity, {capacity}"
            )

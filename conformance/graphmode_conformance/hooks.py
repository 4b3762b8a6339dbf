"""Hook contract: buffers, filling, padding, the step context and buckets,
checked hook by hook against GraphMeta and the vendor's declarations."""

from __future__ import annotations

import pytest
import torch

from graphmode.context import StepInputs
from graphmode.meta import GraphMeta
from graphmode.spec import ROW_INDEX
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, Harness
from graphmode_conformance.sizes import vendor_capture_sizes
from graphmode_conformance.structure import DeclaredBuffers, check_context, check_unmodified, step_tensors

__all__ = ["HookContractTests"]

# Buffers every vendor keeps, under these names (their shapes may differ).
REQUIRED_BUFFERS = ("input_ids", "position_ids", "block_offsets", "kv_seqlens", "kv_start_indices")
_INTEGER = (torch.int64, torch.int32)


def _decode_step(harness: Harness, batch: int) -> StepInputs:
    """A decode step of ``batch`` new sequences, which then leave (their
    blocks go back to the engine): for hook calls that run no model."""
    seqs = [harness.engine.add() for _ in range(batch)]
    harness.engine.prefill(seqs, [harness.engine.rng.randrange(1, 40) for _ in seqs])
    step = harness.engine.decode(seqs)
    harness.finish(seqs)
    return step


def _fill(harness: Harness, step: StepInputs, batch: int, bucket: int | None = None) -> tuple[GraphMeta, int]:
    """The vendor's fill of ``step``, then every declared-buffer check and
    the engine's tensors unmodified."""
    meta = harness.runner.graph_meta()
    bucket = bucket or harness.runner.bucket_of(batch)
    assert bucket is not None
    hook = harness.vendor.hook
    before, snapshot = DeclaredBuffers.snapshot(meta), step_tensors(step)

    def fill(inputs: StepInputs) -> None:
        with torch.inference_mode():
            hook.graphmode_fill_buffers(meta=meta, inputs=inputs, batch_size=batch, bucket=bucket)

    fill(step)
    where = f"vendor {harness.vendor.name}{harness.variant}, graphmode_fill_buffers of a batch of {batch} in bucket {bucket}"
    check_unmodified(where, step, snapshot, [("graphmode_fill_buffers", fill)])
    harness.check_buffers(where, meta, step, batch, bucket, before)
    return meta, bucket


def _smallest_batch(harness: Harness, bucket: int) -> int:
    return min(b for b in range(1, bucket + 1) if harness.runner.bucket_of(b) == bucket)


def _padded_batch(harness: Harness, start: int = 1) -> int | None:
    """The smallest batch size >= start that its bucket pads (None if every
    size from start up has a graph of its own): padding bugs show only there."""
    runner = harness.runner
    return next((b for b in range(start, harness.sizes.max_batches + 1) if runner.bucket_of(b) not in (None, b)), None)


# Step fields whose values are lengths; a buffer copying one pads with a length.
_KV_LENGTHS = ("kv_seqlens", "kv_seqlens_cpu")
_LENGTHS = (*_KV_LENGTHS, "q_seqlens", "q_seqlens_cpu")
_CORE = ("kv_start_indices", "block_offsets", "kv_seqlens")  # checked by name above


def _copies_padded_unlike_their_source(spec, block_size: int) -> list[str]:
    """Problems of every other declared buffer whose live rows come from a
    slot, block-table or length field of the step (a host copy of the kv
    lengths, say): its padding must be what that field's own buffer pads
    with, whatever its name."""
    problems = []
    for buffer in spec.buffers:
        fields = {path.rsplit(".", 1)[-1] for path in buffer.sources}
        if buffer.name in _CORE or not fields:
            continue
        pad, what = buffer.padding, f"buffer {buffer.name} (source {', '.join(buffer.sources)})"
        if "kv_start_indices" in fields and pad != -1:
            problems.append(f"{what} padding {pad!r}: it holds KV slots, and a padding slot {pad!r} writes into the "
                            "cache (a live block, or the reserved block 0); declare padding=-1 (no KV write)")
        elif "block_offsets" in fields and pad != 0:
            problems.append(f"{what} padding {pad!r}: it holds block-table entries, and padding rows must read the "
                            "reserved block 0, nothing else; declare padding=0"
                            + (" (a kernel marking no block with -1 keeps padding -1 and derives the source, "
                               "source=lambda step: torch.where(step.attn_metadata.block_offsets == 0, -1, "
                               "step.attn_metadata.block_offsets): the engine's unused columns point at block 0, "
                               "which a copy would hand the kernel as an owned block; docs/writing-a-plugin.md, "
                               "'Padding must be neutral')" if pad == -1 else ""))
        elif fields & set(_LENGTHS) or any(field.endswith(("seqlens", "seqlens_cpu")) for field in fields):
            kv = bool(fields & set(_KV_LENGTHS))
            number = isinstance(pad, (int, float))
            if number and pad < 0:
                harm = "unsigned 0xFFFFFFFF, or a loop bound: out-of-range reads"
            elif number and kv and pad > block_size:
                harm = f"more than the reserved block's {block_size} tokens: out-of-range reads"
            else:
                continue
            problems.append(
                f"{what} padding {pad!r}: it holds lengths, and every padding row would hand the kernel a length of "
                f"{pad!r} ({harm}). -1 is the slot buffer's padding (no KV write), not a length's: padding rows read "
                f"the reserved block 0 with length 1; declare padding=1 ({f'0..{block_size}' if kv else '>= 0'})"
            )
    return problems


def _positions_outside_the_table(spec, positions: int) -> list[str]:
    """Problems of every declared buffer holding positions (``position_ids``
    or a copy of it) whose padding is no position of the model's rotary
    table: a padding token's position indexes the table."""
    problems = []
    for buffer in spec.buffers:
        fields = {buffer.name} | {path.rsplit(".", 1)[-1] for path in buffer.sources}
        pad = buffer.padding
        if "position_ids" in fields and isinstance(pad, (int, float)) and not 0 <= pad < positions:
            problems.append(
                f"buffer {buffer.name} padding {pad!r}: it holds positions, and the rotary embedding reads its "
                f"cos/sin table at every padding token's position, outside the table's 0..{positions - 1} (results "
                "here are right: PyTorch's indexing wraps -1 to the table's last row; a device kernel indexing the "
                "table by pointer, as fused rotary kernels do, reads out of range). -1 is the slot buffer's padding "
                "(no KV write), not a position's; declare padding=0"
            )
    return problems


def _bytes(tensor: torch.Tensor) -> str:
    start = tensor.storage_offset() * tensor.element_size()
    return f"{start}..{start + _extent(tensor) - 1}"


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to past its last."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _overlapping(buffers: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """Two buffers whose memory overlaps (the first pair found), else None:
    byte ranges per device, so views of one tensor pass where disjoint."""
    spans = []
    for name, tensor in buffers.items():
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
            spans.append((str(tensor.device), start, start + _extent(tensor), name))
    spans.sort()
    for (device, _, end, name), (other_device, start, _, other) in zip(spans, spans[1:]):
        if device == other_device and start < end:
            return name, other
    return None


def _check_context_writes_nothing(
    where: str, meta: GraphMeta, filled: dict[str, torch.Tensor], batch: int, bucket: int,
) -> None:
    """graphmode_update_context runs before a capture only, never on replay:
    what it writes into a buffer, every replay reads as the capture step left it."""
    for name, tensor in meta.input_buffers.items():
        now = tensor.detach().cpu()
        if name in filled and not torch.equal(now, filled[name]):
            rows = (now != filled[name]).reshape(now.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            raise ConformanceFailure(
                f"[step context] {where}, batch {batch} in bucket {bucket}: graphmode_update_context wrote into "
                f"buffer {name} (rows {rows[:8]}{' ...' if len(rows) > 8 else ''} changed after "
                "graphmode_fill_buffers had filled it). It runs before each capture only, never on replay, so every "
                f"replay would read {name} as the capture step left it. Compute per-step values in "
                "graphmode_fill_buffers (or declare the buffer, BufferSpec(source=...), and graphmode.buffers.fill "
                "fills it); graphmode_update_context only points the context at the buffers"
            )


class HookContractTests(ConformanceFixtures):
    def test_vendor_describes_itself(self, vendor):
        info = vendor.info
        assert info.name == vendor.name, f"graphmode_vendor_info names {info.name!r}, registered as {vendor.name!r}"
        assert info.device_types and info.reason and info.runtime

    def test_capture_list_is_sorted_unique_and_ends_at_the_largest_graph(self, harness, vendor):
        """The capture list ends at max_batches, or at the largest graph the
        vendor declares (GraphSpec.max_capture_size, FixedSizes)."""
        sizes, maximum, given = list(harness.runner.capture_sizes), harness.sizes.max_batches, harness.sizes.capture_sizes
        spec = harness.runner.spec
        where = f"[hook contract] vendor {vendor.name}{harness.variant}: graphmode_capture_sizes returned {sizes} at max_batches={maximum}"
        if sizes != sorted(set(sizes)):
            raise ConformanceFailure(f"{where}: not ascending and unique. Fix the hook (or GraphSpec.capture_policy)")
        if given is not None:
            if not set(sizes) <= set(given):
                raise ConformanceFailure(f"{where}: it adds sizes to the user's {list(given)}; a plugin may only trim it")
            return
        largest = spec.largest_graph(maximum)
        if sizes[-1] == largest:
            return
        if spec.max_capture_size is None:
            raise ConformanceFailure(
                f"{where}: it ends at {sizes[-1]}, and the vendor declares no largest graph, so batches "
                f"{sizes[-1] + 1}..{maximum} would run eagerly unannounced. Fix: end the list at max_batches "
                "(graphmode_capture_sizes, GraphSpec.capture_policy), or, if the hardware captures no larger "
                "graph, declare it in the GraphSpec: max_capture_size=N, or capture_policy=FixedSizes((...)) "
                "for a fixed list"
            )
        raise ConformanceFailure(
            f"{where}: it ends at {sizes[-1]}, but the declarations (GraphSpec max_capture_size="
            f"{spec.max_capture_size}, capture_policy) promise graphs up to {largest}. Fix "
            "graphmode_capture_sizes (spec.capture_list(config.max_batches, config.capture_batch_sizes) keeps "
            "to the declarations), or declare the largest graph it really captures"
        )

    def test_batches_above_the_largest_graph_run_eagerly(self, harness, vendor):
        """A vendor whose largest graph is below max_batches: those batches
        run eagerly (graph equals eager is checked at every batch size by
        the equivalence tests), counted as ``no_bucket`` eager steps."""
        largest = harness.runner.capture_sizes[-1]
        if largest >= harness.sizes.max_batches:
            pytest.skip(f"capture list {list(harness.runner.capture_sizes)} ends at max_batches: no batch above it")
        seqs = harness.start(largest + 1)
        before = harness.runner.stats.eager_steps["no_bucket"]
        harness.step(seqs)
        harness.step(seqs[:largest])
        if harness.runner.stats.eager_steps["no_bucket"] != before + 1:
            raise ConformanceFailure(
                f"[hook contract] vendor {vendor.name}{harness.variant}: a batch of {largest + 1}, above the "
                f"largest graph {largest}, should run eagerly as a no_bucket step, and the batch of {largest} "
                f"in its graph; runner: {harness.runner.stats.summary()}. Hook: graphmode_compatible_size "
                "(None above the largest capture size)"
            )

    def test_compatible_size_holds_the_batch_and_is_a_capture_size(self, vendor, harness):
        # The harness's list, and the vendor's policy up to at least 512
        # sequences (engines run that many; the suite's model steps do not).
        top = max(512, harness.sizes.max_batches)
        for sizes in (harness.runner.capture_sizes, vendor_capture_sizes(vendor, harness.sizes, top)):
            previous = 0
            for batch in range(1, sizes[-1] + 1):
                bucket = vendor.hook.graphmode_compatible_size(batch_size=batch, capture_sizes=sizes)
                if bucket is None or bucket < batch or bucket not in sizes:
                    raise ConformanceFailure(
                        f"[hook contract] vendor {vendor.name}: graphmode_compatible_size({batch}) returned {bucket}; "
                        f"it must be a capture size >= {batch} from {list(sizes)}"
                    )
                if bucket < previous or (batch in sizes and bucket != batch):
                    broken = (
                        f"not monotone: ({batch}) returned {bucket} after ({batch - 1}) returned {previous}"
                        if bucket < previous
                        else f"not idempotent: ({batch}) returned {bucket}, but {batch} is a capture size: each "
                        "capture size must be its own bucket, or its graph is captured and never replayed"
                    )
                    raise ConformanceFailure(
                        f"[hook contract] vendor {vendor.name}: graphmode_compatible_size is {broken}, on "
                        f"{list(sizes)}. So the one right answer is the smallest capture size that holds the batch "
                        "(the default): a vendor whose batches round up differently declares that as its capture "
                        "sizes (GraphSpec.capture_policy, FixedSizes)"
                    )
                previous = bucket

    def test_buffers_are_made_as_declared(self, harness):
        meta = harness.runner.graph_meta()
        buffers = meta.input_buffers
        missing = [name for name in REQUIRED_BUFFERS if name not in buffers]
        assert not missing, f"graphmode_make_buffers left out {missing}"
        for spec in meta.spec.buffers:
            assert spec.name in buffers, f"graphmode_make_buffers left out the declared buffer {spec.name}"
            tensor = buffers[spec.name]
            expected = spec.size(meta.max_batchs, meta.max_tokens, meta.num_blocks)
            assert tuple(tensor.shape) == expected and tensor.dtype == spec.dtype, (
                f"buffer {spec.name} is {tuple(tensor.shape)} {tensor.dtype}; declared {expected} {spec.dtype}"
            )
            where = torch.device("cpu") if spec.host else meta.device
            assert tensor.device == where, f"buffer {spec.name} is on {tensor.device}; declared on {where}"
            made = meta.padding_buffers[spec.name].cpu()  # the snapshot taken right after it was made
            declared = spec.allocate(meta.max_batchs, meta.max_tokens, meta.num_blocks, torch.device("cpu"))
            if not torch.equal(made, declared):
                wrong = sorted(set(made[made != declared].flatten().tolist()))[:6]
                raise ConformanceFailure(
                    f"[buffers] buffer {spec.name} held {wrong} when made, not its declared padding "
                    f"{spec.padding!r}: graphmode_make_buffers must return every buffer holding its padding "
                    "(the runner resets padding rows from that snapshot at every step)"
                )
            if not tensor.is_contiguous():
                raise ConformanceFailure(
                    f"[buffers] graphmode_make_buffers made buffer {spec.name} not contiguous (shape "
                    f"{tuple(tensor.shape)}, strides {tensor.stride()}: a column of a wider tensor). A device kernel "
                    "takes a buffer by its pointer and reads its elements one after another, so it reads the "
                    "neighbouring values in between. Make every buffer contiguous: rows of one (3, max_batchs) "
                    "tensor, not columns of a (max_batchs, 3) one"
                )
        shared = _overlapping(buffers)
        if shared:
            a, b = shared
            raise ConformanceFailure(
                f"[buffers] graphmode_make_buffers made buffers {a} and {b} in overlapping memory (the same "
                f"storage, bytes {_bytes(buffers[a])} and {_bytes(buffers[b])}): every fill of one overwrites the "
                "other, and the graph reads one step's values through both. Make every buffer its own memory "
                "(views of one tensor are fine where they do not overlap: rows 0, 1, 2 of a (3, max_batchs) tensor)"
            )
        for name in REQUIRED_BUFFERS:
            assert buffers[name].dtype in _INTEGER, f"buffer {name} has dtype {buffers[name].dtype}, not int32/int64"
        width = buffers["block_offsets"].shape[1]
        assert width == meta.num_blocks, f"block_offsets has {width} columns, GraphMeta.num_blocks={meta.num_blocks}"

    def test_declared_padding_is_neutral(self, harness, vendor):
        """The declarations themselves: padding writes nothing, reads the
        reserved block, and lengths read at most that block."""
        spec, block_size = harness.runner.spec, harness.sizes.block
        problems = []
        slots = spec.buffer("kv_start_indices").padding
        if slots != -1:
            problems.append(f"kv_start_indices padding {slots!r} (must be -1: no KV write)")
        blocks = spec.buffer("block_offsets").padding
        if blocks != 0:
            problems.append(f"block_offsets padding {blocks!r} (must be the reserved block 0)")
        lengths = spec.padding_kv_length
        if not isinstance(lengths, int) or not 0 <= lengths <= block_size:
            problems.append(f"kv_seqlens padding {lengths!r} (must read at most the reserved block: 0..{block_size})")
        ids = spec.buffer("input_ids").padding
        if not isinstance(ids, int) or not 0 <= ids < harness.model.config.vocab_size:
            problems.append(f"input_ids padding {ids!r} outside the vocabulary")
        problems += _copies_padded_unlike_their_source(spec, block_size)
        problems += _positions_outside_the_table(spec, harness.model.config.max_position_embeddings)
        if problems:
            raise ConformanceFailure(
                f"[padding] vendor {vendor.name}: the declared padding is not neutral: " + "; ".join(problems)
                + ". Fix the plugin's GraphSpec (graphmode_graph_spec)"
            )

    def test_query_layout_follows_q_len(self, harness, vendor):
        """A buffer no step writes that the context reads as query starts
        holds each row's index (ROW_INDEX): every row of it is padding. A
        vendor taking multi-token decode graphs (GraphSpec.max_q_len not
        1): a buffer no step writes that the context reads as query starts or
        lengths holds per-sequence constants of one q_len unless declared
        q_len_scaled, which gives every graph its own q_len's pattern."""
        spec = harness.runner.spec
        query = {"attn_metadata.q_start_loc": "starts", "attn_metadata.q_seqlens": "lengths"}
        for buffer in spec.buffers:
            # Written by no step, every row is padding: the query starts of a
            # decode graph are 0, 1, 2, ... (times q_len), whatever the bucket.
            if "attn_metadata.q_start_loc" in buffer.contexts and not buffer.written and buffer.padding != ROW_INDEX:
                raise ConformanceFailure(
                    f"[declarations] vendor {vendor.name}: buffer {buffer.name} (query starts, written by no step) "
                    f"has padding {buffer.padding!r}, so every sequence of a graph starts at query token "
                    f"{buffer.padding!r}: sequence i's first new token is row i (i * q_len in a graph of q_len "
                    f"tokens per sequence), and a kernel reading the starts takes one sequence's queries for "
                    f"all. Declare padding=ROW_INDEX (graphmode.spec) in graphmode_graph_spec, as CUDA_SPEC's "
                    "q_start_loc does"
                )
        if spec.max_q_len == 1:
            pytest.skip("the vendor takes one new token per sequence (GraphSpec.max_q_len 1)")
        for buffer in spec.buffers:
            read_as = [query[path] for path in buffer.contexts if path in query]
            if read_as and not buffer.written and not buffer.q_len_scaled:
                raise ConformanceFailure(
                    f"[declarations] vendor {vendor.name}: buffer {buffer.name} (query {read_as[0]}, written by no "
                    f"step, padding {buffer.padding!r}) is not q_len_scaled, but the vendor takes multi-token decode "
                    f"graphs (GraphSpec max_q_len={spec.max_q_len}): a graph of q_len 2 would read the query "
                    f"{read_as[0]} of one token per sequence. Declare it q_len_scaled=True in graphmode_graph_spec "
                    "(CUDA_SPEC's q_start_loc and q_seqlens are), or max_q_len=1"
                )

    def test_filling_twice_with_the_same_inputs_is_idempotent(self, harness):
        step = _decode_step(harness, 5)
        meta, _ = _fill(harness, step, 5)
        first = {name: t.clone() for name, t in meta.input_buffers.items()}
        _fill(harness, step, 5)
        changed = [name for name, t in meta.input_buffers.items() if not torch.equal(t, first[name])]
        assert not changed, f"filling the same step twice changed {changed}"

    def test_declared_padding_after_shrinks_and_larger_buckets(self, harness):
        """For every bucket that pads, largest first: its full batch, then its
        smallest batch (a shrink inside the bucket), then the largest bucket's
        full batch and its smallest batch again (the bucket reused after a
        larger one ran). After each fill every declared buffer must hold its
        declared padding in every padding row of the bucket."""
        runner = harness.runner
        sizes = runner.capture_sizes
        largest = sizes[-1]
        padded = [b for b in reversed(sizes) if _smallest_batch(harness, b) < b]
        if not padded:
            pytest.skip(f"no bucket of {list(sizes)} pads: no padding rows to check")
        for bucket in padded:
            small = _smallest_batch(harness, bucket)
            _fill(harness, _decode_step(harness, bucket), bucket)
            _fill(harness, _decode_step(harness, small), small)
            if bucket != largest:
                _fill(harness, _decode_step(harness, largest), largest)
                _fill(harness, _decode_step(harness, small), small)

    def test_step_context_points_at_the_buffers(self, harness, vendor):
        batch = _padded_batch(harness) or 3  # a padded batch tells bucket rows from batch rows
        step = _decode_step(harness, batch)
        meta, bucket = _fill(harness, step, batch)
        filled = DeclaredBuffers.snapshot(meta)
        with torch.inference_mode():
            static = vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        _check_context_writes_nothing(f"vendor {vendor.name}{harness.variant}", meta, filled, batch, bucket)
        check_context(f"vendor {vendor.name}{harness.variant}", meta.spec, meta, static, batch, bucket)
        attn = static.attn_metadata
        assert attn.is_decoding
        capacity = attn.block_offsets.shape[1] * meta.block_size
        if 0 < attn.max_kv_seq_len < capacity:
            width = step.attn_metadata.block_offsets.shape[1]
            derived = (
                f" ({width} x {meta.block_size}: the capture step's own block-table width times the block size)"
                if attn.max_kv_seq_len == width * meta.block_size else
                f" (the capacity {capacity} minus one: the last position, not the length; a sequence filling its "
                "table has one more token than that)" if attn.max_kv_seq_len == capacity - 1 else ""
            )
            frozen = "a bound too short for a full table" if derived.startswith(" (the capacity") else \
                "the capture step's max length"
            raise ConformanceFailure(
                f"[step context] vendor {vendor.name}: the graph context has max_kv_seq_len="
                f"{attn.max_kv_seq_len}{derived}. A graph freezes host values, so every replay would use "
                f"{frozen}; graph contexts must pass -1 where the kernel derives it on "
                f"the device, or a bound valid at every replay: the block table's capacity, {capacity}. Hook: "
                "graphmode_update_context (or GraphSpec.max_kv_policy)"
            )

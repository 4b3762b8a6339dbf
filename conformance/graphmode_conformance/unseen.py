"""What a vendor can get wrong that outputs on the emulator do not show.

- :class:`UnseenByOutputsTests`: the distributed backend of an indexed
  device (``cuda:0``, as every rank passes its own) is the un-indexed
  device's; the host values a graph's kernels read at replay (what
  ``graphmode_update_graph_params`` pushed) hold, in every padding row of the
  bucket, what the declared buffer they come from holds there, not what an
  earlier, larger batch left; the fill copies integers far above what the
  harness's small caches reach (block ids above 2**26, 128k contexts) exactly,
  with no narrower or floating dtype on the way.

A device-to-host read on the replay path, however the value lands (``.item()``,
a copy into a host buffer), is refused by the runner's replay guard on every
step of every test (``graphmode.emulator.replay``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from graphmode.context import StepInputs
from graphmode.emulator import EmulatedGraph, is_host, mark_host
from graphmode.spec import BLOCKS
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import Harness
from graphmode_conformance.hooks import _decode_step
from graphmode_conformance.sizes import bucket_with_smaller_batches
from graphmode_conformance.structure import ConformanceFailure, _rows_first, _span, _values, source_value

__all__ = ["UnseenByOutputsTests", "check_pushed_host_values"]


def _indexed_forms(device_type: str) -> list[torch.device] | None:
    """``device_type`` un-indexed, then indexed; None if this torch cannot
    name the type (npu, mlu without their runtime)."""
    try:
        return [torch.device(device_type), torch.device(device_type, 0), torch.device(f"{device_type}:1")]
    except RuntimeError:
        return None


def _emulated(graph: Any, depth: int = 3) -> EmulatedGraph | None:
    """The emulator's graph a device graph is or wraps: an attribute of it,
    or of an object it holds (a runtime handle), up to ``depth`` objects
    down."""
    if isinstance(graph, EmulatedGraph):
        return graph
    if depth == 0 or isinstance(graph, torch.Tensor):
        return None
    for value in getattr(graph, "__dict__", {}).values():
        found = _emulated(value, depth - 1)
        if found is not None:
            return found
    return None


def _host_lists(graph: EmulatedGraph) -> list[tuple[str, str, list]]:
    """``graph.host_arguments()``, an operator called more than once (a
    kernel per layer) named with the call's number: "op (call 2 of 2)"."""
    return _numbered(graph.host_arguments())


def _pushed_values(graph: EmulatedGraph, meta: Any, bucket: int) -> list[tuple[str, str, list]]:
    """What ``graphmode_update_graph_params`` may have pushed into the graph,
    as (operator, argument, values): the host lists its kernels read, and the
    integer tensors of ``bucket`` values they read from memory of the graph's
    (or its runtime's) own, no declared buffer's: a runtime that keeps a
    launch's host arguments in parameter memory, where an update writes as
    many rows as it is given and the rest keep what an earlier update wrote."""
    declared = {tensor.untyped_storage().data_ptr() for tensor in meta.input_buffers.values()}
    owned = []
    for op, argument, tensor in graph.held_arguments():
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.numel() != bucket:
            continue
        if tensor.untyped_storage().data_ptr() in declared:
            continue  # a declared buffer: the declared-buffer checks hold it to its padding
        owned.append((op, f"{argument} (memory of the graph's own, {str(tensor.dtype).removeprefix('torch.')})",
                      tensor.detach().cpu().reshape(-1).tolist()))
    return _host_lists(graph) + _numbered(owned)


def check_pushed_host_values(harness: Harness, batch: int, state: dict) -> None:
    """After a replay of ``batch`` sequences: every host list of the bucket's
    graph whose live rows are a declared per-sequence buffer's live rows holds
    that buffer's rows in its padding rows too (the declared padding, which
    the declared-buffer checks hold the buffer to). ``state`` keeps the last
    values seen, to name stale rows."""
    runner = harness.runner
    bucket = runner.bucket_of(batch)
    captured = runner.graph(bucket) if bucket is not None else None
    if bucket is None or captured is None:
        return
    graph = _emulated(captured.graph)
    if graph is None:
        raise ConformanceFailure(
            f"[pushed host values] vendor {harness.vendor.name} on {harness.device}{harness.variant}, bucket {bucket}: "
            f"the graph graphmode_make_graph returned, a {type(captured.graph).__qualname__}, neither is an "
            "EmulatedGraph nor holds one (as an attribute, or an attribute of an object it holds, up to three "
            "objects down), so the suite cannot read the host values graphmode_update_graph_params pushes into it. "
            "Hook: graphmode_make_graph on cpu must return your emulated runtime graph (an EmulatedGraph subclass), "
            "or a DeviceGraph wrapper keeping it as an attribute (self.graph), not in a list or dict"
        )
    meta = runner.graph_meta()
    # Host buffers first: a host list is pushed from a host buffer (a device
    # one would cost a host sync per step), so a host buffer holding the
    # same rows as a device one is the one the vendor pushed.
    declared = sorted(meta.spec.buffers, key=lambda spec: not spec.host)
    rows = {
        spec.name: (meta.input_buffers[spec.name].detach().cpu()[:bucket].tolist(), spec.padding)
        for spec in declared
        if not spec.per_token and meta.input_buffers[spec.name].dim() == 1
    }
    host = {spec.name for spec in declared if spec.host}
    for op, argument, values in _pushed_values(graph, meta, bucket):
        if len(values) == batch < bucket:
            short_list(harness, batch, bucket, op, argument, values, rows, host)
        if len(values) != bucket:
            continue
        if batch == bucket:
            state[(op, argument)] = (batch, values)
            continue
        matching = {name: (held, padding) for name, (held, padding) in rows.items() if held[:batch] == values[:batch]}
        if not matching or any(held[batch:] == values[batch:] for held, _ in matching.values()):
            state[(op, argument)] = (batch, values)
            continue
        name, (held, padding) = next(iter(matching.items()))
        previous = state.get((op, argument))
        fix = (f"push every row up to the bucket from its host buffer (meta.input_buffers[{name!r}][:bucket], "
               "host memory: no device sync)" if name in host else
               f"push every row up to the bucket from a host buffer holding {name}'s values (declare one: "
               f"BufferSpec(host=True) with a host source such as attn_metadata.kv_seqlens_cpu), never from the "
               f"device buffer {name} (.tolist() of device memory waits for the device at every step)")
        stale = ""
        if previous is not None and previous[1][batch:] == values[batch:]:
            stale = (f" They are what was pushed for the previous step (batch {previous[0]}): padding rows left "
                     "stale, pushed for the live rows only.")
        raise ConformanceFailure(
            f"[pushed host values] vendor {harness.vendor.name} on {harness.device}{harness.variant}, batch {batch}, "
            f"bucket {bucket} (replay): after graphmode_update_graph_params the graph's {op} reads {argument} "
            f"{values}: rows 0..{batch - 1} are this step's {name}, but padding rows {batch}..{bucket - 1} hold "
            f"{values[batch:]}, not what buffer {name} holds there ({held[batch:]}, its declared padding "
            f"{padding!r}).{stale} A device kernel reads every row of the bucket: one that trusts these values "
            f"reads that many tokens for each padding row, past the reserved block (an out-of-range read), "
            f"although the emulator's outputs are right. Hook: graphmode_update_graph_params must {fix}"
        )


def short_list(harness: Harness, batch: int, bucket: int, op: Any, argument: str, values: list,
               rows: dict[str, tuple[list, Any]], host: set[str]) -> None:
    """Fails when a host list of ``batch`` values, a declared host buffer's
    live rows, was pushed into a graph captured with ``bucket`` rows."""
    name = next((name for name, (held, _) in rows.items() if name in host and held[:batch] == values), None)
    if name is None:
        return
    raise ConformanceFailure(
        f"[pushed host values] vendor {harness.vendor.name} on {harness.device}{harness.variant}, batch {batch}, "
        f"bucket {bucket} (replay): after graphmode_update_graph_params the graph's {op} reads {argument} "
        f"{values}: {batch} values, this step's live rows of {name}, but the graph was captured with {bucket} rows "
        f"and its kernel takes one value per row. A device kernel reads rows {batch}..{bucket - 1} past the end of "
        f"the list (an out-of-range host read), although the emulator's outputs may be right. Hook: "
        f"graphmode_update_graph_params must push every row up to the bucket, padding rows included, from its host "
        f"buffer (meta.input_buffers[{name!r}][:bucket], not [:batch_size])"
    )


def pushed_values_cause(harness: Harness, captured: Any, batch: int, bucket: int,
                        before: dict[str, torch.Tensor]) -> str | None:
    """Why a replay's outputs are wrong when, on the emulator, a host list the
    step's graph (``captured``: ``Harness.graph_of``) reads (what
    graphmode_update_graph_params pushed) holds in its live rows no host
    buffer's live rows of this step; None otherwise. ``before``: the buffers
    before this step's fill (the previous step's)."""
    if not harness.vendor.implements("graphmode_update_graph_params"):
        return None
    graph = _emulated(captured.graph) if captured is not None else None
    meta = harness.runner.graph_meta()
    host = [spec.name for spec in meta.spec.buffers
            if spec.host and not spec.per_token and meta.input_buffers[spec.name].dim() == 1]
    if graph is None or not host:
        return None
    now = {name: meta.input_buffers[name][:bucket].tolist() for name in host}
    for op, argument, values in _host_lists(graph):
        if len(values) != bucket or any(rows[:batch] == values[:batch] for rows in now.values()):
            continue
        held = ", ".join(f"{name} {rows[:batch]}" for name, rows in now.items())
        earlier = next((name for name in host if name in before and before[name][:batch].tolist() == values[:batch]), None)
        which = (f"they are what buffer {earlier} held before this step's fill: the previous step's values"
                 if earlier is not None else "they match no host buffer: values from an earlier step, or from "
                 "another runner's buffers (a slice or list kept at module level, or keyed by bucket alone)")
        return (f"at this replay the graph's {op} reads {argument} {values}, whose live rows 0..{batch - 1} are not "
                f"this step's ({held}); {which}. Hook: graphmode_update_graph_params must push this step's rows "
                "of its host buffer (meta.input_buffers[name][:bucket]) into the graph it is given, at every replay")
    return None


def missing_update_cause(harness: Harness) -> str | None:
    """Why a replay failed or read stale lengths, when the vendor declares
    kernels that take kv lengths as host values (the ``host_kv_lengths``
    capability) and implements no ``graphmode_update_graph_params``: a graph
    freezes host values at capture, so every replay runs with the capture's
    lengths (a runtime that checks its launches refuses them instead). The
    [parameter updates] check says so too, but a run stopped at its first
    failure (``-x``) may never reach it. None otherwise."""
    vendor = harness.vendor
    if "host_kv_lengths" not in vendor.info.capabilities or vendor.implements("graphmode_update_graph_params"):
        return None
    return (f"vendor {vendor.name} declares host_kv_lengths (its kernels take kv lengths as host values, which a "
            "graph freezes at capture) but implements no graphmode_update_graph_params, so every replay runs with "
            "the lengths its graph was captured with. Hook: graphmode_update_graph_params must push the step's "
            "host lengths, meta.input_buffers[name][:bucket] of the host buffer (padding rows included), into the "
            "captured graph before each replay")


def pushed_length_cause(harness: Harness, captured: Any, bucket: int) -> str | None:
    """Why a replay of the step's graph (``captured``, of ``bucket``) raised, when a host list its
    kernels read (what graphmode_update_graph_params pushed) has other than
    ``bucket`` values: a list sized for another bucket (the whole buffer,
    ``[:max_batches]``) fails inside the kernel with a shape error that
    names no hook. None otherwise."""
    if not harness.vendor.implements("graphmode_update_graph_params"):
        return None
    graph = _emulated(captured.graph) if captured is not None else None
    if graph is None:
        return None
    for op, argument, values in _host_lists(graph):
        if len(values) != bucket:
            meta = harness.runner.graph_meta()
            whole = f" (every row of a buffer: max_batches is {meta.max_batchs})" if len(values) == meta.max_batchs \
                else ""
            return (f"at this replay the graph's {op} reads {argument}, a host list of {len(values)} values"
                    f"{whole}, but the graph was captured with {bucket} rows and its kernel takes one value per "
                    f"row. Hook: graphmode_update_graph_params must push the bucket's rows of its host buffer, "
                    f"meta.input_buffers[name][:bucket] (padding rows included), not more nor fewer")
    return None


def length_bound_cause(harness: Harness, captured: Any, batch: int) -> str | None:
    """Why a replay's outputs are wrong when, on the emulator, a host integer
    a kernel of the step's graph (``captured``) reads as a length bound (an argument
    whose name holds "len": ``max_seqlen_k``) is below this step's longest
    kv length: a bound frozen at capture, or pushed stale or short by
    graphmode_update_graph_params. A kernel trusting it reads that many
    tokens only. None otherwise."""
    graph = _emulated(captured.graph) if captured is not None else None
    meta = harness.runner.graph_meta()
    if graph is None or "kv_seqlens" not in meta.input_buffers:
        return None
    longest = int(meta.input_buffers["kv_seqlens"][:batch].max())
    calls = _numbered(graph.host_scalars())
    short = [(op, argument, value) for op, argument, value in calls if "len" in argument.lower() and 0 < value < longest]
    if not short:
        return None
    op, argument, value = short[0]
    pushes = harness.vendor.implements("graphmode_update_graph_params")
    how = ("graphmode_update_graph_params pushed it stale or short (from an earlier step, a value kept at capture, "
           "an off-by-one), or pushed it into some calls only" if pushes else
           "it was frozen at capture (no graphmode_update_graph_params pushes it)")
    others = f" ({len(short) - 1} more such calls)" if len(short) > 1 else ""
    return (f"at this replay the graph's {op} reads the host length bound {argument}={value}{others}, below this "
            f"step's longest kv length {longest} (kv_seqlens rows 0..{batch - 1}): a kernel trusting it reads "
            f"{value} tokens at most; {how}. A graph freezes host integers: push a bound of this step's lengths "
            "(the max of a host buffer's rows, meta.input_buffers[name][:bucket], kv_seqlens_cpu's copy) into every "
            "call at every replay in graphmode_update_graph_params, or declare GraphSpec max_kv_policy='capacity' "
            "(a bound valid at every replay) and push none")


def _numbered(found: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """``found`` with an operator called more than once named with the
    call's number: "op (call 2 of 2)"."""
    calls = {(op, argument): sum(1 for o, a, _ in found if (o, a) == (op, argument)) for op, argument, _ in found}
    seen: dict[tuple[str, str], int] = {}
    named = []
    for op, argument, value in found:
        seen[(op, argument)] = seen.get((op, argument), 0) + 1
        total = calls[(op, argument)]
        named.append((op if total == 1 else f"{op} (call {seen[(op, argument)]} of {total})", argument, value))
    return named


# Added to a step's lengths, positions and token ids: a 128k context and a
# vocabulary of over 131072 words, past int16 and float16.
LARGE = 2**17
# Where an integer loses digits: the dtypes a fill may pass it through.
_NARROWER = (torch.int16, torch.float16, torch.bfloat16, torch.float32)


def large_step(step: StepInputs, block_size: int) -> StepInputs:
    """``step`` with the integers of a large deployment, all inside int32:
    block ids above 2**31 / (2 * block_size) (2**26 at 16 tokens a block; a
    card of a few hundred thousand blocks reaches float32's 2**24), so that
    slots are above 2**30; kv lengths, positions and token ids above 2**17.
    Padding values (-1 slots, block 0) are kept. The fill copies, so
    nothing else need be consistent with a cache."""
    attn = step.attn_metadata
    blocks = 2**31 // (2 * block_size) + 1

    def shifted(tensor: torch.Tensor, by: int, keep: int | None = None) -> torch.Tensor:
        moved = tensor + by if keep is None else torch.where(tensor > keep, tensor + by, tensor)
        return mark_host(moved) if is_host(tensor) else moved

    host_lengths = attn.kv_seqlens_cpu
    large = attn.replace(
        block_offsets=shifted(attn.block_offsets, blocks, keep=0),
        kv_start_indices=shifted(attn.kv_start_indices, blocks * block_size, keep=-1),
        kv_seqlens=shifted(attn.kv_seqlens, LARGE),
        kv_seqlens_cpu=shifted(host_lengths, LARGE) if host_lengths is not None else None,
        max_kv_seq_len=attn.max_kv_seq_len + LARGE,
    )
    return StepInputs(shifted(step.input_ids, LARGE), shifted(step.position_ids, LARGE), step.past_key_values,
                      large, step.extras)


def _narrowed_through(value: torch.Tensor, got: torch.Tensor) -> torch.dtype | None:
    """The dtype that, converted to and back, turns ``value`` into ``got``."""
    return next((d for d in _NARROWER if torch.equal(value.to(d).to(torch.int64), got)), None)


# Capture errors no vendor's runtime signature matches, and where they come from.
_FOREIGN_CAPTURE_ERRORS = {
    RuntimeError("CUDA error: operation not permitted when stream is capturing"):
        "PyTorch's: a host synchronisation inside the captured forward",
    RuntimeError("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture"):
        "PyTorch's: a random op seeded on the host during capture",
    KeyError("kv_seqlens"): "the model's own",
}


class UnseenByOutputsTests(ConformanceFixtures):
    def test_distributed_backend_ignores_the_device_index(self, vendor, device):
        """``graphmode_dist_backend`` for ``cuda:0`` (each rank's own device)
        is the answer for ``cuda``, for every device type the vendor drives."""
        types = dict.fromkeys((*vendor.info.device_types, device.type, "cpu"))
        checked = []
        for device_type in types:
            forms = _indexed_forms(device_type)
            if forms is None:
                continue
            answers = {str(d): vendor.hook.graphmode_dist_backend(device=d) for d in forms}
            if len(set(answers.values())) > 1:
                raise ConformanceFailure(
                    f"[distributed backend] vendor {vendor.name}: graphmode_dist_backend answers "
                    f"{', '.join(f'{d} -> {b!r}' for d, b in answers.items())}. An indexed device is the same device "
                    "type: every rank of a process group passes its own (torch.device('cuda', rank)), so it got "
                    f"{answers[str(forms[1])]!r} where {answers[str(forms[0])]!r} was meant. Hook: graphmode_dist_backend "
                    "must answer from device.type, not from the device's string form"
                )
            checked.append(device_type)
        # The emulator's process groups (tensor parallel on the CPU) are made
        # on cpu, a type no vendor drives: the vendor answers None there and
        # the default's gloo comes through.
        if "cpu" not in vendor.info.device_types:
            on_cpu = vendor.hook.graphmode_dist_backend(device=torch.device("cpu"))
            if on_cpu != "gloo":
                raise ConformanceFailure(
                    f"[distributed backend] vendor {vendor.name}: graphmode_dist_backend answers {on_cpu!r} for cpu, "
                    f"a device type the vendor does not drive (its device_types {vendor.info.device_types}). "
                    "Tensor-parallel runs on the CPU emulator (torchrun -m graphmode_conformance.tensor_parallel "
                    f"--device cpu) make their process groups on cpu, where only gloo works: init_process_group("
                    f"{on_cpu!r}) fails there. Hook: graphmode_dist_backend must answer from device.type and "
                    "return None for device types it does not drive, so that the default answers (gloo on cpu)"
                )
        if not checked:
            pytest.skip(f"torch here names none of the vendor's device types {vendor.info.device_types}")

    def test_capture_advice_leaves_errors_it_does_not_know_alone(self, vendor, harness):
        """``graphmode_capture_error`` turns only its runtime's own signatures
        into advice: errors every runtime raises (PyTorch's capture errors, a
        model's KeyError) come back as None, for full and piecewise graphs."""
        meta = harness.runner.graph_meta()
        pieces = dataclasses.replace(meta, family="piecewise", capture_sizes=(2, 8, 24, 64))
        for error in _FOREIGN_CAPTURE_ERRORS:
            for graph_meta, what in ((meta, "a decode graph of bucket 4"), (pieces, "a piecewise graph of token bucket 8")):
                advice = vendor.hook.graphmode_capture_error(error=error, meta=graph_meta, bucket=4 if graph_meta.family == "full" else 8)
                if advice is not None:
                    raise ConformanceFailure(
                        f"[capture advice] vendor {vendor.name}: graphmode_capture_error turned {error!r}, raised "
                        f"capturing {what}, into {type(advice).__name__}: {str(advice)[:300]!r}. That error is not "
                        f"{vendor.name}'s runtime's ({_FOREIGN_CAPTURE_ERRORS[error]}): advice for it sends the engine "
                        "after the wrong setting. Hook: graphmode_capture_error must match its runtime's signature "
                        "exactly (an error code with its text, not a word such as \"stream\" alone) and return None "
                        "for anything else, which keeps the error's type and the note naming the graph"
                    )

    def test_pushed_host_values_hold_padding_in_padding_rows(self, updates_graph_params, harness):
        """A large batch, then smaller ones in the same bucket: after each
        replay, every host list the graph's kernels read holds, in its padding
        rows, the declared buffer's padding, not the larger batch's values."""
        if not updates_graph_params:
            pytest.skip("the vendor pushes no host values into graphs")
        if harness.device.type != "cpu":
            pytest.skip("what a graph's kernels read is inspected on the emulator's records")
        runner = harness.runner
        bucket, smaller = bucket_with_smaller_batches(runner.capture_sizes, 3)
        if not smaller:
            pytest.skip(f"no bucket of the capture list {runner.capture_sizes} holds a smaller batch: no padding rows")
        longest = harness.sizes.table_width * harness.sizes.block // 2
        gap = max(1, min(3, (longest - 2) // bucket))
        lengths = [longest - gap * i for i in range(bucket)]  # long, distinct: not the padding, not row numbers
        seqs = harness.start(bucket, lengths)
        state: dict = {}
        for batch in (bucket, bucket, *smaller, bucket, smaller[-1]):
            harness.step(seqs[:batch])
            check_pushed_host_values(harness, batch, state)

    def test_fill_copies_large_integers_exactly(self, harness):
        """A decode step whose block ids, slots, kv lengths, positions and
        token ids are as large as a big deployment's (the harness's caches
        hold a few hundred blocks): after graphmode_fill_buffers every
        integer buffer's live rows hold the step's values exactly."""
        runner, vendor = harness.runner, harness.vendor
        batch = min(5, runner.capture_sizes[-1])
        bucket = runner.bucket_of(batch)
        meta = runner.graph_meta()
        step = large_step(_decode_step(harness, batch), meta.block_size)
        with torch.inference_mode():
            vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        own_fill = vendor.implements("graphmode_fill_buffers")
        for spec in meta.spec.buffers:
            value = source_value(spec, step)
            if spec.live is not None or not isinstance(value, torch.Tensor) or not (spec.written or own_fill):
                continue
            if spec.dtype.is_floating_point or spec.dtype == torch.bool or value.dtype == torch.bool:
                continue
            live = step.num_tokens if spec.per_token else batch
            got = _rows_first(meta.input_buffers[spec.name].detach().cpu(), spec)[:live].to(torch.int64)
            value = _rows_first(value.detach().cpu().to(torch.int64), spec)
            if BLOCKS in spec.shape:
                blocks = spec.shape.index(BLOCKS)
                dim = blocks + 1 if blocks < spec.row_dim else blocks
                got = got.narrow(dim, 0, value.shape[dim])
            if value.numel() != got.numel():
                continue
            value = value.reshape(got.shape)
            if torch.equal(got, value):
                continue
            wrong = [r for r in range(live) if not torch.equal(got[r], value[r])]
            origin = "its source function" if callable(spec.source) else " or ".join(spec.sources)
            through = _narrowed_through(value, got)
            if through == spec.dtype:
                how = (f"buffer {spec.name} is declared {spec.dtype}, which cannot hold them. Declare it int32 (or "
                       "int64) in graphmode_graph_spec")
            else:
                how = ((f"they are the step's values converted to {through} and back" if through is not None else
                        "they are not the step's values") +
                       ": an integer lost digits on its way into the buffer (int16 wraps above 32767; float32 is "
                       "exact only below 2**24, float16 below 2**11: torch.where with a float scalar, .float(), a "
                       "narrower staging tensor). Hook: graphmode_fill_buffers must copy integer step tensors into "
                       "the integer buffers with no narrower or floating dtype between")
            raise ConformanceFailure(
                f"[large values] vendor {vendor.name}{harness.variant}, graphmode_fill_buffers of a decode step of "
                f"{batch} sequences in bucket {bucket} with a large deployment's integers (block ids above "
                f"{2**31 // (2 * meta.block_size)}, slots above 2**30, kv lengths, positions and token ids above "
                f"{LARGE}; the harness's own caches stay far below): buffer {spec.name} live rows {_span(wrong)} "
                f"hold {_values(got[wrong])}, but this step's {origin} is {_values(value[wrong])}: {how}"
            )

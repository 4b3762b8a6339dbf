"""Graph memory once every batch size has been served, against the plan.

``runner.plan_memory()`` says what ``warmup()`` takes, and an engine sizes
its KV cache from it. Memory a replay step keeps (a copy of the outputs per
token count, a buffer per batch size made on first use, a slice cached per
shape) is in no plan: it grows at the first step of each new size, after the
KV cache took what the plan left, so the engine runs out of memory once
enough sizes have been served, hours into a deployment. Here every batch
size up to the maximum is served, twice, after the warm-up, and the memory
in use afterwards must be what it was before the first of them.
"""

from __future__ import annotations

import dataclasses
import gc

import torch
from torch._subclasses.fake_tensor import is_fake

from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure
from graphmode_conformance.sizes import MIN_MAX_BATCHES

__all__ = ["ServedMemoryTests"]

KiB = 2**10
MiB = 2**20
PROBE_BLOCKS = 4  # the probe cache plan_memory() is given, as docs/engines.md shows


def _live_storages(device: torch.device) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Every storage on ``device`` a live tensor object holds, by address:
    (bytes, the shape of a tensor holding it). After a garbage collection, so
    that what only a reference cycle holds does not count. Exact on every
    device (a kept tensor of a few KiB shows, where the driver's free memory
    moves by allocator segments of 2 MiB and more); the graphs' own pools
    hold no tensor objects and are not seen, nor need to be: a replay
    allocates nothing in them."""
    gc.collect()
    found: dict[int, tuple[int, tuple[int, ...]]] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks some objects' __class__ (deprecated module proxies warn)
        if not issubclass(type(obj), torch.Tensor) or obj.device != device or obj.layout != torch.strided:
            continue
        if is_fake(obj):  # torch.compile's stand-ins (left by an earlier compile in the process) own no memory
            continue
        try:
            storage = obj.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no memory of its own: a fake or functional tensor (compile)
            continue
        if storage.nbytes():
            found.setdefault(address, (storage.nbytes(), tuple(obj.shape)))
    return found


class ServedMemoryTests(ConformanceFixtures):
    def test_graph_memory_stays_at_the_plan_once_every_batch_size_is_served(self, build_harness, sizes):
        """After ``plan_memory()`` and ``warmup()``, every batch size from 1 to
        the maximum served twice (one-token decode steps): the memory in use
        afterwards is what it was after the warm-up, the plan's."""
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=None)
        harness = build_harness(sizes=small, capture_batch_sizes=[1, 4, MIN_MAX_BATCHES])
        runner, model, block = harness.runner, harness.model, harness.sizes.block
        plan = runner.plan_memory(model.make_kv_cache(PROBE_BLOCKS, block))
        runner.warmup(harness.graph_cache, progress=False)
        seqs = harness.start(MIN_MAX_BATCHES, [3 + i for i in range(MIN_MAX_BATCHES)])
        engine, cache = harness.engine, harness.graph_cache
        device = harness.device
        kept: list[dict[int, tuple[int, tuple[int, ...]]]] = []
        with torch.inference_mode():
            before = _live_storages(device)
            for _ in range(2):
                for batch in range(1, MIN_MAX_BATCHES + 1):
                    step = engine.decode(seqs[:batch])
                    runner(step.input_ids, step.position_ids, cache, step.attn_metadata)  # dropped at once
                del step  # the engine's tensors of the last step: the engine's, not the runner's
                now = _live_storages(device)
                kept.append({key: held for key, held in now.items() if key not in before})
        first, second = kept
        if not first:
            return
        where = f"vendor {harness.vendor.name} on {device}{harness.variant}"
        total = sum(nbytes for nbytes, _ in first.values())
        shapes = sorted({shape for _, shape in first.values()})
        shown = ", ".join(str(shape) for shape in shapes[:6]) + (" ..." if len(shapes) > 6 else "")
        again = sum(nbytes for nbytes, _ in second.values()) - total
        pattern = (f"{len(first)} tensors kept (shapes {shown}), "
                   + ("none more after serving every size again: memory kept per size" if again <= 0 else
                      f"and {again / KiB:.1f} KiB more after serving every size again: memory kept per step"))
        outputs = [shape for shape in shapes if len(shape) >= 2 and shape[-1] == model.config.vocab_size]
        likely = (
            f"{len(outputs)} of them are logits ({', '.join(map(str, outputs[:4]))}, one per token count): copies "
            "of the outputs kept per token count. Hook: graphmode_get_outputs must return views of "
            "meta.output_buffers cut to num_tokens (the runner's output buffers, in the plan), never keep a copy "
            "per size; an engine that needs a copy makes it"
            if outputs and harness.vendor.implements("graphmode_get_outputs") else
            "a replay-path hook keeps memory per size (graphmode_fill_buffers, graphmode_update_graph_params, "
            "graphmode_get_outputs: a tensor made on first use and cached per batch size or token count, in "
            "meta.vendor_state, a module-level dict or an lru_cache). Allocate everything a replay step needs in "
            "graphmode_make_buffers (declared buffers, in the plan) or inside the captured graphs"
        )
        warm = runner.graph_memory.bytes if runner.graph_memory is not None else plan.bytes
        raise ConformanceFailure(
            f"[served memory] {where}: plan_memory() planned {plan.bytes / MiB:.2f} MiB and warmup() took "
            f"{warm / MiB:.2f} MiB, but once every batch size 1..{MIN_MAX_BATCHES} had been served (one-token "
            f"decode steps, every output dropped) {total / KiB:.1f} KiB more of {device} memory were held than "
            f"after the warm-up, outside the plan: {pattern}. An engine sizes its KV cache from the plan, so it "
            f"runs out of memory once enough sizes have been served. Likely cause: {likely}"
        )

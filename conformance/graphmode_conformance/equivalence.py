"""Graph equals eager on the reference model, step after step, in every
situation that matters: every batch size, growing and shrinking kv lengths,
stale padding, reused blocks, buckets in random order. Every step also checks
the KV cache (see the harness)."""

from __future__ import annotations

import pytest

from graphmode.staging import staging_refusal
from graphmode_conformance.fixtures import ConformanceFixtures

__all__ = ["USER_CAPTURE_SIZES", "GraphEqualsEagerTests"]

# A user's capture list, not of powers of two (cut at max_batches, which ends it).
USER_CAPTURE_SIZES = (1, 2, 3, 5, 7, 9, 11, 14, 18, 22, 30, 40)


class GraphEqualsEagerTests(ConformanceFixtures):
    def test_every_batch_size(self, harness):
        for batch in range(1, harness.sizes.max_batches + 1):
            seqs = harness.start(batch)
            for _ in range(harness.sizes.steps):
                harness.step(seqs)
            harness.finish(seqs)

    def test_kv_lengths_grow_across_blocks(self, harness):
        seqs = harness.start(5, [1, 2, 14, 15, 16])
        steps = 3 * harness.sizes.block + 2
        assert harness.room(seqs, steps)
        for _ in range(steps):
            harness.step(seqs)

    def test_kv_lengths_shrink_when_new_sequences_replace_long_ones(self, harness):
        longest = harness.sizes.table_width * harness.sizes.block
        old = harness.start(6, [longest - 8] * 6)
        for _ in range(3):
            harness.step(old)
        harness.finish(old)
        new = harness.start(6, [1, 3, 2, 5, 1, 4])
        for _ in range(3):
            harness.step(new)

    def test_large_then_small_batch_in_one_bucket(self, harness):
        seqs = harness.start(8)
        bucket = harness.runner.bucket_of(8)
        smaller = [b for b in range(1, 8) if harness.runner.bucket_of(b) == bucket]
        harness.step(seqs)
        for batch in reversed(smaller):
            harness.step(seqs[:batch])
        harness.step(seqs)

    def test_large_then_small_batch_across_buckets(self, harness):
        top = min(16, harness.sizes.max_batches)
        seqs = harness.start(top)
        for batch in (top, 3, top, 9, 1, 12):
            harness.step(seqs[:batch])

    def test_block_tables_of_varying_width(self, harness):
        """Each step's block table is as wide as its longest sequence needs
        (as engines pass them): wide, narrow and wide again in one bucket.
        The columns right of a narrower table must be padding again."""
        block, width = harness.sizes.block, harness.sizes.table_width
        lengths = [1, 2, block + 1, (width - 2) * block, 3, (width // 2) * block + 2]
        seqs = harness.start(len(lengths), lengths)
        narrow = [s for s, n in zip(seqs, lengths) if n <= block]
        seen = set()
        for batch in (seqs, narrow, seqs[:3], seqs[3:], narrow, seqs):
            harness.step(batch)
            seen.add(max(len(harness.engine.sequences[s].blocks) for s in batch))
        assert len(seen) >= 3, f"block-table widths {sorted(seen)}: the steps should vary them"

    def test_a_user_capture_list_that_is_not_powers_of_two(self, build_harness, sizes):
        """A user's capture list the vendor keeps or trims (vendors may drop
        sizes): every kept bucket shrinks inside itself and is reused after a
        larger one; batches of dropped sizes run in the next kept bucket, or
        eagerly above the last (a vendor's largest graph)."""
        top = sizes.max_batches
        given = tuple(s for s in USER_CAPTURE_SIZES if s < top) + (top,)
        harness = build_harness(capture_batch_sizes=given)
        kept = harness.runner.capture_sizes
        assert set(kept) <= set(given), f"the vendor's list {kept} adds sizes to the user's {given}"
        seqs = harness.start(given[-1], [harness.engine.rng.randrange(1, 20) for _ in range(given[-1])])
        for bucket in reversed(kept):
            small = min(b for b in range(1, bucket + 1) if harness.runner.bucket_of(b) == bucket)
            harness.step(seqs[:bucket])
            harness.step(seqs[:small])
            harness.step(seqs[: kept[-1]])
            harness.step(seqs[:small])
        for dropped in sorted(set(given) - set(kept)):
            harness.step(seqs[:dropped])

    def test_freed_blocks_are_reused_by_other_sequences(self, harness):
        first = harness.start(4, [40, 33, 20, 17])
        for _ in range(2):
            harness.step(first)
        freed = {b for s in first for b in harness.engine.sequences[s].blocks}
        harness.finish(first)
        second = harness.start(4, [30, 30, 30, 30])
        reused = {b for s in second for b in harness.engine.sequences[s].blocks} & freed
        assert reused, "the engine should hand freed blocks to new sequences"
        for _ in range(3):
            harness.step(second)

    def test_stale_padding_cannot_reach_reused_blocks(self, harness):
        seqs = harness.start(8)
        harness.step(seqs)
        survivors, leaving = seqs[:5], seqs[5:]
        harness.finish(leaving)
        newcomers = harness.start(3, [2, 2, 2])  # they take the blocks just freed
        harness.step(survivors)  # padded in the same bucket: old slots must not write
        harness.step(survivors + newcomers)

    def test_buckets_interleaved_in_random_order(self, harness):
        rng = harness.engine.rng
        live = harness.start(harness.sizes.max_batches // 2)
        for _ in range(24):
            batch = rng.randrange(1, len(live) + 1)
            chosen = rng.sample(live, batch)
            if not harness.room(chosen, 1):
                harness.finish(chosen)
                live = [s for s in live if s not in chosen] + harness.start(batch)
                continue
            harness.step(chosen)

    def test_block_tables_sliced_from_a_wider_table(self, harness):
        """An engine keeping a persistent batch writes each step's tensors in
        place and passes views of them: the block table as its first columns
        (``table[:batch, :width]``), not contiguous. A fill copying it as a
        flat run of elements (a copy by data_ptr and numel) reads other rows'
        columns; one keeping last step's tensor (a reference, not a copy) to
        skip what did not change finds this step's values in it and skips
        everything."""
        harness.sliced_tables = True
        harness.variant += (", block tables sliced from a wider table (not contiguous: a copy of numel() elements "
                            "from the first one reads columns of other rows), every step tensor a view of a persistent "
                            "one written in place (a tensor kept from the last step holds this step's values)")
        seqs = harness.start(8)
        # Then the same sequences in other orders (an engine condensing its
        # batch moves rows): the same shapes, unless a sequence needs a new
        # block, with other values.
        for step in (seqs, seqs[4:] + seqs[:4], seqs[2:] + seqs[:2], seqs[:5], seqs, seqs[:3]):
            harness.step(step)

    def test_steps_built_on_the_host_with_host_staging(self, build_harness, vendor, device):
        """An engine building its steps on the host (as vLLM's pinned
        CpuGpuBuffer does) feeds the graphs through host staging where the
        vendor allows it (graphmode.staging): every write of its fill goes to
        a pinned mirror, copied into the device buffers before the replay, so
        a write made to the device buffers directly is overwritten."""
        refusal = staging_refusal(vendor, device)
        if refusal is not None:
            pytest.skip(f"host staging: {refusal}")
        harness = build_harness(host_staging=True)
        harness.host_inputs = True
        harness.variant += (", host staging (step inputs on the host: every buffer write of graphmode_fill_buffers "
                            "must go through graphmode.buffers.stage, which routes it to the pinned mirror)")
        largest = harness.sizes.max_batches
        seqs = harness.start(largest)
        for batch in (largest, largest - 3, 5, largest, 1, 7, 6):
            harness.step(seqs[:batch])
        assert harness.runner.staging is not None, "host inputs with host_staging=True and no staging"

"""Graph equals eager on the reference model, step after step, in every
situation that matters: every batch size, growing and shrinking kv lengths,
stale padding, reused blocks, buckets in random order. Every step also checks
the KV cache (see the harness)."""

from __future__ import annotations

from graphmode_conformance.fixtures import ConformanceFixtures

__all__ = ["GraphEqualsEagerTests"]


class GraphEqualsEagerTests(ConformanceFixtures):
    def test_every_batch_size(self, harness):
        for batch in range(1, harness.sizes.max_batches + 1):
            seqs = harness.start(batch)
            for _ in range(harness.sizes.steps):
                harness.step(seqs)
            harness.finish(seqs)

    def test_kv_lengths_grow_across_blocks(self, harness):
        seqs = harness.start(5, [1, 2, 14, 15, 16])
        steps = 3 * harness.sizes.block_size + 2
        assert harness.room(seqs, steps)
        for _ in range(steps):
            harness.step(seqs)

    def test_kv_lengths_shrink_when_new_sequences_replace_long_ones(self, harness):
        longest = harness.sizes.table_width * harness.sizes.block_size
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
        seqs = harness.start(16)
        for batch in (16, 3, 16, 9, 1, 12):
            harness.step(seqs[:batch])

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

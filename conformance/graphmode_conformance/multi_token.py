"""Multi-token decode graphs equal eager: decode steps of q_len 1, 2 and 4 new
tokens per sequence (speculative verify, MTP) through graphs keyed by (batch
bucket, q_len), with sequences joining and leaving, every step checked like a
decode step (outputs, and the cache changed only at the live tokens' slots).

A vendor that cannot take them refuses ``max_q_len > 1`` at configuration
time (a ConfigError naming the reason); these checks are then skipped with
that reason."""

from __future__ import annotations

import dataclasses

import pytest

from graphmode.errors import ConfigError
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import Harness
from graphmode_conformance.sizes import MIN_MAX_BATCHES

__all__ = ["MultiTokenDecodeTests"]

Q_LENS = (1, 2, 4)
BATCH_SIZES = [1, 4, 8, 12]  # the harness runs at max_batches 12


class MultiTokenHarness(Harness):
    """The harness with checked decode steps of ``q_len`` tokens per sequence."""

    def decode(self, seqs: list[int], q_len: int) -> None:
        inputs = self.engine.decode(seqs, q_len)
        bucket = self.runner.bucket_of(len(seqs))
        phase = "replay" if bucket is not None and self.runner.graph(bucket, q_len) is not None else "capture"
        replays = self.runner.stats.replays
        # A step a full graph serves: its declared buffers are checked too.
        served = bucket is not None and self.runner.config.execute_mode in ("graph", "full_and_piecewise")
        # Each sequence id repeated for its tokens, so a wrong token names its sequence.
        where = self._compared(
            inputs, phase, [s for s in seqs for _ in range(q_len)],
            lambda step: f"vendor {self.vendor.name} on {self.device}, batch {len(seqs)} x q_len {q_len}, "
                         f"bucket {bucket}, step {step} ({phase})",
            full_graph=(len(seqs), bucket) if served and bucket is not None else None,
        )
        if phase == "replay":
            assert self.runner.stats.replays == replays + 1, (
                f"{where}: the step did not replay its (bucket, q_len) graph; runner: {self.runner.stats.summary()}"
            )


class MultiTokenDecodeTests(ConformanceFixtures):
    @pytest.fixture
    def multi_token_harness(self, vendor, device, sizes) -> MultiTokenHarness:
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=None)
        try:
            harness = MultiTokenHarness.build(
                vendor, device, small, max_q_len=max(Q_LENS), capture_batch_sizes=BATCH_SIZES,
            )
        except ConfigError as refusal:
            pytest.skip(f"vendor {vendor.name} refuses multi-token decode graphs: {refusal}")
        assert isinstance(harness, MultiTokenHarness)  # Harness.build makes the class it is called on
        harness.check = "multi-token decode graph equals eager"
        return harness

    def test_decode_steps_of_q_len_1_2_4_with_batch_churn(self, multi_token_harness):
        harness = multi_token_harness
        seqs = harness.start(8)
        for batch in (8, 3, 1, 4):
            seqs = seqs[:batch] if len(seqs) >= batch else seqs + harness.start(batch - len(seqs))
            for q_len in Q_LENS:
                if not harness.room(seqs, q_len):
                    harness.finish(seqs)
                    seqs = harness.start(batch)
                harness.decode(seqs, q_len)
        harness.decode(seqs, max(Q_LENS))  # a replay of a graph captured earlier
        graphs = harness.runner.captured_graphs
        assert {q_len for _, q_len in graphs} == set(Q_LENS), graphs

    def test_q_len_changes_between_consecutive_replays(self, multi_token_harness):
        """Graphs of several q_len share the buffers: every step must leave
        the per-sequence constants (q_start_loc, q_seqlens) right for its q_len."""
        harness = multi_token_harness
        seqs = harness.start(3)
        for q_len in (2, 4, 2, 1, 4, 1, 2):
            if not harness.room(seqs, q_len):
                harness.finish(seqs)
                seqs = harness.start(3)
            harness.decode(seqs, q_len)

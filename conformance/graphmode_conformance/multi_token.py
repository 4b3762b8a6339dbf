"""Multi-token decode graphs equal eager: decode steps of q_len 1, 2 and 4 new
tokens per sequence (speculative verify, MTP) through graphs keyed by (batch
bucket, q_len), with sequences joining and leaving, every step checked like a
decode step (outputs, and the cache changed only at the live tokens' slots).

A vendor takes as many tokens per sequence as it accepts
(``graphmode_conformance.sizes.accepted_q_len``: ``GraphSpec.max_q_len``, or
its configuration checks): a vendor of ``max_q_len`` 2 runs q_len 1 and 2, one
of 3 runs 1, 2 and 3, so graphs of several query lengths side by side are
checked for every vendor that has them. A vendor that takes one token per
sequence only refuses ``max_q_len > 1`` at configuration time (a ConfigError
naming the reason); these checks are then skipped with that reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphmode.errors import ConfigError
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure, Harness
from graphmode_conformance.sizes import MIN_MAX_BATCHES, accepted_q_len

__all__ = ["MultiTokenDecodeTests"]

Q_LENS = (1, 2, 4)  # the query lengths asked for, where the vendor takes them
BATCH_SIZES = [1, 4, 8, 12]  # the harness runs at max_batches 12


class MultiTokenHarness(Harness):
    """The harness with checked decode steps of ``q_len`` tokens per sequence.
    ``q_lens``: the query lengths its runner graphs (``Q_LENS`` up to the
    vendor's limit, and the limit itself)."""

    q_lens: tuple[int, ...] = Q_LENS

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
        limit, origin = accepted_q_len(vendor, small.resolved(vendor), None)
        q_lens = tuple(sorted({q for q in Q_LENS if q <= limit} | {min(limit, max(Q_LENS))}))
        try:
            if limit <= 1:
                raise ConfigError(f"max_q_len={max(Q_LENS)}: it takes at most {limit} token(s) per sequence "
                                  f"({origin})")
            harness = MultiTokenHarness.build(
                vendor, device, small, max_q_len=max(q_lens), capture_batch_sizes=BATCH_SIZES,
            )
        except ConfigError as refusal:
            pytest.skip(f"vendor {vendor.name} refuses multi-token decode graphs: {refusal}")
        assert isinstance(harness, MultiTokenHarness)  # Harness.build makes the class it is called on
        harness.q_lens = q_lens
        harness.check = "multi-token decode graph equals eager"
        return harness

    def test_decode_steps_of_every_q_len_with_batch_churn(self, multi_token_harness):
        harness = multi_token_harness
        seqs = harness.start(8)
        for batch in (8, 3, 1, 4):
            seqs = seqs[:batch] if len(seqs) >= batch else seqs + harness.start(batch - len(seqs))
            for q_len in harness.q_lens:
                if not harness.room(seqs, q_len):
                    harness.finish(seqs)
                    seqs = harness.start(batch)
                harness.decode(seqs, q_len)
        harness.decode(seqs, max(harness.q_lens))  # a replay of a graph captured earlier
        graphs = harness.runner.captured_graphs
        assert {q_len for _, q_len in graphs} == set(harness.q_lens), graphs

    def test_q_len_changes_between_consecutive_replays(self, multi_token_harness):
        """Graphs of several q_len share the buffers: every step must leave
        the per-sequence constants (q_start_loc, q_seqlens) right for its q_len."""
        harness = multi_token_harness
        top = max(harness.q_lens)  # 4 where the vendor takes it
        seqs = harness.start(3)
        for q_len in (2, top, 2, 1, top, 1, 2):
            if not harness.room(seqs, q_len):
                harness.finish(seqs)
                seqs = harness.start(3)
            harness.decode(seqs, q_len)

    def test_x_active_mask_marks_every_live_token(self, capabilities, multi_token_harness, vendor):
        """MoE dispatch reads one x_active_mask flag per token: in a graph of
        q_len 2, True for each of the batch's 2 x batch tokens, False for the
        rest of the bucket's token rows."""
        if "x_active_mask" not in capabilities:
            pytest.skip("the vendor sets no x_active_mask")
        harness, q_len, batch = multi_token_harness, 2, 3
        seqs = harness.start(batch)
        harness.decode(seqs, q_len)  # the capture
        bucket = harness.runner.bucket_of(batch)
        step = harness.engine.decode(seqs, q_len)
        meta = harness.runner.graph_meta()
        with torch.inference_mode():
            vendor.hook.graphmode_fill_buffers(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
            static = vendor.hook.graphmode_update_context(meta=meta, inputs=step, batch_size=batch, bucket=bucket)
        mask = static.attn_metadata.x_active_mask.tolist()
        expected = [True] * (batch * q_len) + [False] * ((bucket - batch) * q_len)
        if mask != expected:
            raise ConformanceFailure(
                f"[x_active_mask] vendor {vendor.name}: in a graph of q_len {q_len}, batch {batch} in bucket {bucket} "
                f"({batch * q_len} live tokens of {bucket * q_len} token rows), the context's x_active_mask is "
                f"{mask}, expected {expected}. Likely cause: x_active_mask declared or filled per sequence (one "
                "flag per row of the batch); MoE dispatch reads one flag per token: declare it shape (TOKENS,) "
                "in graphmode_graph_spec"
            )

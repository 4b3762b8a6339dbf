"""Piecewise graphs equal eager: prefill, mixed, decode and offloaded steps in
execute modes "piecewise" and "full_and_piecewise", every step checked like a
decode step (outputs, and the cache changed only at the live tokens' slots)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphmode
from graphmode.context import StepInputs
from graphmode.model.offload import OffloadedLlama
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import Harness, Sizes, piecewise_of

__all__ = ["PiecewiseTests"]

# Few buckets keep the suite quick; each step pads into the next one up.
TOKEN_SIZES = [2, 8, 24, 64]
BATCH_SIZES = [1, 4, 8]  # within every Sizes.max_batches of at least 8


class PiecewiseHarness(Harness):
    """The harness with checked steps of any kind, through a piecewise runner."""

    def checked(self, seqs: list[int], inputs: StepInputs) -> None:
        piecewise = piecewise_of(self.runner)
        assert piecewise is not None
        bucket = piecewise.bucket_of(inputs.num_tokens)
        phase = "replay" if bucket in piecewise.captured_buckets else "capture"
        # Repeat each sequence id for its tokens, so a wrong token names its sequence.
        per_token = [s for s, n in zip(seqs, inputs.attn_metadata.q_seqlens.tolist()) for _ in range(n)]
        self._compared(
            inputs, phase, per_token,
            lambda step: f"vendor {self.vendor.name} on {self.device}, {self.runner.config.execute_mode}, "
                         f"{inputs.num_tokens} tokens of {len(seqs)} sequences, token bucket {bucket}, step {step} ({phase})",
        )

    def prefill(self, seqs: list[int], lengths: list[int]) -> None:
        self.checked(seqs, self.engine.prefill(seqs, lengths))

    def decode(self, seqs: list[int]) -> None:
        if self.runner.family("full") is not None and self.runner.bucket_of(len(seqs)) is not None:
            # Mode "full_and_piecewise": a full decode graph serves the step, so it is checked as one (its
            # buffers, and a failure's cause among the full graph's hooks), not as a token bucket's.
            self.step(seqs)
        else:
            self.checked(seqs, self.engine.decode(seqs))


class PiecewiseTests(ConformanceFixtures):
    @pytest.fixture(params=["piecewise", "full_and_piecewise"])
    def piecewise_harness(self, request, build_harness, sizes) -> PiecewiseHarness:
        harness = build_harness(
            PiecewiseHarness, _smaller(sizes), execute_mode=request.param, capture_token_sizes=TOKEN_SIZES,
            capture_batch_sizes=BATCH_SIZES,
        )
        assert isinstance(harness, PiecewiseHarness)  # Harness.build makes the class it is called on
        harness.check = "piecewise graph equals eager"
        return harness

    def test_prefill_of_one_sequence_at_many_lengths(self, piecewise_harness):
        for length in (1, 3, 16, 17, 40, 64):
            seq = piecewise_harness.engine.add()
            piecewise_harness.prefill([seq], [length])

    def test_prefill_of_four_sequences(self, piecewise_harness):
        engine = piecewise_harness.engine
        for lengths in ([1, 2, 3, 4], [9, 1, 15, 7], [16, 16, 16, 16]):
            piecewise_harness.prefill([engine.add() for _ in lengths], lengths)

    def test_mixed_prefill_and_decode_steps(self, piecewise_harness):
        engine = piecewise_harness.engine
        running = [engine.add() for _ in range(5)]
        piecewise_harness.prefill(running, [3, 8, 1, 12, 5])
        for chunk in (9, 30, 4):
            newcomer = engine.add()
            piecewise_harness.checked([*running, newcomer], engine.prefill([*running, newcomer], [1] * 5 + [chunk]))
            piecewise_harness.decode(running)

    def test_decode_with_churn_and_reused_blocks(self, piecewise_harness):
        engine = piecewise_harness.engine
        live = [engine.add() for _ in range(6)]
        piecewise_harness.prefill(live, [20, 5, 33, 2, 9, 14])
        for _ in range(3):
            piecewise_harness.decode(live)
            piecewise_harness.finish(live[:3])
            fresh = [engine.add() for _ in range(3)]
            piecewise_harness.prefill(fresh, [6, 17, 2])
            live = live[3:] + fresh
            piecewise_harness.decode(live[:4])

    def test_warmup_then_every_kind_of_step(self, piecewise_harness):
        piecewise_harness.runner.warmup(piecewise_harness.graph_cache, progress=False)
        captured = piecewise_harness.runner.stats.piecewise_captures
        assert captured == len(TOKEN_SIZES)
        assert all(torch.count_nonzero(t) == 0 for pair in piecewise_harness.graph_cache for t in pair), (
            "warm-up steps must be inert: they wrote into the KV cache"
        )
        engine = piecewise_harness.engine
        seqs = [engine.add() for _ in range(3)]
        piecewise_harness.prefill(seqs, [7, 2, 11])
        piecewise_harness.decode(seqs)
        piecewise_harness.checked(seqs, engine.prefill(seqs, [1, 4, 1]))
        assert piecewise_harness.runner.stats.piecewise_captures == captured  # nothing captured after warm-up

    def test_offloaded_layers_with_host_loads_between_graphs(self, vendor, device, sizes, build_harness, vendor_options):
        """Seed 004's pattern: the layers run from a ring of weight buffers
        loaded by ``host_break`` between the layer graphs at every replay."""
        harness = build_harness(PiecewiseHarness, _smaller(sizes), execute_mode="piecewise",
                                capture_token_sizes=TOKEN_SIZES)
        sizes = harness.sizes
        assert isinstance(harness, PiecewiseHarness)
        offloaded = OffloadedLlama(harness.model, num_buffers=1)
        harness.runner = graphmode.GraphRunner(
            offloaded,
            graphmode.RunnerConfig(
                sizes.max_batches, sizes.table_width, sizes.block, device, execute_mode="piecewise",
                capture_token_sizes=tuple(TOKEN_SIZES),
                vendor_options=dict(vendor_options) if vendor_options else None,
            ),
            vendor,
        )
        harness.check = "offloaded piecewise graph equals eager"
        engine = harness.engine
        seqs = [engine.add() for _ in range(4)]
        harness.prefill(seqs, [5, 12, 1, 8])
        for _ in range(4):
            harness.decode(seqs)
        assert harness.runner.stats.piecewise_replays >= 3


def _smaller(sizes: Sizes) -> Sizes:
    """At most 12 sequences: the piecewise steps check the whole cache after
    every step, and batch sizes are not what these tests vary (nor capture
    lists: the tests give their own)."""
    return dataclasses.replace(sizes, max_batches=min(sizes.max_batches, 12), capture_sizes=None)

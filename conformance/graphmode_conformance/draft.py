"""A draft model's graph steps equal eager, in the target runner's memory pool.

Speculative decoding runs a small draft model for k proposal steps per
engine step, then the target's verify step. The draft model gets a runner of
its own (its own model and KV cache) built with ``share_pool_with=`` the
target's runner, so that its graphs capture into the target's pool and the
two reuse each other's intermediate memory. Its first step after a verify
feeds each sequence the tokens the draft cache lacks (one or two for a draft
model that keeps its drafts' keys; ``accepted + 1``, up to ``k + 1``, for a
drafter that re-reads them): the shorter ones are padded to the step's
longest by padding tokens that write nothing (slot -1, counted in
``kv_seqlens``), so the step replays the graph of (bucket, q_len); then steps
of one token per sequence. Checked, with the target's graph steps between:

- the draft model's outputs at the live tokens equal eager, and its cache
  changed at the live tokens' slots only (a padding token writes nothing);
- the target's steps still equal eager (on a device, a graph reading memory
  the other runner's replay overwrote shows here);
- every graph of both runners was captured into one pool.

A vendor taking fewer than ``k + 1`` tokens per sequence
(``graphmode_conformance.sizes.accepted_q_len``) runs the padded steps up to
its limit; one that refuses ``max_q_len > 1`` runs the one-token draft steps
only, and the padded steps are skipped with its reason."""

from __future__ import annotations

import dataclasses

import pytest

from graphmode.context import StepInputs
from graphmode.errors import ConfigError
from graphmode.model import ModelConfig
from graphmode.model.engine import ReferenceEngine
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import Harness
from graphmode_conformance.pool import check_one_pool
from graphmode_conformance.sizes import MIN_MAX_BATCHES, accepted_q_len

__all__ = ["DraftModelTests", "padded_decode"]

K = 3  # drafts per step: a first step of up to K + 1 tokens per sequence
BATCH_SIZES = [1, 4, 8, 12]  # at max_batches 12


def padded_decode(engine: ReferenceEngine, seqs: list[int], live: list[int], q_len: int) -> StepInputs:
    """A decode step of ``q_len`` tokens per sequence of which sequence i's
    first ``live[i]`` are real and the rest padding: slot -1 (no write),
    positions and ``kv_seqlens`` counting them, the sequence's length back
    to its live tokens after the step (``engine.step_slots``: the live slots)."""
    step = engine.decode(seqs, q_len)
    engine.step_slots = [engine.step_slots[row * q_len + i] for row, count in enumerate(live) for i in range(count)]
    slots = step.attn_metadata.kv_start_indices.clone()
    for row, (seq, count) in enumerate(zip(seqs, live)):
        slots[row * q_len + count : (row + 1) * q_len] = -1
        engine.sequences[seq].kv_len -= q_len - count
    return dataclasses.replace(step, attn_metadata=step.attn_metadata.replace(kv_start_indices=slots))


class DraftHarness(Harness):
    """The draft model's harness: padded first steps, checked at the live tokens."""

    def padded_step(self, seqs: list[int], live: list[int], q_len: int) -> None:
        inputs = padded_decode(self.engine, seqs, live, q_len)
        bucket = self.runner.bucket_of(len(seqs))
        phase = "replay" if bucket is not None and self.runner.graph(bucket, q_len) is not None else "capture"
        replays = self.runner.stats.replays
        owners = self._block_owners()
        before = [tuple(t.clone() for t in pair) for pair in self.graph_cache]
        raw, graph, eager = self._graph_and_eager(inputs)
        rows = [row * q_len + i for row, count in enumerate(live) for i in range(count)]
        self.steps_run += 1
        where = (f"[{self.check}] vendor {self.vendor.name} on {self.device}{self.variant}, draft step of batch "
                 f"{len(seqs)} x q_len {q_len} (live tokens {live}), bucket {bucket}, step {self.steps_run} ({phase})")
        per_token = [seq for seq, count in zip(seqs, live) for _ in range(count)]
        self._check_outputs(where, graph[:, rows], eager[:, rows], per_token, phase)
        self._check_cache(where, before, owners)
        if phase == "replay":
            assert self.runner.stats.replays == replays + 1, (
                f"{where}: the step did not replay its (bucket, q_len) graph; runner: {self.runner.stats.summary()}"
            )


class DraftModelTests(ConformanceFixtures):
    @pytest.fixture
    def draft_pair(self, vendor, device, sizes, vendor_options) -> tuple[Harness, DraftHarness, str | None]:
        """(target harness, draft harness sharing its pool, why the draft
        runner takes one token per sequence only, or None)."""
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=None)
        common = dict(vendor_options=vendor_options, capture_batch_sizes=BATCH_SIZES)
        target = Harness.build(vendor, device, small, **common)
        target.check = "target step beside a draft model's graphs"
        config = dataclasses.replace(ModelConfig.tiny(small.dtype), num_hidden_layers=1)  # a smaller model, one vocabulary
        refusal = None
        limit, origin = accepted_q_len(vendor, small.resolved(vendor), vendor_options)  # K + 1 where it takes it
        try:
            if limit <= 1:
                raise ConfigError(f"max_q_len={K + 1}: it takes at most {limit} token(s) per sequence ({origin})")
            drafter = DraftHarness.build(vendor, device, small, model_config=config, seed=7,
                                         max_q_len=min(K + 1, limit), share_pool_with=target.runner, **common)
        except ConfigError as error:
            refusal = f"vendor {vendor.name} refuses multi-token decode graphs: {error}"
            drafter = DraftHarness.build(vendor, device, small, model_config=config, seed=7,
                                         share_pool_with=target.runner, **common)
        assert isinstance(drafter, DraftHarness)
        drafter.check = "draft model's graph step equals eager"
        return target, drafter, refusal

    def test_draft_steps_between_target_steps_equal_eager_in_one_pool(self, draft_pair):
        target, drafter, refusal = draft_pair
        targets, drafts = target.start(8), drafter.start(8)
        for batch in (8, 3, 1, 4):
            targets = _resize(target, targets, batch)
            drafts = _resize(drafter, drafts, batch)
            target.step(targets)  # verify stands in: a graph step of the target
            if refusal is None:  # the first draft step: every second sequence accepted all its drafts
                drafter.padded_step(drafts, [1 + i % 2 for i in range(batch)], 2)
            else:
                drafter.step(drafts)
            for _ in range(K - 1):
                drafter.step(drafts)
        target.step(targets)
        where = f"vendor {target.vendor.name} on {target.device}{target.variant}, target and draft runners"
        check_one_pool(where, target.runner, drafter.runner)

    def test_draft_first_steps_padded_for_every_accepted_count(self, draft_pair):
        """A drafter re-reading accepted tokens feeds accepted + 1 of them:
        q_len up to K + 1, any mix of live counts, padding never written."""
        target, drafter, refusal = draft_pair
        if refusal is not None:
            pytest.skip(refusal)
        top = drafter.runner.config.max_q_len  # K + 1, or the vendor's limit below it
        seqs = drafter.start(4)
        for asked, wanted in ((4, [1, 4, 2, 3]), (2, [2, 1, 1, 2]), (4, [4, 4, 4, 4]), (3, [1, 1, 1, 3]),
                              (4, [2, 1, 3, 1])):
            q_len, live = min(asked, top), [min(count, top) for count in wanted]
            if not drafter.room(seqs, q_len):
                drafter.finish(seqs)
                seqs = drafter.start(4)
            drafter.padded_step(seqs, live, q_len)
            drafter.step(seqs)


def _resize(harness: Harness, seqs: list[int], batch: int) -> list[int]:
    """``batch`` sequences with room for a few more steps: some finish, new ones join."""
    seqs = seqs[:batch] if len(seqs) >= batch else seqs + harness.start(batch - len(seqs))
    if not harness.room(seqs, K + 2):
        harness.finish(seqs)
        seqs = harness.start(batch)
    return seqs

"""Token limits hold for verify steps at the limit.

A speculative verify step carries k + 1 tokens per sequence: the k draft
tokens and the bonus token the target model samples after them. A vendor
limit written in one count and checked in the other is off by that token:
a ``graphmode_check_config`` comparing ``max_q_len - 1`` (the draft tokens)
with its kernel's limit accepts a runner of one token more than the kernel
takes, which fails at capture on the device (or reads past a buffer); a
``GraphSpec.max_q_len`` declared as the draft count does the same; a graph
family keyed only up to ``max_q_len - 1`` runs the largest verify steps
eagerly, unreported.

:class:`TokenLimitTests` finds the most tokens per sequence the vendor
accepts (``GraphSpec.max_q_len``, else the largest ``max_q_len`` up to
``PROBED_Q_LEN`` that its configuration checks accept), builds a runner
there and runs verify steps of exactly that many tokens per sequence, at the
smallest and the largest bucket: each must run in its graph, replay it, and
equal eager.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.multi_token import MultiTokenHarness
from graphmode_conformance.sizes import MIN_MAX_BATCHES, accepted_q_len
from graphmode_conformance.structure import ConformanceFailure

__all__ = ["TokenLimitTests"]

_BUCKETS = (1, 4)

class TokenLimitTests(ConformanceFixtures):
    def test_verify_steps_at_the_token_limit(self, vendor, device, sizes, vendor_options):
        """At the most tokens per sequence the vendor accepts, verify steps at
        the smallest and the largest bucket run in their graphs and equal
        eager."""
        small = dataclasses.replace(sizes, max_batches=MIN_MAX_BATCHES, capture_sizes=None).resolved(vendor)
        limit, origin = accepted_q_len(vendor, small, vendor_options)
        if limit < 2:
            pytest.skip(f"vendor {vendor.name} takes no decode graphs of several tokens per sequence ({origin})")
        # Room for the prefill and two verify steps of `limit` tokens.
        width = max(small.table_width, -(-(2 * limit + small.block) // small.block) + 1)
        at_limit = dataclasses.replace(small, table_width=width)
        harness = MultiTokenHarness.build(vendor, device, at_limit, vendor_options=vendor_options, max_q_len=limit,
                                          capture_batch_sizes=list(_BUCKETS))
        assert isinstance(harness, MultiTokenHarness)
        harness.check = "token limit"
        for bucket in _BUCKETS:
            seqs = harness.start(bucket, [at_limit.block // 2 + i for i in range(bucket)])
            for step in ("capture", "replay"):
                graphs = len(harness.runner.captured_graphs)
                try:
                    harness.decode(seqs, limit)
                except ConformanceFailure as failure:
                    # The step's own failure, without the check and place this message names.
                    what = str(failure).split(" tokens: ", 1)[-1] if " tokens: " in str(failure) else str(failure)
                    raise ConformanceFailure(_failed_at_the_limit(vendor, harness, limit, origin, bucket, what)) \
                        from failure
                if step == "capture" and len(harness.runner.captured_graphs) == graphs:
                    raise ConformanceFailure(
                        f"[token limit] vendor {vendor.name} on {device}{harness.variant}: a runner built with "
                        f"max_q_len={limit} ({origin}) ran a verify step of {limit} tokens per sequence (batch "
                        f"{bucket}) without a graph, unreported; runner: {harness.runner.stats.summary()}. A graph "
                        f"family keyed up to max_q_len - 1 leaves the verify step of k draft tokens plus the bonus "
                        "token eager. Every q_len up to max_q_len must get its graph"
                    )
            harness.finish(seqs)


def _failed_at_the_limit(vendor: Any, harness: MultiTokenHarness, limit: int, origin: str, batch: int,
                         failure: str) -> str:
    return (
        f"[token limit] vendor {vendor.name} on {harness.device}{harness.variant}: a runner of max_q_len={limit}, the "
        f"most tokens per sequence the vendor accepts ({origin}), fails a verify step of batch {batch} with {limit} "
        f"tokens per sequence ({limit - 1} draft tokens and the bonus token): {failure}. Likely cause: a token limit counted in draft "
        f"tokens where the verify step carries k + 1 per sequence (max_q_len - 1 compared with the kernel's limit, "
        f"or GraphSpec.max_q_len declared as the draft count). Hook: graphmode_check_config (or "
        f"GraphSpec.max_q_len) must refuse every max_q_len above what the kernels take, counting the bonus token"
    )

"""Steps of the same shapes with changing lengths: kernels must not keep
per-call planning state keyed by something that repeats.

A kernel may plan each call on the host (the longest kv length, a split of
the keys over blocks) and cache the plan; keyed by the step's shapes (token
count, batch), the plan goes stale where shapes repeat while lengths change.
Chunked prefill does exactly that: chunks of one size, a longer context each
time. So do decode steps of one batch size whose longest sequence grows past
a planning boundary. Graph and eager share the vendor's kernels, so a stale
plan makes both wrong alike; every step here is therefore compared twice:
graph with eager (in every execute mode), and eager with the same model on
graphmode's reference kernels (:class:`graphmode.attention.ReferenceAttentionOps`,
which plan nothing), each on a KV cache of its own.
"""

from __future__ import annotations

from typing import Any

import pytest

from graphmode.attention import ReferenceAttentionOps
from graphmode.context import StepInputs
from graphmode.model import build_reference_model
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import ConformanceFailure
from graphmode_conformance.kernels import _TOLERANCE
from graphmode_conformance.modes import EXECUTE_MODES, ModeHarness, build_in_mode

__all__ = ["PlanningStateTests"]


class PlanningHarness(ModeHarness):
    """Every eager step also run on the reference kernels and compared."""

    reference: Any = None
    reference_cache: Any = None
    # (tokens, sequences, decoding) -> the step that had those shapes and was right.
    shapes_seen: dict[tuple[int, int, bool], str]

    def _call_model(self, inputs: StepInputs) -> Any:
        eager = super()._call_model(inputs)
        if self.reference is None:
            self.reference = build_reference_model(self.model.config, ops=ReferenceAttentionOps(), device=self.device)
            self.reference.load_state_dict(self.model.state_dict())
            self.reference_cache = self.reference.make_kv_cache(self.sizes.cache_blocks, self.sizes.block)
            self.shapes_seen = {}
        attn = inputs.attn_metadata
        expected = self.reference(inputs.input_ids, inputs.position_ids, self.reference_cache, attn)
        difference = (eager.float() - expected.float()).abs().max().item()
        tolerance = _TOLERANCE.get(self.model.config.dtype, 5e-2) * max(1.0, expected.float().abs().max().item())
        shapes = (inputs.num_tokens, int(attn.q_seqlens.shape[0]), bool(attn.is_decoding))
        kv = attn.kv_seqlens.tolist()
        step = (
            f"the step of {shapes[0]} tokens of {shapes[1]} sequence{'s' * (shapes[1] != 1)} with kv lengths "
            f"{kv[:6]}{' ...' * (len(kv) > 6)} (longest {max(kv)})"
        )
        if difference <= tolerance:
            self.shapes_seen.setdefault(shapes, step)
            return eager
        earlier = self.shapes_seen.get(shapes)
        if earlier is None:
            cause = (
                "a kernel of graphmode_attention_ops computes something else than its contract at these lengths "
                "(see the [kernels] check)"
            )
        else:
            cause = (
                f"a kernel of graphmode_attention_ops keeps per-call planning state (a maximum length, a split "
                f"plan) keyed by something that repeats: {earlier}, of the same shapes, was right; at the same "
                "shapes with other lengths the kernel reused what it planned for an earlier call. Compute the plan from each call's lengths "
                "(or key it by them)"
            )
        raise ConformanceFailure(
            f"[planning state] vendor {self.vendor.name} on {self.device}{self.variant}, "
            f"{self.runner.config.execute_mode}: eagerly, at {step}, the vendor's kernels give logits differing "
            f"from graphmode's reference kernels by {difference:.3g} (tolerance {tolerance:.3g}). Likely cause: {cause}"
        )


class PlanningStateTests(ConformanceFixtures):
    @pytest.fixture(params=EXECUTE_MODES)
    def planning_harness(self, request, build_harness, sizes) -> PlanningHarness:
        harness = build_in_mode(build_harness, sizes, request.param, PlanningHarness)
        harness.check = "same shapes, changing lengths: graph equals eager"
        return harness

    def test_chunked_prefill_of_equal_chunks_with_growing_context(self, planning_harness):
        """Chunks of one size (the token count repeats), each with a longer
        context, for one sequence and for two; decode steps between."""
        harness, engine = planning_harness, planning_harness.engine
        capacity = harness.sizes.table_width * harness.sizes.block
        chunk = min(6, capacity // 8)
        one = [engine.add()]
        for _ in range(4):
            harness.prefill(one, [chunk])
        harness.decode(one)
        two = [engine.add(), engine.add()]
        for _ in range(4):
            harness.prefill(two, [chunk // 2, chunk // 2])
            harness.decode(two)

    def test_decode_steps_of_one_shape_across_planning_boundaries(self, planning_harness):
        """Decode steps of 4 sequences at a time (one shape), each step's
        group with a longer longest sequence: across blocks, powers of two
        and most of the block table's capacity; then two steps of a batch
        no bucket takes, the second with a longest sequence 2 -> half the
        table."""
        harness, engine = planning_harness, planning_harness.engine
        block, capacity = harness.sizes.block, harness.sizes.table_width * harness.sizes.block
        longest = [3, block - 1, block + 1, 2 * block + 5, capacity // 2 + 1, capacity - 4]
        groups = []
        for top in longest:
            group = [engine.add() for _ in range(4)]
            harness.prefill(group, [max(1, top // 4), max(1, top // 3), max(1, top // 2), top])
            groups.append(group)
        for group in groups:  # the same batch size at every step, a longer maximum each time
            harness.decode(group)
        for group in reversed(groups):
            harness.decode(group)
        # A batch no bucket takes decodes eagerly in graph modes (piecewise: in a token bucket), where a
        # plan made at one step is not frozen into a graph but reused by the next call of the shape.
        batch = harness.runner.capture_sizes[-1] + 1
        short, long = [engine.add() for _ in range(batch)], [engine.add() for _ in range(batch)]
        harness.prefill(short, [2] * batch)
        harness.prefill(long, [2] * (batch - 1) + [capacity // 2 + 1])
        harness.decode(short)
        harness.decode(long)

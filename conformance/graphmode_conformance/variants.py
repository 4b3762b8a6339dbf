"""Graph variants, shown with LoRA: the reference model with three adapters
(``graphmode.model.lora``), the adapter ids a step input, and the "lora"
graph variant (``graph_variants={"lora": (False, True)}``) switching the
adapters' matmuls on. Sequences with and without adapters, and with
different ones, share each step; a step where no sequence has an adapter
runs with ``lora=False`` and must replay the plain graphs. Every step is
checked like any other: outputs against eager, the cache changed only at
the live tokens' slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from graphmode.context import StepInputs
from graphmode.model.lora import add_lora
from graphmode.spec import SEQUENCES, TOKENS, BufferSpec
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.modes import EXECUTE_MODES, ModeHarness, build_in_mode

__all__ = ["GraphVariantTests", "LoraHarness"]

LORA_VARIANTS = {"lora": (False, True)}


def lora_ids_spec(mode: str) -> BufferSpec:
    """Adapter ids, padding 0 (no adapter): one per sequence where only full
    decode graphs run ("graph"), one per token where piecewise graphs run
    prefill steps too (their segments see a step as rows of tokens)."""
    return BufferSpec("lora_ids", torch.int32, shape=(SEQUENCES,) if mode == "graph" else (TOKENS,), padding=0)


def with_adapters(model: Any) -> Any:
    """The reference model with adapters 1, 2 and 3 (0: none), rank 4."""
    return add_lora(model, count=3, rank=4, seed=7)


class LoraHarness(ModeHarness):
    """Steps of sequences with the adapters of ``adapters`` (by sequence; 0
    or absent: none), passing ``lora_ids`` and ``lora``, True when any
    sequence of the step has an adapter."""

    adapters: dict[int, int]
    _extras: dict[str, Any]

    def checked(self, seqs: list[int], inputs: StepInputs) -> None:
        ids = torch.tensor([self.adapters.get(s, 0) for s in seqs], dtype=torch.int32, device=self.device)
        if self.runner.config.step_inputs[0].per_token:
            ids = ids.repeat_interleave(inputs.attn_metadata.q_seqlens.to(ids.device).long())
        self._extras = {"lora_ids": ids, "lora": any(self.adapters.get(s, 0) for s in seqs)}
        super().checked(seqs, inputs)

    def with_extras(self, inputs: StepInputs) -> StepInputs:
        return dataclasses.replace(inputs, extras={**inputs.extras, **self._extras})

    def step_variant(self) -> dict[str, Any]:
        return {"lora": self._extras["lora"]}

    def _call_runner(self, inputs: StepInputs) -> Any:
        return self.runner(inputs.input_ids, inputs.position_ids, self.graph_cache, inputs.attn_metadata,
                           **self._extras)

    def _call_model(self, inputs: StepInputs) -> Any:
        return self.model(inputs.input_ids, inputs.position_ids, self.eager_cache, inputs.attn_metadata,
                          **self._extras)


class GraphVariantTests(ConformanceFixtures):
    @pytest.mark.parametrize("mode", EXECUTE_MODES)
    def test_lora_graphs_equal_eager_for_adapters_mixed_in_a_batch(self, build_harness, sizes, mode):
        harness = build_in_mode(build_harness, sizes, mode, LoraHarness, step_inputs=[lora_ids_spec(mode)],
                                graph_variants=LORA_VARIANTS, wrap=with_adapters)
        harness.check = f"LoRA graphs equal eager, adapters mixed in a batch ({mode})"
        engine = harness.engine
        seqs = [engine.add() for _ in range(8)]
        harness.adapters = dict(zip(seqs, [0, 1, 2, 0, 3, 1, 0, 2]))
        harness.prefill(seqs, [3, 9, 1, 17, 5, 2, 11, 6])
        plain = [s for s in seqs if not harness.adapters[s]]
        for batch in (8, 3, 8, 5, 3):  # mixed adapters; the variant's captures, then replays
            harness.decode(seqs[:batch])
            harness.decode(plain)  # no adapter: the plain graphs
        newcomer = engine.add()
        harness.adapters[newcomer] = 3
        harness.prefill([*seqs[:3], newcomer], [1, 1, 1, 7])  # a mixed step: decodes and a prefill
        by_variant = harness.runner.stats.replays_by_variant
        assert by_variant["plain"] >= 4 and by_variant["lora=True"] >= 3, harness.runner.stats.summary()

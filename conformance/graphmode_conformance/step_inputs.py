"""Engine step inputs: a model reading a per-token input the engine declares
(``build_graph_runner(step_inputs=[BufferSpec(...)])``) and passes every
step with new values. Its graphs must read each step's values, from a buffer
filled with the step's other inputs, and its padding rows must stay neutral.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from graphmode.context import StepInputs
from graphmode.spec import TOKENS, BufferSpec
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.harness import Harness
from graphmode_conformance.modes import EXECUTE_MODES, ModeHarness, build_in_mode, mixed_steps

__all__ = ["StepInputsTests"]

TOKEN_SCALE = BufferSpec("token_scale", torch.float32, shape=(TOKENS,), padding=1.0)


class ScaledLogits(torch.nn.Module):
    """The reference model with each token's logits scaled by ``token_scale``,
    a model input the engine passes every step (as LoRA ids or sampling
    parameters are)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner, self.ops, self.config = model, model.ops, model.config

    def make_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_kv_cache(*args, **kwargs)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata, token_scale):
        logits = self.inner(input_ids, position_ids, past_key_values, attn_metadata)
        return logits * token_scale[None, :, None].to(logits.dtype)


def token_scale(inputs: StepInputs) -> torch.Tensor:
    """This step's scales: new values every step (from the positions)."""
    return 0.5 + (inputs.position_ids[0] % 7).float() * 0.25


class StepInputsHarness(Harness):
    def with_extras(self, inputs: StepInputs) -> StepInputs:
        return dataclasses.replace(inputs, extras={**inputs.extras, "token_scale": token_scale(inputs)})

    def _call_runner(self, inputs: StepInputs) -> Any:
        return self.runner(inputs.input_ids, inputs.position_ids, self.graph_cache, inputs.attn_metadata,
                           token_scale=token_scale(inputs))

    def _call_model(self, inputs: StepInputs) -> Any:
        return self.model(inputs.input_ids, inputs.position_ids, self.eager_cache, inputs.attn_metadata,
                          token_scale=token_scale(inputs))


class StepInputsModeHarness(ModeHarness, StepInputsHarness):
    """Checked steps of any kind in any execute mode, passing token_scale."""


class StepInputsTests(ConformanceFixtures):
    def test_a_declared_engine_input_changes_every_step(self, build_harness):
        harness = build_harness(StepInputsHarness, step_inputs=[TOKEN_SCALE], wrap=ScaledLogits)
        harness.check = "graph equals eager with an engine step input"
        seqs = harness.start(12)
        for batch in (12, 12, 7, 3, 12, 5, 7, 3):
            harness.step(seqs[:batch])  # declared-buffer checks cover token_scale's padding rows too
        assert harness.runner.stats.replays >= 4, harness.runner.stats.summary()

    @pytest.mark.parametrize("mode", EXECUTE_MODES)
    def test_a_declared_engine_input_changes_every_step_in_every_mode(self, build_harness, sizes, mode):
        # Piecewise graphs froze declared inputs and refused the second step (issue 20).
        harness = build_in_mode(build_harness, sizes, mode, StepInputsModeHarness, step_inputs=[TOKEN_SCALE],
                                wrap=ScaledLogits)
        harness.check = f"graph equals eager with an engine step input ({mode})"
        mixed_steps(harness)
        stats = harness.runner.stats
        assert stats.replays + stats.piecewise_replays >= 3, stats.summary()
